"""Fake-transport producers and consumers that the runtime tests share (real side
channels and sessions, a `FakeTransport` for NIXL)."""

from __future__ import annotations

import time
from typing import Any

from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.transfer.config import TransferConfig
from kvbridge.transfer.consumer import KVConsumer
from kvbridge.transfer.errors import HandshakeError
from kvbridge.transfer.integrity import Integrity
from kvbridge.transfer.messages import ReadDone, decode_signed
from kvbridge.transfer.producer import KVProducer

from .fakes import DECODE, MODEL, NUM_BLOCKS, PREFILL, Clock, FakeTransport, regions, session


def make_producer(clock: Clock, agent: str, instance_id: str, **kw: Any) -> KVProducer:
    """Prefill worker 0 of a tp-1 instance over a fake transport named `agent`."""
    if kw.get("config", {}).get("base_port"):  # a restart: the old socket may linger
        deadline = time.monotonic() + 10
        while True:
            try:
                return _producer(clock, agent, instance_id, **kw)
            except HandshakeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    return _producer(clock, agent, instance_id, **kw)


def _producer(
    clock: Clock, agent: str, instance_id: str, model: ModelKVSpec = MODEL, **kw: Any
) -> KVProducer:
    return KVProducer(
        model=model,
        layout=PREFILL,
        rank=0,
        regions=regions(PREFILL, 0, model),
        num_blocks=NUM_BLOCKS,
        transport=FakeTransport(agent),
        config=TransferConfig(
            lease_s=10, transfer_timeout_s=5, handshake_timeout_s=2, **kw.pop("config", {})
        ),
        instance_id=instance_id,
        clock=clock,
        **kw,
    )


def consumer(rank: int, clock: Clock, model: ModelKVSpec = MODEL, **config: Any) -> KVConsumer:
    return KVConsumer(
        model=model,
        layout=DECODE,
        rank=rank,
        regions=regions(DECODE, rank, model),
        num_blocks=NUM_BLOCKS,
        transport=FakeTransport(f"decode{rank}"),
        # (its cache regions are fake addresses: nothing may read them)
        config=TransferConfig(
            **{
                "transfer_timeout_s": 5,
                "handshake_timeout_s": 2,
                "integrity": Integrity.OFF,
                **config,
            }
        ),
        instance_id="D",
        clock=clock,
    )


def opened(c: KVConsumer, p: KVProducer, data: bytes) -> ReadDone:
    """A notification `c` sent `p`, checked with their session's key."""
    w = session(c, p)
    msg, sid = decode_signed(data, {w.session_id: w.session_key}.get, 1 << 16)
    assert isinstance(msg, ReadDone) and sid == w.session_id
    return msg
