"""Typed, versioned, size-limited messages of the side channel and of notifications.

Wire format of one message (one ZMQ frame, or one NIXL notification):

    msgpack(Envelope{v: PROTOCOL_VERSION, body: msgpack(<one Message>), mac: HMAC-SHA256(body)})

`mac` is empty when no token is configured. Nothing is ever unpickled: bodies decode
into the `Message` union below with msgspec, which rejects unknown kinds, missing or
mistyped fields and over-long lists or strings. Decoding order: size -> envelope ->
version -> HMAC -> body, so an unauthenticated peer never reaches the body decoder.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvbridge.errors import KVBridgeError
from kvbridge.plan.geometry import AttentionKind, ModelKVSpec
from kvbridge.plan.layout import CacheLayout, InstanceLayout
from kvbridge.transfer.auth import sign, verify
from kvbridge.transfer.errors import AuthError, ProtocolError

PROTOCOL_VERSION = 1

#: Bounds on untrusted fields (a worker holds at most this many cache regions, ...).
MAX_REGIONS = 4096
MAX_WORKERS = 1024
Name = Annotated[str, msgspec.Meta(max_length=256)]
Reason = Annotated[str, msgspec.Meta(max_length=4096)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack caps ints at 64 bits


class ModelWire(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    num_layers: Count
    num_attention_heads: Count
    num_kv_heads: Count
    head_dim: Count
    dtype: Name
    attention: Name
    name: Name

    @classmethod
    def of(cls, model: ModelKVSpec) -> ModelWire:
        return cls(
            model.num_layers,
            model.num_attention_heads,
            model.num_kv_heads,
            model.head_dim,
            model.dtype,
            model.attention.value,
            model.name[-256:],
        )

    def to_spec(self) -> ModelKVSpec:
        """The spec; raises a KVBridgeError subclass (ConfigError) on invalid fields."""
        try:
            kind = AttentionKind(self.attention)
        except ValueError:
            raise ProtocolError(f"attention={self.attention!r} is not an attention kind") from None
        return ModelKVSpec(
            self.num_layers,
            self.num_attention_heads,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            kind,
            self.name,
        )


class LayoutWire(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tp_size: Count
    pp_size: Count
    block_size: Count
    cache_layout: Name
    dtype: Name | None = None
    pp_layers: Annotated[list[Count], msgspec.Meta(max_length=MAX_WORKERS)] | None = None

    @classmethod
    def of(cls, layout: InstanceLayout) -> LayoutWire:
        return cls(
            layout.tp_size,
            layout.pp_size,
            layout.block_size,
            layout.cache_layout.value,
            layout.dtype,
            list(layout.pp_layers) if layout.pp_layers else None,
        )

    def to_layout(self) -> InstanceLayout:
        return InstanceLayout(
            tp_size=self.tp_size,
            pp_size=self.pp_size,
            block_size=self.block_size,
            cache_layout=CacheLayout.parse(self.cache_layout),
            dtype=self.dtype,
            pp_layers=tuple(self.pp_layers) if self.pp_layers is not None else None,
        )


class Hello(msgspec.Struct, frozen=True, tag="hello", forbid_unknown_fields=True):
    """Consumer -> producer worker: who I am and what my cache looks like."""

    instance_id: Name
    rank: Count
    model: ModelWire
    layout: LayoutWire


class Welcome(msgspec.Struct, frozen=True, tag="welcome", forbid_unknown_fields=True):
    """Producer worker -> consumer: its geometry, regions and NIXL agent metadata.

    `regions[r]` is (base address, length in bytes) of cache region r
    (r = local_layer * num_kv_tensors + kv); `worker_endpoints[p]` is the side
    channel of the producer instance's worker p.
    """

    instance_id: Name
    rank: Count
    model: ModelWire
    layout: LayoutWire
    num_blocks: Count
    regions: Annotated[list[tuple[U64, U64]], msgspec.Meta(max_length=MAX_REGIONS)]
    mem_type: Name
    device_id: Count
    agent_name: Name
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=16 << 20)]
    worker_endpoints: Annotated[list[Name], msgspec.Meta(max_length=MAX_WORKERS)]


class Refused(msgspec.Struct, frozen=True, tag="refused", forbid_unknown_fields=True):
    """Any side -> peer: the request was refused; `reason` is the human-readable cause."""

    kind: Name
    reason: Reason


class Ping(msgspec.Struct, frozen=True, tag="ping", forbid_unknown_fields=True):
    nonce: U64


class Pong(msgspec.Struct, frozen=True, tag="pong", forbid_unknown_fields=True):
    nonce: U64
    instance_id: Name


class ReadDone(msgspec.Struct, frozen=True, tag="read_done", forbid_unknown_fields=True):
    """Consumer -> producer worker (NIXL notification): decode worker `rank` is done with
    `request_id` here: its reads finished (`ok`), or it gave up (`ok` False, `reason`)
    and will not read again. Either way the producer may stop waiting for it."""

    request_id: Name
    instance_id: Name
    rank: Count
    ok: bool = True
    reason: Reason = ""


Message = Hello | Welcome | Refused | Ping | Pong | ReadDone


class Envelope(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    v: int
    body: bytes
    mac: bytes = b""


_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_body_decoder = msgspec.msgpack.Decoder(Message)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: Message, token: bytes | None) -> bytes:
    """The wire bytes of `msg`, signed with `token` when one is set."""
    body = _encoder.encode(msg)
    return _encoder.encode(Envelope(PROTOCOL_VERSION, body, sign(token, body)))


def decode(data: bytes, token: bytes | None, max_bytes: int) -> Message:
    """Parse wire bytes; raises ProtocolError (or AuthError) with the reason on any defect."""
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        env = _envelope_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed envelope: {exc}") from None
    if env.v != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version={env.v} is not supported; this side speaks version {PROTOCOL_VERSION}"
        )
    if token is not None and not verify(token, env.body, env.mac):
        why = "has no HMAC" if not env.mac else "has a wrong HMAC"
        raise AuthError(f"message {why}; the peer does not hold the shared transfer token")
    try:
        return _body_decoder.decode(env.body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed message: {exc}") from None


def spec_error(exc: Exception) -> str:
    """A one-line reason for a refused geometry (a KVBridgeError's own message)."""
    return str(exc) if isinstance(exc, KVBridgeError) else f"{type(exc).__name__}: {exc}"
