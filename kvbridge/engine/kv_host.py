"""The engine's side of hosting the KV connector (kvbridge.connector), where vLLM's
scheduler and model runner call theirs.

A flush builds the connector's pending orders (`build_connector_meta`), runs them on
every worker through the executor (`Executor.kv_step`) and folds the workers' reports
(`update_connector_output`); it returns the hand-overs that ended, which the engine acts
on (it owns the requests, its scheduler their blocks). `LLMEngine.step` flushes before
its forward pass (the pulls it allocated; it waits for them when they can join the step,
`join_wait_s`) and after it (the prefills that finished, exposed); `poll_kv` flushes
between steps, as often as `poll_interval` says.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time

from kvbridge.connector import (
    BUSY_POLL_S,
    IDLE_POLL_S,
    ConnectorRole,
    KVConnectorScheduler,
    KVRequest,
)
from kvbridge.engine.executor import Executor
from kvbridge.engine.scheduler import Scheduler
from kvbridge.engine.sequence import SequenceStatus

#: A decode step about to start waits up to this share of the last decode step's time for
#: the pulls it starts (`KVHost.join_wait_s`). A request can only join a batch between
#: steps, so without the wait a pull that ends 40 ms into a step of 300 ms joins the step
#: after it: its second token comes a whole step later. The running requests pay the wait
#: (one pull's time, once per pulled request); the pulled one gains up to a step. When
#: the recent pulls (median of the last `RECENT_PULLS`) took longer than the wait allows
#: (a slow link, a prefill gone), a step does not wait: it would only delay the others.
JOIN_WAIT_OF_STEP = 0.5
RECENT_PULLS = 8
#: The longest such wait: the engine loop serves its other calls between steps.
JOIN_WAIT_MAX_S = 1.0
log = logging.getLogger("kvbridge.engine")


class KVHost:
    """Owned by an LLMEngine started with a connector and called from its thread only:
    the connector's scheduler side (`kv`), the workers it orders (`executor`), and the
    figures a step's wait for its pulls is decided from. It frees no block and touches
    no request: it returns the connector's records."""

    def __init__(self, kv: KVConnectorScheduler, executor: Executor) -> None:
        self.kv = kv
        self.executor = executor
        self.decode_step_s = 0.0  # the last decode step's forward (`join_wait_s`)
        #: the workers' own time of the last pulls that ended (seconds; `join_wait_s`)
        self.pull_s: collections.deque[float] = collections.deque(maxlen=RECENT_PULLS)

    def flush(self, poll: bool = False, recv_wait_s: float = 0.0) -> list[KVRequest]:
        """Send the pending orders to every worker (with `recv_wait_s`, the workers wait
        that long for the pulls ordered now) and fold their reports: the hand-overs that
        ended. Without `poll` and with no order pending, the workers are not called."""
        kv = self.kv
        meta = kv.build_connector_meta(recv_wait_s)
        if meta.is_empty and not poll:
            return []
        ended = kv.update_connector_output(self.executor.kv_step(meta))
        for error in kv.errors:
            log.warning("KV connector: %s", error)
        return ended

    def pulled(self, rec: KVRequest) -> None:
        """A decode request's load ended: its workers' time counts towards the next
        waits (none for a load refused before any worker began)."""
        if rec.worker_ms:
            self.pull_s.append(rec.worker_ms / 1e3)

    def poll_interval(self) -> float | None:
        """How soon a poll is due: often while a transfer is in flight (to collect its
        outcome); for workers that do not progress their connectors on their own, also
        just after an introduction or a decline (the handshakes advance only in those
        polls) and now and then as an idle producer (it answers handshakes and runs
        leases in them); None when nothing needs it."""
        if self.kv.has_transfers:
            return BUSY_POLL_S
        if self.executor.connector_polls_itself:
            return None
        if time.monotonic() < self.kv.busy_until:
            return BUSY_POLL_S
        return IDLE_POLL_S if self.kv.role is ConnectorRole.PRODUCER else None

    def join_wait_s(self, scheduler: Scheduler) -> float:
        """How long the next step waits for the pulls it is about to start: with decodes
        running and only pulled requests waiting, up to `JOIN_WAIT_OF_STEP` of the last
        decode step (at most `JOIN_WAIT_MAX_S`), so a pull that ends by then joins this
        step instead of the next one; 0 when there is nothing to join, when the workers
        do not progress their pulls by themselves (nothing would move while we wait) or
        when recent pulls took longer than the wait."""
        if (
            not self.decode_step_s
            or not scheduler.running
            or not scheduler.waiting
            or not self.executor.connector_polls_itself
            or any(s.status is not SequenceStatus.WAITING_FOR_REMOTE_KV for s in scheduler.waiting)
        ):
            return 0.0
        wait = min(JOIN_WAIT_OF_STEP * self.decode_step_s, JOIN_WAIT_MAX_S)
        if self.pull_s and statistics.median(self.pull_s) > wait:
            return 0.0
        return wait
