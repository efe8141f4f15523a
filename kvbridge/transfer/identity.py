"""Instance identities: a decode instance's own key pair, and the instance id bound to it.

With a shared token every side-channel connection speaks ZMQ CURVE, which proves that
the client holds the secret key of the public key it presents. An instance made with an
`Identity` uses that key pair for every connection of every worker, and its instance id
names the key: ``NAME@FINGERPRINT`` (32 hex digits of BLAKE2b over the public key).
A producer learns each connection's public key from the CURVE handshake (ZAP) and
refuses a Hello whose instance id is bound to another key; so a token holder cannot
claim a bound instance's id, its sessions, or the ReadDones of a capability issued to it
(capabilities name the reader by that id, so they name its key).

An id without ``@FINGERPRINT`` binds nothing (a tool or test instance): it cannot be
mistaken for a bound one, whose fingerprint only the key's holder can present. Without a
token nothing is authenticated (loopback only) and bindings are not checked.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.utils import z85

from kvbridge.errors import ConfigError

_BOUND = re.compile(r".*@([0-9a-f]{32})")


def fingerprint(public_key: bytes) -> str:
    """32 hex digits naming a CURVE public key (Z85-encoded, as ZMQ reports it)."""
    return hashlib.blake2b(
        z85.decode(public_key), digest_size=16, person=b"kvbridge-id"
    ).hexdigest()


def bound_fingerprint(instance_id: str) -> str | None:
    """The key fingerprint `instance_id` is bound to, or None for an unbound id."""
    m = _BOUND.fullmatch(instance_id)
    return m.group(1) if m else None


def binding_refusal(instance_id: str, public_key: bytes | None) -> str | None:
    """Why a connection presenting `public_key` may not act as `instance_id` (None: it
    may). `public_key` None: the channel authenticates no key (no token), so nothing is
    checked."""
    bound = bound_fingerprint(instance_id)
    if bound is None or public_key is None:
        return None
    if public_key and fingerprint(public_key) == bound:
        return None
    return (
        f"instance_id={instance_id!r} is bound to the key with fingerprint {bound}; this "
        "connection presented another key (only that instance may use its id)"
    )


def read_private(path: str | Path, setting: str) -> bytes:
    """The contents of a key file; refused if others may read it (its key would name
    anyone who read it)."""
    try:
        mode = os.stat(path).st_mode
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{setting}={str(path)!r}: {exc.strerror or exc}") from None
    if mode & 0o077:
        raise ConfigError(
            f"{setting}={str(path)!r} may be read by others (mode {mode & 0o777:o}); "
            f"make it private: chmod 600 {path}"
        )
    return data


def write_private(path: str | Path, data: bytes) -> None:
    """Write `data` to a new file only its owner may read."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


@dataclass(frozen=True)
class Identity:
    """One instance's CURVE key pair (`secret`: Z85, 40 characters). Every worker of the
    instance gets the same one (`ConnectorSpec.identity`)."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        try:
            ok = len(self.secret) == 40 and len(z85.decode(self.secret)) == 32
        except (ValueError, KeyError, IndexError):
            ok = False
        if not ok:
            raise ConfigError(
                "identity: not a CURVE secret key (40 Z85 characters); make one with "
                "Identity.generate() (kvbridge instances and kvbridge.vllm.launch do)"
            )

    @classmethod
    def generate(cls) -> Identity:
        return cls(zmq.curve_keypair()[1])

    @property
    def public(self) -> bytes:
        return zmq.curve_public(self.secret)

    def bind(self, name: str) -> str:
        """The instance id `name` bound to this key: ``name@fingerprint``."""
        return f"{name}@{fingerprint(self.public)}"

    def check_id(self, instance_id: str) -> None:
        """Refuse an instance id bound to another key (a misconfiguration: every peer
        would refuse this instance's handshakes)."""
        if binding_refusal(instance_id, self.public) is not None:
            raise ConfigError(
                f"instance_id={instance_id!r} is bound to the key with fingerprint "
                f"{bound_fingerprint(instance_id)}, "
                f"not to this identity's ({fingerprint(self.public)}); use "
                f"{self.bind(instance_id.rsplit('@', 1)[0])!r} or that key"
            )
