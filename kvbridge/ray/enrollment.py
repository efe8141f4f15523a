"""Role credentials for replicas Ray starts: a pool enrolled ahead of time, each claimed once.

Ray Serve starts, restarts and scales replicas itself and gives none an identity of its
own, while KVBridgeConnector needs one credential per instance (`credential_file`: the
instance id ``NAME@fingerprint`` of the instance's own CURVE key, its signing key, the
roles the deployment's root certified). The root key stays with the launcher: it never
goes to a node or a replica, so a replica cannot enroll itself. Instead the launcher
enrolls, per deployment, a pool of credentials for the deployment's role into a private
directory (`enroll_pool`), and each replica claims one as it starts (`claim`, from the
connector backend's `setup()` in the replica): a claim is a file made with O_EXCL, so no
two replicas, and no replica started after another ended, ever hold the same credential.

Why not one credential per role shared by its replicas: the instance id binds one key,
and peers treat one id as one instance. Two prefill replicas under one id would be one
producer to a decode worker (a restarted replica that came back under the same id
would not be met afresh: the decode worker keeps the dead replica's session and owed
notifications), and two decode replicas under one id would share a prefill worker's
session slots and pinned-request room (per decode worker rank of an id): each
handshake would replace the other's session. Distinct credentials keep replicas apart.

A pool holds as many credentials as replicas will ever start (restarts included);
`claim` names the pool and how to enroll more when it runs out. Layout::

    POOL/NAME-0.credential, NAME-1.credential, ...   (0600, in a 0700 directory)
    POOL/NAME-0.claim                                (who claimed it: JSON)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvbridge.connector import RootKey
from kvbridge.errors import ConfigError
from kvbridge.vllm.settings import ROLES

CREDENTIAL_SUFFIX = ".credential"
CLAIM_SUFFIX = ".claim"


def enroll_pool(root: RootKey, kv_role: str, name: str, count: int, pool: str | Path) -> Path:
    """`count` credentials `root` enrolls for vLLM instances of `kv_role`, named
    ``NAME-i``, in the private directory `pool` (made if missing); returns it."""
    if kv_role not in ROLES:
        raise ConfigError(f"kv_role={kv_role!r}; use one of {', '.join(ROLES)}")
    if count < 1:
        raise ConfigError(f"count={count}: a pool holds at least one credential")
    pool = Path(pool)
    pool.mkdir(mode=0o700, parents=True, exist_ok=True)
    for i in range(count):
        root.enroll(ROLES[kv_role], f"{name}-{i}").save(pool / f"{name}-{i}{CREDENTIAL_SUFFIX}")
    return pool


def claim(pool: str | Path, claimer: Mapping[str, Any]) -> Path:
    """The first credential of `pool` nobody claimed, now claimed by `claimer` (written
    to its claim file, e.g. the replica's node and pid); its path. Raises ConfigError
    when every credential is taken."""
    pool = Path(pool)
    try:
        names = sorted(p.name for p in pool.iterdir() if p.name.endswith(CREDENTIAL_SUFFIX))
    except OSError as exc:
        raise ConfigError(f"credential pool {str(pool)!r} cannot be read: {exc}") from None
    for name in names:
        stem = name.removesuffix(CREDENTIAL_SUFFIX)
        try:
            fd = os.open(
                pool / f"{stem}{CLAIM_SUFFIX}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600
            )
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as f:
            json.dump({"credential": name, **claimer}, f)
        return pool / name
    raise ConfigError(
        f"credential pool {str(pool)!r}: all {len(names)} credentials are claimed (each "
        "replica start takes one, restarts included); enroll more into it "
        "(kvbridge.ray.enrollment.enroll_pool with the deployment's root)"
    )


def claims(pool: str | Path) -> list[dict[str, Any]]:
    """Every claim made on `pool`, in credential order (what each replica wrote)."""
    pool = Path(pool)
    found = sorted(pool.glob(f"*{CLAIM_SUFFIX}"))
    return [json.loads(p.read_text()) for p in found]
