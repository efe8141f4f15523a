"""The engine's KV connector: the transfer runtime attached to every tp worker.

A prefill instance's workers each own a `KVProducer`, a decode instance's a
`KVConsumer`, over the worker's one KV-cache tensor (registered with NIXL once). The
driver reaches them through `Executor.connector_call(method, payload)`, which runs
`WorkerKVConnector.handle` on every worker; between calls the worker's loop calls
`idle_poll()` every millisecond while a transfer is pending (less often otherwise),
since without NIXL's progress thread the process that owns the memory must poll for
remote reads to progress.

All messages are msgspec structs; this module imports the transfer layer's public API
only (kvbridge.transfer), lazily, so an engine without a connector never loads NIXL.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec
import torch

from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.plan.layout import InstanceLayout, num_regions
from kvbridge.transfer.config import TransferConfig

#: How often an idle producer worker polls its side channel and leases (seconds).
IDLE_POLL_S = 0.05
#: How often a worker polls while one of its transfers is pending (seconds).
BUSY_POLL_S = 0.001
#: How often an idle consumer worker polls (nothing is pending; a pull wakes it).
CONSUMER_IDLE_S = 0.5


class ConnectorRole(enum.Enum):
    PRODUCER = "producer"  # prefill instance: exposes blocks
    CONSUMER = "consumer"  # decode instance: pulls blocks


class ConnectorSpec(msgspec.Struct, frozen=True):
    """How every worker of one instance sets up its side of the transfer runtime."""

    role: str  # ConnectorRole value
    instance_id: str
    transfer: TransferConfig = TransferConfig()


class ExposeArgs(msgspec.Struct, frozen=True):
    request_id: str
    block_ids: list[int]
    num_tokens: int


class PullArgs(msgspec.Struct, frozen=True):
    request_id: str
    endpoint: str
    producer_block_ids: list[int]
    local_block_ids: list[int]
    num_tokens: int


class ConnectorEvent(msgspec.Struct, frozen=True):
    """A request's transfer finished on one worker: released (producer) or DONE /
    FAILED (consumer), with the reason and the bytes it read."""

    request_id: str
    ok: bool
    reason: str = ""
    nbytes: int = 0


class PollReply(msgspec.Struct, frozen=True):
    events: list[ConnectorEvent]
    pinned_blocks: int = 0


_expose = msgspec.msgpack.Decoder(ExposeArgs)
_pull = msgspec.msgpack.Decoder(PullArgs)
_endpoints = msgspec.msgpack.Decoder(list[str])
poll_decoder = msgspec.msgpack.Decoder(PollReply)


class WorkerKVConnector:
    """One worker's producer or consumer. Owned and called by that worker's process
    only (the engine worker loop); `handle` serves the driver's connector calls."""

    def __init__(
        self,
        spec: ConnectorSpec,
        model: ModelKVSpec,
        layout: InstanceLayout,
        rank: int,
        kv_cache: torch.Tensor,
        num_blocks: int,
    ) -> None:
        from kvbridge.transfer import CacheRegions, KVConsumer, KVProducer, NixlTransport

        self.role = ConnectorRole(spec.role)
        # the cache tensor in the layout's order, cut into the planner's regions
        shard = layout.workers(model)[rank]
        regions = CacheRegions.from_tensor(kv_cache, num_regions(model, layout, shard))
        self.transport = NixlTransport(f"{spec.instance_id}-{spec.role}-{rank}", regions)
        common: dict[str, Any] = dict(
            model=model,
            layout=layout,
            rank=rank,
            regions=regions,
            num_blocks=num_blocks,
            transport=self.transport,
            config=spec.transfer,
            instance_id=spec.instance_id,
        )
        self.producer = KVProducer(**common) if self.role is ConnectorRole.PRODUCER else None
        self.consumer = KVConsumer(**common) if self.role is ConnectorRole.CONSUMER else None
        self._events: list[ConnectorEvent] = []
        self._last_poll = 0.0
        self._bytes: dict[str, int] = {}

    def handle(self, method: str, payload: bytes) -> bytes:
        """Serve one driver call; raises on a bad call (the executor reports it)."""
        if method == "endpoint":
            return msgspec.msgpack.encode(self.producer.endpoint if self.producer else "")
        if method == "set_endpoints":
            assert self.producer is not None
            self.producer.set_worker_endpoints(_endpoints.decode(payload))
            return b""
        if method == "expose":
            assert self.producer is not None
            args = _expose.decode(payload)
            self.producer.expose(args.request_id, args.block_ids, args.num_tokens)
            return b""
        if method == "pull":
            assert self.consumer is not None
            p = _pull.decode(payload)
            self.consumer.pull(
                p.request_id, p.endpoint, p.producer_block_ids, p.local_block_ids, p.num_tokens
            )
            return b""
        if method == "poll":
            self._last_poll = 0.0  # the driver asks: poll now
            self.idle_poll()
            events, self._events = self._events, []
            pinned = (
                self.producer.num_pinned_blocks
                if self.producer
                else (self.consumer.num_held_blocks if self.consumer else 0)
            )
            return msgspec.msgpack.encode(PollReply(events, pinned))
        raise ValueError(f"unknown connector method {method!r}")

    def idle_poll(self) -> float:
        """Progress transfers and collect finished requests. Returns how long the worker
        may wait before the next call (see `_poll_interval`), so that a dozen idle
        workers do not eat the cores."""
        now = time.monotonic()
        interval = self._poll_interval()
        if now - self._last_poll < interval:
            return interval - (now - self._last_poll)
        self._last_poll = now
        if self.producer is not None:
            for rel in self.producer.poll(0):
                ok = rel.cause.value == "completed"
                self._events.append(ConnectorEvent(rel.request_id, ok, rel.reason))
        if self.consumer is not None:
            for res in self.consumer.poll():
                ok = res.state.value == "done"
                self._events.append(ConnectorEvent(res.request_id, ok, res.reason, res.nbytes))
        return self._poll_interval()

    def _poll_interval(self) -> float:
        """BUSY_POLL_S while a transfer is pending (a read from this worker's memory
        progresses only while it polls); IDLE_POLL_S for an idle producer (it answers
        handshakes and runs leases); CONSUMER_IDLE_S for an idle consumer, which has
        nothing to progress until the next pull (a call, which wakes the worker)."""
        if self.producer is not None:
            return BUSY_POLL_S if self.producer.num_pinned_blocks > 0 else IDLE_POLL_S
        if self.consumer is not None and self.consumer.num_held_blocks > 0:
            return BUSY_POLL_S
        return CONSUMER_IDLE_S

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
        if self.consumer is not None:
            self.consumer.close()
        self.transport.close()
