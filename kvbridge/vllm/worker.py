"""The connector's worker side: one per vLLM worker (TP rank), in the worker process.

It registers the worker's KV caches once (`cache.describe_kv_caches` names their
layout), then runs kvbridge's transfer runtime over them: a `WorkerConnector` per role
(producer and/or consumer, each with its own NIXL agent), driven with the orders the
scheduler side sends each step. vLLM's worker thread calls `start_load_kv` and
`get_finished` once per engine step, and a step on CPU may be long: each
`WorkerConnector` progresses its transfers in its own thread meanwhile (the transfer
layer's `ProgressThread`, as in kvbridge's own engine), so reads of a producer's memory
and its notifications do not wait for the next step.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbridge.errors import ConfigError
from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.transfer.config import KVExport, TransferConfig
from kvbridge.transfer.connector import (
    ConnectorRole,
    ConnectorSpec,
    GetEndpoint,
    Poll,
    SetEndpoints,
    SetSiblings,
    WorkerConnector,
)
from kvbridge.vllm.cache import RegisteredCache
from kvbridge.vllm.scheduler import StepOrders
from kvbridge.vllm.settings import ROLES, ConnectorSettings

if TYPE_CHECKING:
    from kvbridge.transfer.export import SharedSegment

#: under vLLM's "vllm" logger, so vLLM's handlers print it
log = logging.getLogger("vllm.kvbridge")
#: what a decode worker records per pull for vLLM's metrics (`stats.py`): seconds and
#: bytes of each pull that completed, a 1 per pull that failed
OBSERVATION_KEYS = ("pull_seconds", "pull_bytes", "failed_pulls")


def export_segment(cache: RegisteredCache, transfer: TransferConfig) -> SharedSegment | None:
    """vLLM's KV buffer moved into shared memory in place, for a prefill worker whose
    peers read from an export process (`TransferConfig.kv_export`); None where they read
    from its own agent: inline, auto without a token, or a cache this cannot move (auto:
    logged; process: ConfigError naming why)."""
    from kvbridge.transfer.errors import TransferError
    from kvbridge.transfer.export import SharedSegment

    if not transfer.wants_export_process:
        return None
    spans = sorted(zip(cache.regions.addresses, cache.regions.lengths, strict=True))
    gaps = [a for (a, n), (b, _) in itertools.pairwise(spans) if a + n != b]
    try:
        if gaps:
            raise TransferError(
                f"its {len(spans)} layer regions are not one contiguous buffer (a gap after "
                f"{gaps[0]:#x})"
            )
        lo, (last, n) = spans[0][0], spans[-1]
        return SharedSegment.adopt(lo, last + n - lo)
    except TransferError as exc:
        if transfer.kv_export is KVExport.PROCESS:
            raise ConfigError(
                f"kv_connector_extra_config.kv_export='process' cannot export vLLM's KV "
                f"cache: {exc}; use 'inline' or 'auto'"
            ) from None
        log.warning(
            "kvbridge: peers read this prefill worker's KV from its own NIXL agent "
            "(kv_export auto could not move vLLM's KV cache into shared memory: %s)",
            exc,
        )
        return None


@dataclass
class _PullState:
    request_id: str  # vLLM's id
    local_block_ids: list[int]
    num_tokens: int
    start_token: int
    started: float = field(default_factory=time.perf_counter)


@dataclass
class StepResults:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_block_ids: set[int] = field(default_factory=set)


class WorkerSide:
    """One TP rank's transfer runtime; built by `register_kv_caches`, closed by
    `close` (the connector's `shutdown`). Methods are called from vLLM's worker thread;
    each `WorkerConnector` serialises them with its own progress thread."""

    def __init__(
        self,
        settings: ConnectorSettings,
        instance_id: str,
        kv_role: str,
        model: ModelKVSpec,
        cache: RegisteredCache,
        rank: int,
    ) -> None:
        self.rank = rank
        self.cache = cache
        is_producer, is_consumer = ROLES[kv_role]
        transfer = settings.transfer
        self.producer: WorkerConnector | None = None
        self.consumer: WorkerConnector | None = None
        self.segment = export_segment(cache, transfer) if is_producer else None
        try:
            for role, wanted in (
                (ConnectorRole.PRODUCER, is_producer),
                (ConnectorRole.CONSUMER, is_consumer),
            ):
                if not wanted:
                    continue
                identity = settings.identity
                secret = (
                    identity.secret.decode() if identity and role is ConnectorRole.CONSUMER else ""
                )
                wc = WorkerConnector(
                    ConnectorSpec(role, instance_id, transfer, identity=secret),
                    model,
                    cache.layout,
                    rank,
                    cache.regions,
                    cache.num_blocks,
                    segment=self.segment if role is ConnectorRole.PRODUCER else None,
                )
                if role is ConnectorRole.PRODUCER:
                    self.producer = wc
                else:
                    self.consumer = wc
        except BaseException:
            self._close_runtime()
            raise
        self.endpoint = self.producer.handle(GetEndpoint()).endpoint if self.producer else ""
        #: what the other decode workers of this instance need (the fan-out), base64
        self.sibling = self.consumer.handle(GetEndpoint()).sibling if self.consumer else ""
        self._endpoints_set = False
        self._pulls: dict[str, _PullState] = {}  # by the producer's request id
        self._sending: set[str] = set()  # exposed request ids (vLLM's own on a prefill)
        self._pending = StepResults()
        self.num_bytes_pulled = 0
        self._observed: dict[str, list[float]] = {key: [] for key in OBSERVATION_KEYS}

    # -- vLLM's worker thread ------------------------------------------------------------
    def apply(self, orders: StepOrders) -> None:
        """Carry out one step's orders (start_load_kv)."""
        if self.producer is not None and not self._endpoints_set and orders.endpoints:
            self.producer.handle(SetEndpoints(orders.endpoints))
            self._endpoints_set = True
        if self.consumer is not None and orders.siblings:
            try:
                self.consumer.handle(SetSiblings(orders.siblings))
            except Exception as exc:  # the same list fails on every worker, as a rule
                log.warning(
                    "decode worker %d: meeting the instance's other workers failed (%s); "
                    "it reads its own bytes, and pulls its siblings fan out fail and are "
                    "recomputed",
                    self.rank,
                    exc,
                )
        for expose in orders.exposes:
            assert self.producer is not None
            self.producer.handle(expose)
            self._sending.add(expose.request_id)
        for order in orders.pulls:
            assert self.consumer is not None
            p = order.pull
            self._pulls[p.request_id] = _PullState(
                order.request_id, list(p.local_block_ids), p.num_tokens, p.start_token
            )
            try:
                self.consumer.handle(p)
            except Exception as exc:  # refused at once: report it as a failed load
                log.warning("decode worker %d: pull of %s refused: %s", self.rank, p, exc)
                state = self._pulls.pop(p.request_id)
                self._pending.finished_recving.add(state.request_id)
                self._pending.failed_block_ids.update(state.local_block_ids)
                self._observed["failed_pulls"].append(1.0)
        for decline in orders.declines:
            if self.consumer is not None:
                self.consumer.handle(decline)

    def collect(self, wait_s: float = 0.0) -> StepResults:
        """Requests whose transfers finished since the last call (get_finished). With
        `wait_s` (an empty step) and transfers in flight but none finished, first wait
        up to that long for one to finish, on the runtime's event: no spinning."""
        self._drain()
        if wait_s > 0 and self._is_empty(self._pending) and (self._pulls or self._sending):
            side = self.consumer if self._pulls else self.producer
            if side is not None and side.wait_for_events(wait_s):
                self._drain()
        out, self._pending = self._pending, StepResults()
        return out

    def take_observations(self) -> dict[str, list[float]] | None:
        """The pulls finished since the last call, for vLLM's metrics (None if none)."""
        if not any(self._observed.values()):
            return None
        out, self._observed = self._observed, {key: [] for key in OBSERVATION_KEYS}
        return out

    def close(self) -> None:
        self._close_runtime()

    # -- internals -----------------------------------------------------------------------
    @staticmethod
    def _is_empty(res: StepResults) -> bool:
        return not (res.finished_sending or res.finished_recving or res.failed_block_ids)

    def _drain(self) -> None:
        if self.producer is not None:
            for ev in self.producer.handle(Poll()).events:
                if ev.request_id in self._sending:
                    self._sending.discard(ev.request_id)
                    self._pending.finished_sending.add(ev.request_id)
        if self.consumer is not None:
            for ev in self.consumer.handle(Poll()).events:
                state = self._pulls.pop(ev.request_id, None)
                if state is None:
                    continue
                self._pending.finished_recving.add(state.request_id)
                ms = (time.perf_counter() - state.started) * 1e3
                if ev.ok:
                    self.num_bytes_pulled += ev.nbytes
                    self._observed["pull_seconds"].append(ev.elapsed_ms / 1e3)
                    self._observed["pull_bytes"].append(float(ev.nbytes))
                    log.info(
                        "kvbridge decode worker %d pulled %s: tokens [%d, %d), %d bytes "
                        "(+%d copied from a sibling) in %.1f ms",
                        self.rank,
                        state.request_id,
                        state.start_token,
                        state.num_tokens,
                        ev.nbytes,
                        ev.local_nbytes,
                        ms,
                    )
                else:
                    self._pending.failed_block_ids.update(state.local_block_ids)
                    self._observed["failed_pulls"].append(1.0)
                    log.warning(
                        "kvbridge decode worker %d failed to pull %s: %s",
                        self.rank,
                        state.request_id,
                        ev.reason,
                    )

    def _close_runtime(self) -> None:
        for wc in (self.producer, self.consumer):
            if wc is not None:
                try:
                    wc.close()
                except Exception as exc:
                    log.warning("kvbridge worker %d: close: %s", self.rank, exc)
        self.producer = self.consumer = None
