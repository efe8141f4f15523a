"""The test deployment's root key, credentials it enrolls (`credential.py`), and what a
holder of some credential can make of a real capability (`opened`, `resigned`)."""

from __future__ import annotations

from typing import Any

import msgspec

from kvbridge.connector import ConnectorRole, Credential, Identity, RootKey
from kvbridge.transfer.capability import Capability

ROOT = RootKey.generate()


def enrolled(role: ConnectorRole, instance_id: str, root: RootKey = ROOT) -> Credential:
    """A credential `root` certified for `instance_id` in `role` (a new key pair)."""
    return root.certify((role,), instance_id, Identity.generate())


def opened(data: bytes) -> Capability:
    """The capability signed bytes `data` carry (read as anyone can, unchecked)."""
    body = msgspec.msgpack.decode(data)[1]  # [version, body, signature, certificate]
    return msgspec.msgpack.decode(body, type=Capability)


def resigned(data: bytes, signer: Credential | None, **changes: Any) -> bytes:
    """The capability of `data` with `changes`, under the signer's certificate it came
    with, signed with `signer`'s key (None: its signature kept): what a holder of
    `signer` makes of a real capability."""
    version, _body, sig, certificate = msgspec.msgpack.decode(data)
    body = msgspec.msgpack.encode(msgspec.structs.replace(opened(data), **changes))
    if signer is not None:
        sig = signer.sign(body)
    return msgspec.msgpack.encode([version, body, sig, certificate])
