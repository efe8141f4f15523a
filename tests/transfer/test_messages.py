"""Wire messages: typed, versioned, size-limited, HMAC-authenticated; never pickled."""

from __future__ import annotations

import msgspec
import pytest

from kvbridge.errors import ConfigError
from kvbridge.plan.geometry import AttentionKind, ModelKVSpec
from kvbridge.plan.layout import InstanceLayout
from kvbridge.transfer.config import TransferConfig, load_token
from kvbridge.transfer.errors import AuthError, ProtocolError
from kvbridge.transfer.messages import (
    MAX_REGIONS,
    PROTOCOL_VERSION,
    Envelope,
    Hello,
    LayoutWire,
    ModelWire,
    Ping,
    ReadDone,
    Welcome,
    decode,
    decode_signed,
    encode,
)

TOKEN = b"0123456789abcdef-shared"
MODEL = ModelKVSpec(4, 8, 2, 16, "float16", AttentionKind.GQA, "tiny")
LAYOUT = InstanceLayout(tp_size=2, pp_size=2, block_size=32, cache_layout="NHD", pp_layers=(1, 3))


def welcome(num_regions: int = 4) -> Welcome:
    return Welcome(
        instance_id="p",
        rank=1,
        model=ModelWire.of(MODEL),
        layout=LayoutWire.of(LAYOUT),
        num_blocks=10,
        regions=[(4096 * (i + 1), 4096) for i in range(num_regions)],
        mem_type="DRAM",
        device_id=0,
        agent_name="agent-p1",
        agent_metadata=b"\x00md",
        worker_endpoints=["tcp://127.0.0.1:5000", "tcp://127.0.0.1:5001"],
        hello_nonce=b"h" * 16,
        nonce=b"w" * 16,
    )


def read_done(request_id: str = "r1") -> ReadDone:
    return ReadDone(
        request_id=request_id, instance_id="d", rank=0, to_instance="p", to_rank=1, sent_at=1.0
    )


@pytest.mark.parametrize("token", [None, TOKEN])
def test_round_trip_keeps_every_field(token: bytes | None) -> None:
    msg = welcome()
    got = decode(encode(msg, token), token, 1 << 20)
    assert got == msg
    assert isinstance(got, Welcome)
    assert got.model.to_spec() == MODEL
    assert got.layout.to_layout() == LAYOUT


def test_a_channel_major_half_crosses_the_wire() -> None:
    """vLLM's CPU layout (K channel-major) reaches the peer that plans with it."""
    cpu = InstanceLayout(tp_size=1, block_size=64, cache_layout="LBHKNC:K=CN")
    hello = Hello("d", 0, ModelWire.of(MODEL), LayoutWire.of(cpu), b"n" * 16)
    wire = decode(encode(hello, None), None, 1 << 20)
    assert isinstance(wire, Hello) and wire.layout.cache_layout == "LBHKNC:K=CN"
    assert wire.layout.to_layout() == cpu


def test_oversized_message_is_rejected_with_its_size() -> None:
    data = encode(welcome(), None)
    with pytest.raises(
        ProtocolError, match=f"message of {len(data)} bytes exceeds the limit of 100"
    ):
        decode(data, None, 100)


@pytest.mark.parametrize(
    "data", [b"", b"\x00\x01garbage", b"\x93" + bytes([PROTOCOL_VERSION]) + b"\xc4\x01x\xc4\x00"]
)
def test_malformed_bytes_are_rejected(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed"):
        decode(data, None, 1 << 20)


def test_unknown_message_kind_is_rejected() -> None:
    body = msgspec.msgpack.encode({"type": "shutdown_everything"})
    data = msgspec.msgpack.encode(Envelope(PROTOCOL_VERSION, body, b""))
    with pytest.raises(ProtocolError, match="malformed message"):
        decode(data, None, 1 << 20)


def test_other_protocol_version_is_rejected_by_number() -> None:
    body = msgspec.msgpack.encode(Ping(nonce=1))
    data = msgspec.msgpack.encode(Envelope(2, body, b""))  # before channel-major halves
    with pytest.raises(ProtocolError, match="protocol version=2 is not supported"):
        decode(data, None, 1 << 20)


def test_missing_or_wrong_token_is_refused() -> None:
    with pytest.raises(AuthError, match="no HMAC"):
        decode(encode(Ping(nonce=1), None), TOKEN, 1 << 20)
    with pytest.raises(AuthError, match="wrong HMAC"):
        decode(encode(Ping(nonce=1), b"another-token-of-16b"), TOKEN, 1 << 20)


def test_tampered_body_fails_authentication() -> None:
    data = encode(read_done("r1"), TOKEN)
    env = msgspec.msgpack.decode(data, type=Envelope)
    forged = msgspec.msgpack.encode(read_done("r2"))
    with pytest.raises(AuthError):
        decode(msgspec.msgpack.encode(Envelope(env.v, forged, env.mac)), TOKEN, 1 << 20)


def test_session_signed_messages_need_a_known_session_and_its_key() -> None:
    keys = {b"s" * 16: b"k" * 32}
    data = encode(read_done(), b"k" * 32, b"s" * 16)
    msg, sid = decode_signed(data, keys.get, 1 << 16)
    assert msg == read_done() and sid == b"s" * 16
    with pytest.raises(AuthError, match="unknown session"):
        decode_signed(encode(read_done(), b"k" * 32, b"t" * 16), keys.get, 1 << 16)
    with pytest.raises(AuthError, match="wrong HMAC for its session"):
        decode_signed(encode(read_done(), b"x" * 32, b"s" * 16), keys.get, 1 << 16)
    with pytest.raises(AuthError, match="not signed by a session"):
        decode_signed(encode(read_done(), TOKEN), keys.get, 1 << 16)
    with pytest.raises(AuthError, match="unknown session"):  # the token decoder has no sessions
        decode(data, TOKEN, 1 << 16)


def test_region_list_is_bounded() -> None:
    data = encode(welcome(MAX_REGIONS + 1), None)
    with pytest.raises(ProtocolError, match="malformed message"):
        decode(data, None, 1 << 30)


def test_invalid_geometry_in_a_hello_raises_the_geometry_error() -> None:
    bad = Hello(
        instance_id="d",
        rank=0,
        model=ModelWire(4, 8, 3, 16, "float16", "gqa", "bad"),
        layout=LayoutWire.of(LAYOUT),
        nonce=b"n" * 16,
    )
    got = decode(encode(bad, None), None, 1 << 20)
    assert isinstance(got, Hello)
    with pytest.raises(ConfigError, match="num_kv_heads=3"):
        got.model.to_spec()


def test_token_sources(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("KVBRIDGE_TRANSFER_TOKEN", raising=False)
    monkeypatch.delenv("KVBRIDGE_TRANSFER_TOKEN_FILE", raising=False)
    assert load_token() is None
    monkeypatch.setenv("KVBRIDGE_TRANSFER_TOKEN", "from-the-environment")
    assert load_token() == b"from-the-environment"
    path = tmp_path / "token"
    path.write_text("  from-a-file-0123456789\n")
    assert load_token(path=path) == b"from-a-file-0123456789"
    # the order, the same everywhere: flag, KVBRIDGE_TRANSFER_TOKEN, ..._TOKEN_FILE
    other = tmp_path / "env-token"
    other.write_text("from-the-env-file-0123456789")
    monkeypatch.setenv("KVBRIDGE_TRANSFER_TOKEN_FILE", str(other))
    assert load_token("from-a-flag") == b"from-a-flag"
    assert load_token(path=path) == b"from-a-file-0123456789"
    assert load_token() == b"from-the-environment"
    monkeypatch.delenv("KVBRIDGE_TRANSFER_TOKEN")
    assert load_token() == b"from-the-env-file-0123456789"
    path.write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        load_token(path=path)


def test_config_refuses_a_short_token_and_binds_loopback_by_default() -> None:
    with pytest.raises(ConfigError, match="too short"):
        TransferConfig(token=b"short")
    assert TransferConfig().host == "127.0.0.1"
