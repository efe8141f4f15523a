"""Typed, versioned, size-limited messages of the side channel and of notifications.

Wire format of one message (one ZMQ frame, or one NIXL notification):

    msgpack(Envelope{v: PROTOCOL_VERSION, body: msgpack(<one Message>), mac, key_id})

Side-channel messages are signed with the shared token (`mac` empty without one, and
`key_id` empty); a `ReadDone` is always signed with its session's key, named by
`key_id` = the session id (see `auth.py`). A `ReadAck` is the one message a producer
sends unasked, over the side channel of the decode worker whose `ReadDone` it answers. Nothing is ever unpickled: bodies decode
into the `Message` union below with msgspec, which rejects unknown kinds, missing or
mistyped fields and over-long lists or strings. Decoding order: size -> envelope ->
version -> MAC -> body, so an unauthenticated peer never reaches the body decoder.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import msgspec

from kvbridge.errors import KVBridgeError
from kvbridge.plan.geometry import AttentionKind, ModelKVSpec
from kvbridge.plan.layout import CacheLayout, InstanceLayout
from kvbridge.transfer.auth import sign, verify
from kvbridge.transfer.errors import AuthError, ProtocolError

#: Bumped on any change in what a message means: 3 names a cache's channel-major
#: halves (`LBHKNC:K=CN`), which a version-2 peer described as token-major; 4 fences
#: pulls (`ReadDone.generation`, `ReadAck`): a version-3 reader would use bytes no
#: producer confirmed; 5 plans a fan-out on the decode host (`Hello.decode_hosts`): a
#: version-4 producer would wait for ReadDones of workers that copy on their host; 6
#: reads a pull's last block whole (`TransferPlan.read_end`): a version-5 producer
#: leaves another request's KV in the slots past the last token and digests fewer bytes;
#: 7 advertises a producer's fence words (`Welcome.fence_words`, `fence.py`).
PROTOCOL_VERSION = 7

#: Bounds on untrusted fields (a worker holds at most this many cache regions, ...).
MAX_REGIONS = 4096
MAX_WORKERS = 1024
Name = Annotated[str, msgspec.Meta(max_length=256)]
Reason = Annotated[str, msgspec.Meta(max_length=4096)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack caps ints at 64 bits
Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]


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
    """Consumer -> producer worker: who I am, what my cache looks like, and a fresh
    nonce (a producer answers each nonce once: a replayed Hello is refused)."""

    instance_id: Name
    rank: Count
    model: ModelWire
    layout: LayoutWire
    nonce: Nonce
    #: the host of each decode worker (rank order) when the decode instance fans out
    #: (`planner.make_plan(decode_hosts=)`): only one worker per host reads each byte
    #: from us, the others copy it there; None: every decode worker reads its own
    decode_hosts: Annotated[list[Name], msgspec.Meta(max_length=MAX_WORKERS)] | None = None


class Welcome(msgspec.Struct, frozen=True, tag="welcome", forbid_unknown_fields=True):
    """Producer worker -> consumer: its geometry, regions and NIXL agent metadata, the
    Hello's nonce echoed (a Welcome answers one Hello only) and its own fresh nonce;
    the two nonces make the session key (`auth.session_key`).

    `regions[r]` is (base address, length in bytes) of cache region r (see
    `CacheLayout`: the regions are the combinations of the axes before B);
    `worker_endpoints[p]` is the side channel of the producer instance's worker p.
    `fence_words` is where its `fence.SLOTS` fence words lie (0: it has none, its
    readers wait for ReadAcks).
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
    hello_nonce: Nonce
    nonce: Nonce
    fence_words: U64 = 0
    #: the prefill instance's certificate, and its key's signature over this Welcome
    #: with `signature` empty (`credential.signed_by_prefill`); empty without a credential
    certificate: Annotated[bytes, msgspec.Meta(max_length=1024)] = b""
    signature: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


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
    """Consumer -> producer worker (NIXL notification): decode worker `rank` of
    `instance_id` is done with `request_id` at prefill worker `to_rank` of `to_instance`:
    its reads finished (`ok`), or it gave up (`ok` False, `reason`) and will not read
    again. Either way the producer may stop waiting for it. Signed with the session key
    (the envelope's key_id); `sent_at` (Unix seconds) bounds how long it may be replayed."""

    request_id: Name
    instance_id: Name
    rank: Count
    to_instance: Name
    to_rank: Count
    sent_at: float
    ok: bool = True
    reason: Reason = ""
    #: the exposure read (`Expose.generation`, from the pull's capability)
    generation: U64 = 0
    #: the pull's first token (its copy lists begin there), and whether the reader
    #: checks a digest of what it read (`integrity.py`): the ReadAck then carries one
    start_token: Count = 0
    digest: bool = False


class Meet(msgspec.Struct, frozen=True, tag="meet", forbid_unknown_fields=True):
    """Consumer -> producer worker (NIXL notification, signed with the session key),
    once after an introduction, on a small warm-up READ: nothing to do. It takes the
    path a pull's READ and ReadDone take, so the first pull finds it set up (NIXL and
    UCX set up a peer's READ and notification paths at their first use)."""

    instance_id: Name
    rank: Count


class ReadAck(msgspec.Struct, frozen=True, tag="read_ack", forbid_unknown_fields=True):
    """Producer worker -> consumer (side channel, unasked): the answer to an ok
    `ReadDone` of `request_id` at `generation`. `held` is True only if that exposure was
    still pinned when the ReadDone arrived: it was pinned before the reads began and the
    reads ended before the ReadDone left, so the bytes read are the bytes exposed.
    False (lease expired, released, another generation, refused): they may be another
    request's; `reason` says why. `rank` is the producer worker's."""

    request_id: Name
    generation: U64
    rank: Count
    held: bool
    reason: Reason = ""
    #: held and asked: the digest of the exposed bytes the reader's copy lists cover
    #: (`integrity.digest`); b"": not computed (not asked, or device memory)
    digest: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


class LocalReady(msgspec.Struct, frozen=True, tag="local_ready", forbid_unknown_fields=True):
    """Decode worker -> a decode worker of its own instance on its host (NIXL
    notification, signed with the instance's sibling key), about the bytes of
    `request_id` (`generation`) that `rank` reads over the link for both of them: they
    are in its cache (`ok`), so the receiver may copy them from there (the second hop of
    a fan-out), and, once `confirmed`, the producers confirmed them (the receiver may use
    its copy only then); or its pull failed (`ok` False, `reason`): nothing will come,
    and a copy made is not to be used. A source tells both: in place as soon as its
    READs are done (the receiver copies while the producers confirm), then confirmed."""

    request_id: Name
    generation: U64
    rank: Count
    ok: bool
    reason: Reason = ""
    confirmed: bool = False


Message = Hello | Welcome | Refused | Ping | Pong | ReadDone | ReadAck | LocalReady | Meet


class Sibling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a decode worker tells the other workers of its instance (through its
    engine, at start-up: `KVConsumer.sibling`) so they can copy the bytes it reads for
    them (a fan-out) and it can tell them when: its host, its NIXL agent and its cache's
    regions (as peers read them)."""

    rank: Count
    host: Name
    agent_name: Name
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=16 << 20)]
    regions: Annotated[list[tuple[U64, U64]], msgspec.Meta(max_length=MAX_REGIONS)]
    mem_type: Name
    device_id: Count


class Envelope(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    v: int
    body: bytes
    mac: bytes = b""
    key_id: Annotated[bytes, msgspec.Meta(max_length=32)] = b""


_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_body_decoder = msgspec.msgpack.Decoder(Message)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: Message, key: bytes | None, key_id: bytes = b"") -> bytes:
    """The wire bytes of `msg`, signed with `key` when one is set (`key_id` names it)."""
    body = _encoder.encode(msg)
    return _encoder.encode(Envelope(PROTOCOL_VERSION, body, sign(key, body), key_id))


#: Looks up a signing key by its id (None: unknown).
KeyLookup = Callable[[bytes], bytes | None]


def decode(data: bytes, key: bytes | None, max_bytes: int) -> Message:
    """Parse wire bytes signed with the shared `key` (unchecked when None); raises
    ProtocolError (or AuthError) with the reason on any defect."""
    return _decode(data, key, max_bytes, None)[0]


def decode_signed(data: bytes, keys: KeyLookup, max_bytes: int) -> tuple[Message, bytes]:
    """Parse wire bytes that must be signed by a session `keys` knows; returns the
    message and its session id. Raises AuthError for an unsigned or unknown one."""
    msg, key_id = _decode(data, None, max_bytes, keys)
    if not key_id:
        raise AuthError("message is not signed by a session")
    return msg, key_id


def _decode(
    data: bytes, key: bytes | None, max_bytes: int, keys: KeyLookup | None
) -> tuple[Message, bytes]:
    """An envelope with a key_id is verified with `keys(key_id)` (and refused if `keys`
    is None or does not know it); one without with `key` when it is set."""
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
    if env.key_id:
        found = keys(env.key_id) if keys is not None else None
        if found is None:
            raise AuthError(f"message signed by unknown session {env.key_id.hex()}")
        if not verify(found, env.body, env.mac):
            raise AuthError("message has a wrong HMAC for its session")
    elif key is not None and not verify(key, env.body, env.mac):
        why = "has no HMAC" if not env.mac else "has a wrong HMAC"
        raise AuthError(f"message {why}; the peer does not hold the shared transfer token")
    try:
        return _body_decoder.decode(env.body), env.key_id
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed message: {exc}") from None


_sibling_decoder = msgspec.msgpack.Decoder(Sibling)
#: A `Sibling` is a few KiB plus its NIXL agent metadata.
MAX_SIBLING_BYTES = 17 << 20


def encode_sibling(info: Sibling) -> bytes:
    return _encoder.encode(info)


def welcome_body(welcome: Welcome) -> bytes:
    """What a Welcome's signature covers: the Welcome with its signature empty."""
    return _encoder.encode(msgspec.structs.replace(welcome, signature=b""))


def decode_sibling(data: bytes) -> Sibling:
    """Parse a `Sibling`; ProtocolError on any defect."""
    if len(data) > MAX_SIBLING_BYTES:
        raise ProtocolError(f"sibling entry of {len(data)} bytes exceeds {MAX_SIBLING_BYTES}")
    try:
        return _sibling_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed sibling entry: {exc}") from None


def spec_error(exc: Exception) -> str:
    """A one-line reason for a refused geometry (a KVBridgeError's own message)."""
    return str(exc) if isinstance(exc, KVBridgeError) else f"{type(exc).__name__}: {exc}"
