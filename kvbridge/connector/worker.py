"""The worker side of the KV connector: one per worker process that owns a KV cache.

Shaped like vLLM's `KVConnectorBase_V1` worker role. The process that owns the cache
memory builds it, registers its cache once (`register_kv_caches`) and, for every batch
of orders from the scheduler side, runs `execute(metadata)`:

    bind_connector_metadata -> start_load_kv (pulls, declines, introductions)
      -> wait_for_save (exposes, cancels) -> wait_for_recv (only if the orders ask)
      -> get_finished -> clear_connector_metadata

A request of several cache groups comes as one Expose or Pull per group (under the
groups' `transfer_id`s, each with the host's request id in the orders); the worker
reports it once, when its last group's transfer ended here (`merge_events`).

Between orders the process does nothing for it: the transfer layer's
`kvbridge.transfer.connector.WorkerConnector`, which this wraps and which does the work,
progresses transfers in its own thread (a NIXL read from this worker's memory progresses
only while its agent is polled), also while the worker computes a step.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from kvbridge.connector.metadata import ConnectorMetadata, KVWorkerOutput
from kvbridge.connector.scheduler import release_cause
from kvbridge.errors import ConfigError
from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.plan.layout import InstanceLayout, num_regions
from kvbridge.transfer.config import KVExport, TransferConfig
from kvbridge.transfer.connector import (
    ConnectorEvent,
    ConnectorReply,
    ConnectorRequest,
    ConnectorRole,
    ConnectorSpec,
    GetEndpoint,
    Poll,
    SetEndpoints,
    SetSiblings,
    WorkerConnector,
)

log = logging.getLogger("kvbridge.connector")

if TYPE_CHECKING:
    from collections.abc import Iterable

    from kvbridge.transfer.agent import Transport
    from kvbridge.transfer.export import SharedSegment
    from kvbridge.transfer.regions import CacheRegions


def adopt_segment(regions: CacheRegions, transfer: TransferConfig) -> SharedSegment | None:
    """A host's cache moved into shared memory in place, for a producer whose peers read
    from an export process; None where they read from its own agent: inline, auto
    without a token, or a cache this cannot move, a GPU cache among them (auto: logged;
    process: ConfigError naming why)."""
    from kvbridge.transfer.errors import TransferError
    from kvbridge.transfer.export import SharedSegment

    if not transfer.wants_export_process:
        return None
    from kvbridge.transfer.regions import MemType

    spans = sorted(zip(regions.addresses, regions.lengths, strict=True))
    gaps = [a for (a, n), (b, _) in itertools.pairwise(spans) if a + n != b]
    try:
        if regions.mem_type is not MemType.DRAM:  # an export process maps host memory
            raise TransferError(
                f"it lies in device memory ({regions.mem_type.value}, device "
                f"{regions.device_id}), which cannot be moved into shared memory"
            )
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
                f"kv_export='process' cannot export this KV cache: {exc}; use 'inline' or 'auto'"
            ) from None
        log.warning(
            "kvbridge: peers read this prefill worker's KV from its own NIXL agent "
            "(kv_export auto could not move the KV cache into shared memory: %s)",
            exc,
        )
        return None


@dataclass
class _Parts:
    """A request's transfers on one worker (one per cache group) until all ended."""

    remaining: int
    events: list[ConnectorEvent] = field(default_factory=list)


def merge_events(
    request_id: str, events: list[ConnectorEvent], role: ConnectorRole
) -> ConnectorEvent:
    """One event for a request whose cache groups' transfers all ended (`events`, one
    per group): ok if each was, their reasons, bytes, cold paths and descriptors summed,
    the longest time (with its phases), a handshake if any waited for one, the cause a
    counter tells apart (a producer's: `release_cause`; a consumer's: the first failed
    group's)."""
    if len(events) == 1:
        return msgspec.structs.replace(events[0], request_id=request_id)
    failed = [ev for ev in events if not ev.ok]
    if role is ConnectorRole.PRODUCER:
        cause = release_cause(ev.cause for ev in events)
    else:
        cause = next((ev.cause for ev in failed if ev.cause), "")
    longest = max(events, key=lambda ev: ev.elapsed_ms)
    return ConnectorEvent(
        request_id,
        not failed,
        "; ".join(dict.fromkeys(ev.reason for ev in failed if ev.reason)),
        sum(ev.nbytes for ev in events),
        longest.elapsed_ms,
        cause,
        sum(ev.local_nbytes for ev in events),
        any(ev.handshake for ev in events),
        sum(ev.cold_peers for ev in events),
        sum(ev.num_descriptors for ev in events),
        longest.phases_ms,
    )


class KVConnectorWorker:
    """One worker's connector. Built, called and shut down by the process that owns the
    cache memory, from one thread; never raises out of `execute` (a failed order comes
    back as `KVWorkerOutput.error`, and the worker stays usable)."""

    def __init__(
        self, spec: ConnectorSpec, model: ModelKVSpec, layout: InstanceLayout, rank: int
    ) -> None:
        self.spec = spec
        self.model = model
        self.layout = layout
        self.rank = rank
        self.connector: WorkerConnector | None = None
        self._meta: ConnectorMetadata | None = None
        #: pulls (consumer) and exposures (producer) in flight, by transfer id (a pull's:
        #: the prefill instance's): the host's request id
        self._loads: dict[str, str] = {}
        self._exposed: dict[str, str] = {}
        #: the host's requests with transfers not all ended here (one per cache group)
        self._parts: dict[str, _Parts] = {}
        #: consumer: each host request's local blocks in flight (invalid if a group fails)
        self._pulled_blocks: dict[str, list[int]] = {}
        self._load_errors: set[int] = set()
        self._connected: list[str] = []  # introduced producers met, since the last report
        #: events for the next report: orders that raised (as failed transfers) and the
        #: ends `wait_for_recv` collected
        self._unreported: list[ConnectorEvent] = []
        self._errors: list[str] = []  # other orders that raised

    @property
    def role(self) -> ConnectorRole:
        return self.spec.role

    # -- start-up -------------------------------------------------------------------------
    def register_kv_caches(
        self,
        kv_cache: Any,
        num_blocks: int,
        transport: Transport | None = None,
        segment: SharedSegment | None = None,
    ) -> None:
        """Register this worker's cache (one tensor in the layout's axis order, cut into
        the planner's regions) with the transfer runtime; once, before any order. With
        `segment` (the shared memory the tensor lies in), a producer may export it from a
        process of its own (`TransferConfig.kv_export`)."""
        from kvbridge.transfer.regions import CacheRegions

        regions = num_regions(self.model, self.layout, self.layout.workers(self.model)[self.rank])
        self.register_regions(
            CacheRegions.from_tensor(kv_cache, regions), num_blocks, transport, segment
        )

    def register_regions(
        self,
        regions: CacheRegions,
        num_blocks: int,
        transport: Transport | None = None,
        segment: SharedSegment | None = None,
        adopt: bool = False,
    ) -> None:
        """`register_kv_caches` for a cache the host already cut into the planner's
        regions (a host whose cache is one buffer per layer, as vLLM's). `adopt`: the
        host allocated the cache itself, so a producer whose peers read from an export
        process (`TransferConfig.kv_export`) first moves it into shared memory in place
        (`adopt_segment`)."""
        if adopt and self.role is ConnectorRole.PRODUCER:
            segment = adopt_segment(regions, self.spec.transfer)
        self.connector = WorkerConnector(
            self.spec,
            self.model,
            self.layout,
            self.rank,
            regions,
            num_blocks,
            transport=transport,
            segment=segment,
        )

    def get_handshake_metadata(self) -> str:
        """What the scheduler side hands the instance's workers at start-up
        (`KVConnectorScheduler.set_worker_endpoints`): a producer's side-channel
        endpoint; a consumer's `sibling` (base64), for the fan-out."""
        reply = self._handle(GetEndpoint())
        return reply.endpoint if self.role is ConnectorRole.PRODUCER else reply.sibling

    # -- per step ---------------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        self._meta = metadata

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self) -> None:
        """Start the bound pulls; meet introduced producers; decline what will not be read."""
        meta = self._bound()
        if meta.siblings is not None:
            self._try(SetSiblings(meta.siblings))
        for connect in meta.peers_to_connect:
            try:
                if self._handle(connect).connected:
                    self._connected.append(connect.endpoint)
            except Exception as exc:
                self._errors.append(f"Connect failed on worker {self.rank}: {exc}")
        for decline in meta.reqs_to_decline:
            self._try(decline)
        pulls = meta.pulls()
        self._expect(host_id for host_id, _ in pulls)
        for host_id, pull in pulls:
            self._pulled_blocks.setdefault(host_id, []).extend(pull.local_block_ids)
            if self._try(pull, request_id=host_id):
                self._loads[pull.request_id] = host_id

    def wait_for_save(self) -> None:
        """Expose the bound requests' computed blocks (our KV is complete once the step
        that finished the prompt returned); release cancelled ones."""
        meta = self._bound()
        if meta.worker_endpoints is not None:
            self._try(SetEndpoints(meta.worker_endpoints))
        sends = meta.sends()
        self._expect(host_id for host_id, _ in sends)
        for host_id, expose in sends:
            if self._try(expose, request_id=host_id):
                self._exposed[expose.request_id] = host_id
        for cancel in meta.reqs_to_cancel:
            self._try(cancel)

    def wait_for_recv(self) -> None:
        """Wait up to the bound orders' `recv_wait_s` for their pulls to end here (DONE
        or FAILED), keeping the ends for `get_finished` (`wait_for_pulls`)."""
        meta = self._bound()
        if meta.recv_wait_s > 0:
            ids = {host_id for host_id, _ in meta.pulls()}
            self.wait_for_pulls(ids, meta.recv_wait_s)

    def wait_for_pulls(self, host_ids: Collection[str], timeout_s: float) -> set[str]:
        """Wait up to `timeout_s` for this worker's pulls of `host_ids` (the host's
        request ids) to end (DONE or FAILED), keeping the ends for `get_finished`; the
        ids still in flight (a pull not started here counts as ended). Only a
        connector whose progress thread moves the pulls meanwhile waits; the wait ends
        at the last pull's end."""
        conn = self.connector
        pending = {tid for tid, hid in self._loads.items() if hid in host_ids}
        deadline = time.monotonic() + timeout_s
        while pending and conn is not None and conn.progress is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not conn.wait_for_events(left):
                break
            events = self._handle(Poll()).events
            pending -= {ev.request_id for ev in events}
            self._unreported += self._own(events)
        return {self._loads[tid] for tid in pending if tid in self._loads}

    def get_finished(self) -> KVWorkerOutput:
        """Report what finished since the last report (the progress thread moved it;
        a connector without the thread progresses its transfers now). With the bound
        orders' `idle_wait_s`, a worker with transfers in flight and nothing to report
        first waits up to that long for one to end (on the runtime's event)."""
        reply = self._handle(Poll())
        events = [*self._unreported, *self._own(reply.events)]
        wait_s = self._meta.idle_wait_s if self._meta is not None else 0.0
        in_flight = self._loads or self._exposed
        if not events and wait_s > 0 and in_flight and self._need().wait_for_events(wait_s):
            reply = self._handle(Poll())  # its figures too: they count the ends it reports
            events = self._own(reply.events)
        self._unreported = []
        sending, recving = (events, []) if self.role is ConnectorRole.PRODUCER else ([], events)
        error, self._errors = "; ".join(self._errors), []
        connected, self._connected = self._connected, []
        return KVWorkerOutput(
            sending,
            recving,
            reply.pinned_blocks,
            reply.replays_refused,
            error=error,
            connected=connected,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local blocks of pulls that failed since the last call (their K/V is invalid)."""
        out, self._load_errors = self._load_errors, set()
        return out

    def execute(self, metadata: ConnectorMetadata) -> KVWorkerOutput:
        """Carry out one step's orders and report; what an executor runs on each worker."""
        self.bind_connector_metadata(metadata)
        try:
            self.start_load_kv()
            self.wait_for_save()
            self.wait_for_recv()
            return self.get_finished()
        except Exception as exc:  # reported to the driver; the worker stays usable
            return KVWorkerOutput(error=f"{type(exc).__name__}: {exc}")
        finally:
            self.clear_connector_metadata()

    def shutdown(self) -> None:
        """Fail or release what is in flight, close the side channel, drop the agent."""
        if self.connector is not None:
            self.connector.close()
            self.connector = None

    # -- helpers ------------------------------------------------------------------------------
    def _own(self, events: list[ConnectorEvent]) -> list[ConnectorEvent]:
        """The events of this worker's own transfers, one per host request once its
        groups all ended, named with the host's request ids (a transfer's events come
        under its transfer id); a failed pull's blocks are kept for
        `get_block_ids_with_load_errors`."""
        out = []
        for ev in events:
            in_flight = self._exposed if self.role is ConnectorRole.PRODUCER else self._loads
            host_id = in_flight.pop(ev.request_id, None)
            if host_id is not None and (done := self._ended(host_id, ev)) is not None:
                out.append(done)
        return out

    def _expect(self, host_ids: Iterable[str]) -> None:
        """Count the transfers each host request starts here (one per cache group)."""
        for host_id in host_ids:
            self._parts.setdefault(host_id, _Parts(0)).remaining += 1

    def _ended(self, host_id: str, ev: ConnectorEvent) -> ConnectorEvent | None:
        """One of `host_id`'s transfers ended; its event once they all have."""
        parts = self._parts.get(host_id)
        if parts is None:  # not counted (a stray event): report it as it is
            return msgspec.structs.replace(ev, request_id=host_id)
        parts.events.append(ev)
        parts.remaining -= 1
        if parts.remaining:
            return None
        del self._parts[host_id]
        done = merge_events(host_id, parts.events, self.role)
        blocks = self._pulled_blocks.pop(host_id, [])
        if not done.ok and self.role is ConnectorRole.CONSUMER:
            self._load_errors.update(blocks)
        return done

    def _bound(self) -> ConnectorMetadata:
        assert self._meta is not None, "bind_connector_metadata first"
        return self._meta

    def _need(self) -> WorkerConnector:
        if self.connector is None:
            raise RuntimeError("register_kv_caches has not been called")
        return self.connector

    def _try(self, order: ConnectorRequest, request_id: str | None = None) -> bool:
        """Carry out one order; one that raised is reported (a request's as its failed
        transfer on this worker, any other in `KVWorkerOutput.error`)."""
        try:
            self._handle(order)
        except Exception as exc:
            reason = f"{type(order).__name__} failed on worker {self.rank}: {exc}"
            if request_id is None:
                self._errors.append(reason)
            elif done := self._ended(request_id, ConnectorEvent(request_id, False, reason)):
                self._unreported.append(done)
            return False
        return True

    def _handle(self, request: ConnectorRequest) -> ConnectorReply:
        return self._need().handle(request)
