"""An instance that plays several hand-over roles at once (vLLM's `kv_role` kv_both: a
producer and a consumer): one scheduler side and one worker side per role, driven as
one. Orders and reports go by role (`Orders`, `Reports`); a host that carries the
reports between processes as bytes encodes them with `encode_reports`.

    RoleSchedulers   the driver's: a `KVConnectorScheduler` per role; logs the
                     hand-overs that did not end as planned and the workers' errors
    RoleWorkers      one worker's: a `KVConnectorWorker` per role (each its own NIXL
                     agent and progress thread) over one registered cache; a step's
                     finished sets under the host's ids, the blocks of failed pulls, a
                     log line and figures (`stats.py`) per pull

Both log to the logger their host gives (vLLM's handlers print only its own loggers).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbridge.connector.metadata import ConnectorMetadata, KVWorkerOutput, encode, output_decoder
from kvbridge.connector.scheduler import KVConnectorConfig, KVConnectorScheduler, KVRequest
from kvbridge.connector.states import RequestState
from kvbridge.connector.stats import Figures, has_figures, no_pulls, record_pull
from kvbridge.connector.worker import KVConnectorWorker
from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.plan.layout import InstanceLayout
from kvbridge.transfer.connector import ConnectorEvent, ConnectorRole

if TYPE_CHECKING:
    from kvbridge.transfer.regions import CacheRegions

Orders = dict[ConnectorRole, ConnectorMetadata]
Reports = dict[ConnectorRole, list[KVWorkerOutput]]
_log = logging.getLogger("kvbridge.connector")


def encode_reports(
    reports: dict[ConnectorRole, KVWorkerOutput],
) -> list[tuple[ConnectorRole, bytes]]:
    """One worker's reports of a step, each role's as msgpack bytes."""
    return [(role, encode(out)) for role, out in reports.items()]


def decode_reports(encoded: Iterable[tuple[ConnectorRole, bytes]]) -> Reports:
    """Every worker's `encode_reports`, gathered: each role's reports."""
    reports: Reports = {}
    for role, raw in encoded:
        reports.setdefault(role, []).append(output_decoder.decode(raw))
    return reports


class RoleSchedulers:
    """The driver's scheduler sides, one per role; called from the host's scheduler
    thread only."""

    def __init__(
        self,
        configs: Iterable[KVConnectorConfig],
        block_size: int,
        world_size: int,
        log: logging.Logger = _log,
        state_groups: frozenset[int] = frozenset(),
    ) -> None:
        """`state_groups`: the cache groups holding a per-request state
        (`KVConnectorScheduler`)."""
        self.sides = {
            c.role: KVConnectorScheduler(c, block_size, world_size, state_groups) for c in configs
        }
        self.block_size = block_size
        self.log = log

    @property
    def producer(self) -> KVConnectorScheduler | None:
        return self.sides.get(ConnectorRole.PRODUCER)

    @property
    def consumer(self) -> KVConnectorScheduler | None:
        return self.sides.get(ConnectorRole.CONSUMER)

    def set_worker_endpoints(self, endpoints: list[str], siblings: list[str]) -> None:
        """Every worker's producer endpoint and consumer sibling entry, rank order
        (`RoleWorkers.get_handshake_metadata`; a list with a worker missing its entry
        is not handed out)."""
        if self.producer is not None and all(endpoints):
            self.producer.set_worker_endpoints(endpoints)
        if self.consumer is not None and all(siblings):
            self.consumer.set_worker_endpoints(siblings)

    def build_connector_meta(self, idle_wait_s: float = 0.0) -> Orders:
        """This step's orders per role (`KVConnectorScheduler.build_connector_meta`)."""
        return {
            role: side.build_connector_meta(idle_wait_s=idle_wait_s)
            for role, side in self.sides.items()
        }

    def update_connector_output(self, reports: Reports) -> list[KVRequest]:
        """Fold the workers' reports of one step (one per worker and role); the
        hand-overs that ended."""
        ended = []
        for role, outputs in reports.items():
            side = self.sides.get(role)
            if side is None or not outputs:
                continue
            for rec in side.update_connector_output(outputs):
                ended.append(rec)
                if rec.state is not RequestState.RUNNING and rec.state is not RequestState.RELEASED:
                    self.log.info("request %s: %s (%s)", rec.request_id, rec.state.name, rec.reason)
            for error in side.errors:
                self.log.warning("kvbridge %s worker: %s", role.value, error)
        return ended


@dataclass
class StepResults:
    """One step's report of a worker: its finished sets (the host's ids), and every
    role's `KVWorkerOutput`."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    reports: dict[ConnectorRole, KVWorkerOutput] = field(default_factory=dict)


class RoleWorkers:
    """One worker's sides, one per role, over the cache the host registered
    (`register_regions`); closed by `shutdown`. Called from the host's worker thread
    only; a step is `start_load_kv`, `wait_for_save`, `get_finished`."""

    def __init__(
        self,
        configs: Iterable[KVConnectorConfig],
        model: ModelKVSpec,
        layout: InstanceLayout,
        rank: int,
        log: logging.Logger = _log,
    ) -> None:
        self.rank = rank
        self.log = log
        self.sides = {c.role: KVConnectorWorker(c.spec, model, layout, rank) for c in configs}
        #: in flight, by the host's id (for the log line): tokens [start, end) its pulls
        #: cover, the number of cache groups
        self._pulls: dict[str, tuple[int, int, int]] = {}
        self._figures = no_pulls()

    def register_regions(self, regions: CacheRegions, num_blocks: int, adopt: bool = False) -> None:
        """`KVConnectorWorker.register_regions` for every role (all closed if one fails)."""
        try:
            for worker in self.sides.values():
                worker.register_regions(regions, num_blocks, adopt=adopt)
        except BaseException:
            self.shutdown()
            raise

    def get_handshake_metadata(self) -> tuple[str, str]:
        """(the producer's side channel, the consumer's sibling entry); "" for a role
        not played."""

        def entry(role: ConnectorRole) -> str:
            return self.sides[role].get_handshake_metadata() if role in self.sides else ""

        return entry(ConnectorRole.PRODUCER), entry(ConnectorRole.CONSUMER)

    def start_load_kv(self, orders: Orders) -> None:
        """Bind one step's orders and start them: pulls, declines, introductions, the
        instance's endpoints and siblings."""
        for role, worker in self.sides.items():
            meta = orders.get(role, ConnectorMetadata())
            worker.bind_connector_metadata(meta)
            worker.start_load_kv()
            for host_id, pull in meta.pulls():
                start, end, groups = self._pulls.get(host_id, (pull.start_token, 0, 0))
                span = (min(start, pull.start_token), max(end, pull.num_tokens), groups + 1)
                self._pulls[host_id] = span

    def wait_for_pulls(self, host_ids: Collection[str], timeout_s: float) -> set[str]:
        """Wait up to `timeout_s` for the pulls of `host_ids` started on this worker to
        end (`KVConnectorWorker.wait_for_pulls`); the ids still in flight."""
        worker = self.sides.get(ConnectorRole.CONSUMER)
        return worker.wait_for_pulls(host_ids, timeout_s) if worker is not None else set()

    def wait_for_save(self) -> None:
        """Expose the finished prefills, release the cancelled."""
        for worker in self.sides.values():
            worker.wait_for_save()

    def get_finished(self) -> StepResults:
        """What finished since the last call; the orders' idle wait applies
        (`ConnectorMetadata.idle_wait_s`)."""
        out = StepResults()
        for role, worker in self.sides.items():
            report = worker.get_finished()
            worker.clear_connector_metadata()
            out.reports[role] = report
            out.finished_sending |= {ev.request_id for ev in report.finished_sending}
            out.finished_recving |= {ev.request_id for ev in report.finished_recving}
            if report.error:
                self.log.warning("kvbridge %s worker %d: %s", role.value, self.rank, report.error)
            for ev in report.finished_recving:
                self._pulled(ev)
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of pulls that failed since the last call (the host recomputes or fails)."""
        worker = self.sides.get(ConnectorRole.CONSUMER)
        return worker.get_block_ids_with_load_errors() if worker is not None else set()

    def take_pulls(self) -> Figures | None:
        """The pulls that ended since the last call, as figures (None if none)."""
        if not has_figures(self._figures):
            return None
        out, self._figures = self._figures, no_pulls()
        return out

    def shutdown(self) -> None:
        for role, worker in self.sides.items():
            try:
                worker.shutdown()
            except Exception as exc:
                self.log.warning("kvbridge %s worker %d: close: %s", role.value, self.rank, exc)
        self.sides = {}

    def _pulled(self, ev: ConnectorEvent) -> None:
        pull = self._pulls.pop(ev.request_id, None)
        record_pull(self._figures, ev)
        if not ev.ok:
            self.log.warning(
                "kvbridge decode worker %d failed to pull %s: %s",
                self.rank,
                ev.request_id,
                ev.reason,
            )
            return
        start, end, groups = pull if pull is not None else (0, 0, 1)
        self.log.info(
            "kvbridge decode worker %d pulled %s: tokens [%d, %d), %d bytes "
            "(+%d copied from a sibling) in %.1f ms, %d descriptors, phases ms %s%s",
            self.rank,
            ev.request_id,
            start,
            end,
            ev.nbytes,
            ev.local_nbytes,
            ev.elapsed_ms,
            ev.num_descriptors,
            "/".join(f"{ms:.2f}" for ms in ev.phases_ms) or "-",
            f", {groups} cache groups" if groups > 1 else "",
        )
