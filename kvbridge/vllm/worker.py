"""The connector's worker side in vLLM: one per worker (TP rank), in the worker process.

It only translates. vLLM's registered caches (`cache.describe_kv_caches`) are handed to
the hand-over contract's worker side (`kvbridge.connector.KVConnectorWorker`), one per
role the instance plays, each with its own NIXL agent and progress thread; each step's
orders go to them as they are, and their reports come back three ways: vLLM's finished
sets and load-error blocks (which vLLM acts on), the reports themselves (for the
scheduler side's request states, through vLLM's connector worker metadata), and one
observation per pull for vLLM's metrics (`stats.py`). Nothing here imports vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvbridge.connector import (
    ConnectorMetadata,
    ConnectorRole,
    ConnectorSpec,
    KVWorkerOutput,
    Pull,
)
from kvbridge.connector.worker import KVConnectorWorker
from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.vllm.cache import RegisteredCache
from kvbridge.vllm.settings import ConnectorSettings

#: under vLLM's "vllm" logger, so vLLM's handlers print it
log = logging.getLogger("vllm.kvbridge")
#: what a decode worker records per pull for vLLM's metrics (`stats.py`): seconds and
#: bytes of each pull that completed, a 1 per pull that failed
OBSERVATION_KEYS = ("pull_seconds", "pull_bytes", "failed_pulls")


@dataclass
class StepResults:
    """One step's report to vLLM: its finished sets, and every role's worker report."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    reports: dict[ConnectorRole, KVWorkerOutput] = field(default_factory=dict)


class WorkerSide:
    """One TP rank's hand-over workers; built by `register_kv_caches`, closed by `close`
    (the connector's `shutdown`). Called from vLLM's worker thread only."""

    def __init__(
        self,
        settings: ConnectorSettings,
        instance_id: str,
        roles: tuple[ConnectorRole, ...],
        model: ModelKVSpec,
        cache: RegisteredCache,
        rank: int,
    ) -> None:
        self.rank = rank
        secret = settings.identity.secret.decode() if settings.identity else ""
        self.sides: dict[ConnectorRole, KVConnectorWorker] = {}
        try:
            for role in roles:
                identity = secret if role is ConnectorRole.CONSUMER else ""
                spec = ConnectorSpec(role, instance_id, settings.transfer, identity=identity)
                self.sides[role] = KVConnectorWorker(spec, model, cache.layout, rank)
                self.sides[role].register_regions(cache.regions, cache.num_blocks, adopt=True)
        except BaseException:
            self.close()
            raise
        #: the handshake metadata: a producer's side channel, a consumer's sibling entry
        self.endpoint, self.sibling = (
            self.sides[role].get_handshake_metadata() if role in self.sides else ""
            for role in (ConnectorRole.PRODUCER, ConnectorRole.CONSUMER)
        )
        self._pulls: dict[str, Pull] = {}  # in flight, by vLLM's id (for the log line)
        self._observed: dict[str, list[float]] = {key: [] for key in OBSERVATION_KEYS}

    def start(self, orders: dict[ConnectorRole, ConnectorMetadata]) -> None:
        """Bind one step's orders and start them: pulls, declines, introductions, the
        instance's endpoints and siblings (vLLM's start_load_kv)."""
        for role, worker in self.sides.items():
            meta = orders.get(role, ConnectorMetadata())
            worker.bind_connector_metadata(meta)
            worker.start_load_kv()
            self._pulls.update(meta.pulls())

    def save(self) -> None:
        """Expose the finished prefills, release the cancelled (vLLM's wait_for_save)."""
        for worker in self.sides.values():
            worker.wait_for_save()

    def collect(self) -> StepResults:
        """What finished since the last call (vLLM's get_finished); the orders' idle
        wait applies (`ConnectorMetadata.idle_wait_s`)."""
        out = StepResults()
        for role, worker in self.sides.items():
            report = worker.get_finished()
            worker.clear_connector_metadata()
            out.reports[role] = report
            out.finished_sending |= {ev.request_id for ev in report.finished_sending}
            out.finished_recving |= {ev.request_id for ev in report.finished_recving}
            if report.error:
                log.warning("kvbridge %s worker %d: %s", role.value, self.rank, report.error)
            for ev in report.finished_recving:
                self._observe(
                    ev.request_id, ev.ok, ev.nbytes, ev.local_nbytes, ev.elapsed_ms, ev.reason
                )
        return out

    def load_errors(self) -> set[int]:
        """Blocks of pulls that failed since the last call (vLLM recomputes or fails)."""
        worker = self.sides.get(ConnectorRole.CONSUMER)
        return worker.get_block_ids_with_load_errors() if worker is not None else set()

    def take_observations(self) -> dict[str, list[float]] | None:
        """The pulls finished since the last call, for vLLM's metrics (None if none)."""
        if not any(self._observed.values()):
            return None
        out, self._observed = self._observed, {key: [] for key in OBSERVATION_KEYS}
        return out

    def close(self) -> None:
        for role, worker in self.sides.items():
            try:
                worker.shutdown()
            except Exception as exc:
                log.warning("kvbridge %s worker %d: close: %s", role.value, self.rank, exc)
        self.sides = {}

    def _observe(self, rid: str, ok: bool, nbytes: int, local: int, ms: float, reason: str) -> None:
        pull = self._pulls.pop(rid, None)
        if not ok:
            self._observed["failed_pulls"].append(1.0)
            log.warning("kvbridge decode worker %d failed to pull %s: %s", self.rank, rid, reason)
            return
        self._observed["pull_seconds"].append(ms / 1e3)
        self._observed["pull_bytes"].append(float(nbytes))
        start, end = (pull.start_token, pull.num_tokens) if pull is not None else (0, 0)
        log.info(
            "kvbridge decode worker %d pulled %s: tokens [%d, %d), %d bytes "
            "(+%d copied from a sibling) in %.1f ms",
            self.rank,
            rid,
            start,
            end,
            nbytes,
            local,
            ms,
        )
