"""Pull capabilities: a prefill instance's signed permission to read one request.

When a prefill instance exposes a request it issues a capability naming the request,
itself and its side channel, the blocks and token range, the one decode instance that
may read it (the reader) and an expiry. The router passes it on unchanged; the decode
instance pulls only with a valid capability addressed to itself, and takes the blocks
from it rather than from whoever called. The producer, told the reader at `expose`,
takes completion notifications from that instance only.

Signed with a key derived from the shared token (`auth.derive`); without a token
(loopback only) the key is public, so a capability then proves nothing.
"""

from __future__ import annotations

import time
from typing import Annotated

import msgspec

from kvbridge.transfer.auth import derive, sign, verify
from kvbridge.transfer.errors import AuthError

_VERSION = 2
Name = Annotated[str, msgspec.Meta(max_length=256)]


class Capability(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: Name
    producer: Name  # prefill instance id
    endpoint: Name  # its worker 0's side channel
    block_ids: Annotated[list[int], msgspec.Meta(max_length=1 << 20)]
    num_tokens: int
    reader: Name  # the decode instance id it is issued to
    expires_at: float  # Unix seconds
    #: the reader holds tokens [0, start_token) already (prefix cache): `block_ids` are
    #: the blocks from the one holding token `start_token` on
    start_token: int = 0
    block_size: int = 0  # tokens per block of the producer (0: not said)


class _Signed(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    v: int
    body: bytes
    mac: bytes


_encoder = msgspec.msgpack.Encoder()
_signed = msgspec.msgpack.Decoder(_Signed)
_body = msgspec.msgpack.Decoder(Capability)


def _key(token: bytes | None) -> bytes:
    return derive(token, "kvbridge capability v1")


def issue(cap: Capability, token: bytes | None) -> bytes:
    """The signed bytes of `cap` (opaque to routers)."""
    body = _encoder.encode(cap)
    return _encoder.encode(_Signed(_VERSION, body, sign(_key(token), body)))


def check(data: bytes, token: bytes | None, reader: str, now: float | None = None) -> Capability:
    """The capability in `data` if it is signed with `token`'s key, unexpired and issued
    to `reader`; AuthError naming what is wrong otherwise."""
    if len(data) > 8 << 20:
        raise AuthError(f"capability of {len(data)} bytes is too large")
    try:
        env = _signed.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise AuthError(f"malformed capability: {exc}") from None
    if env.v != _VERSION:
        raise AuthError(f"capability version={env.v}; this side reads version {_VERSION}")
    if not verify(_key(token), env.body, env.mac):
        raise AuthError("capability signature is wrong: not issued by a holder of our token")
    try:
        cap = _body.decode(env.body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise AuthError(f"malformed capability: {exc}") from None
    if cap.reader != reader:
        raise AuthError(
            f"capability for {cap.request_id!r} was issued to decode instance {cap.reader!r}, "
            f"not to this one ({reader!r})"
        )
    now = time.time() if now is None else now
    if now > cap.expires_at:
        raise AuthError(
            f"capability for {cap.request_id!r} expired {now - cap.expires_at:.1f} s ago"
        )
    return cap
