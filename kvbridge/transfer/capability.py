"""Pull capabilities: a prefill instance's signed permission to read one request.

When a prefill instance exposes a request it issues a capability naming the request,
itself and its side channel, the blocks and token range, the one decode instance that
may read it (the reader) and an expiry. The router passes it on unchanged; the decode
instance pulls only with a valid capability addressed to itself, and takes the blocks
from it rather than from whoever called. The producer, told the reader at `expose`,
takes completion notifications from that instance only.

A request of several cache groups (a hybrid model's sliding-window and full-attention
layers, each group with its own block table) is one capability: `groups` carries each
group's exposed blocks (`BlockTable`), each group exposed and pulled as a transfer of
its own (`transfer_id`).

A capability binds the prompt it was computed for (`prompt_digest` of its token ids)
as well as the block range, so it opens the KV of that prompt only: a holder who sends
other token ids of the same length is refused. It opens one pull: the reader redeems it
(`Redeemed`) and refuses it a second time until it expires.

Signed by the prefill instance that issued it, with its own key, and carrying the
certificate the deployment's root made for that key (`credential.py`): a reader accepts
it only if its root certified the signer as a prefill instance, and as the producer the
capability names. Without a root (open mode, loopback only) any certificate is taken, so
a capability then proves nothing.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Sequence
from typing import Annotated

import msgspec
import numpy as np

from kvbridge.transfer.credential import Credential, signed_by_prefill
from kvbridge.transfer.errors import AuthError

_VERSION = 5  # 5: signed by the producer's certified key
Name = Annotated[str, msgspec.Meta(max_length=256)]


class BlockTable(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One cache group's blocks of a request from the one holding token `first_token`
    on: token t lies in block `block_ids[t // block_size - first_token // block_size]`.
    A group that no longer holds a request's first tokens (a sliding window freed the
    blocks behind it) starts past 0."""

    block_ids: Annotated[list[int], msgspec.Meta(max_length=1 << 20)]
    first_token: Annotated[int, msgspec.Meta(ge=0)] = 0


class CapabilityExpired(AuthError):
    """A capability a prefill instance our root enrolled signed for this reader, taken
    after it expired (`cap`): genuine, but its blocks may be gone (the prefill's lease)."""

    def __init__(self, message: str, cap: Capability) -> None:
        super().__init__(message)
        self.cap = cap


def transfer_id(request_id: str, group: int) -> str:
    """The id cache group `group` of `request_id` is exposed and pulled under: the
    request's own for group 0, a suffixed one for the others."""
    return request_id if group == 0 else f"{request_id}#g{group}"


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
    #: `prompt_digest` of the prompt's token ids (b"": bound to no prompt, refused)
    prompt_digest: Annotated[bytes, msgspec.Meta(max_length=64)] = b""
    #: which exposure of `request_id` this opens (`Expose.generation`): the reader names
    #: it in its ReadDone, and uses the bytes only once the producer confirms it held it
    generation: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: a request of several cache groups: each group's exposed blocks, from token
    #: max(start_token, the first the group holds) on (`block_ids` is then empty);
    #: empty: one group, `block_ids`
    groups: Annotated[list[BlockTable], msgspec.Meta(max_length=64)] = []

    @property
    def tables(self) -> list[BlockTable]:
        """The exposed blocks of each cache group (one group: `block_ids`)."""
        return self.groups or [BlockTable(self.block_ids, self.start_token)]


def new_generation() -> int:
    """A fresh exposure generation: random, so no exposure (of any request id, before or
    after a restart) shares one with another but by a 2**-63 chance."""
    return secrets.randbits(63)


def prompt_digest(token_ids: Sequence[int]) -> bytes:
    """The digest a capability binds: BLAKE2b of the token ids as little-endian int64."""
    data = np.asarray(token_ids, dtype="<i8").tobytes()
    return hashlib.blake2b(data, digest_size=16, person=b"kvbridge-prompt").digest()


class _Signed(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    v: int
    body: bytes
    sig: Annotated[bytes, msgspec.Meta(max_length=64)]
    certificate: Annotated[bytes, msgspec.Meta(max_length=1024)]  # the signer's


_encoder = msgspec.msgpack.Encoder()
_signed = msgspec.msgpack.Decoder(_Signed)
_body = msgspec.msgpack.Decoder(Capability)


def issue(cap: Capability, credential: Credential) -> bytes:
    """The signed bytes of `cap` (opaque to routers), signed by `credential`'s key."""
    body = _encoder.encode(cap)
    sig = credential.sign(body)
    return _encoder.encode(_Signed(_VERSION, body, sig, credential.certificate))


def _signed_by_producer(data: bytes, root: bytes | None) -> Capability:
    """The capability in `data` if `root` certified its signer as the prefill instance
    it names (root None: any certificate, open mode); AuthError naming what is wrong."""
    if len(data) > 8 << 20:
        raise AuthError(f"capability of {len(data)} bytes is too large")
    try:
        env = _signed.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise AuthError(f"malformed capability: {exc}") from None
    if env.v != _VERSION:
        raise AuthError(f"capability version={env.v}; this side reads version {_VERSION}")
    cert = signed_by_prefill(env.certificate, env.sig, env.body, root, "capability")
    try:
        cap = _body.decode(env.body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise AuthError(f"malformed capability: {exc}") from None
    if cap.producer != cert.instance_id:
        raise AuthError(
            f"capability names producer {cap.producer!r} but is signed by "
            f"{cert.instance_id!r}: a prefill instance issues capabilities for itself only"
        )
    return cap


def check(data: bytes, root: bytes | None, reader: str, now: float | None = None) -> Capability:
    """The capability in `data` if a prefill instance certified by `root` signed it,
    it is unexpired and issued to `reader` (or to no reader in particular: a prefill
    request that named none, as vLLM's proxies send); AuthError naming what is wrong
    otherwise."""
    cap = _signed_by_producer(data, root)
    if cap.reader not in (reader, ""):
        raise AuthError(
            f"capability for {cap.request_id!r} was issued to decode instance {cap.reader!r}, "
            f"not to this one ({reader!r})"
        )
    now = time.time() if now is None else now
    if now > cap.expires_at:
        raise CapabilityExpired(
            f"capability for {cap.request_id!r} expired {now - cap.expires_at:.1f} s ago", cap
        )
    return cap


class Redeemed:
    """The capabilities one reader has taken, each remembered until it expires (then
    `check` refuses it anyway): a capability opens one pull. Owned by the reader (a decode
    instance); called from one thread."""

    def __init__(self) -> None:
        self._until: dict[bytes, float] = {}

    def __len__(self) -> int:
        return len(self._until)

    def redeem(self, cap: Capability, now: float | None = None) -> None:
        """Take `cap`; AuthError if it was taken before."""
        now = time.time() if now is None else now
        for key in [k for k, until in self._until.items() if until < now]:
            del self._until[key]
        key = hashlib.blake2b(_encoder.encode(cap), digest_size=16).digest()
        if key in self._until:
            raise AuthError(
                f"capability for {cap.request_id!r} was used before: a capability opens one "
                "pull; the prefill instance issues a new one with each prefill"
            )
        self._until[key] = cap.expires_at
