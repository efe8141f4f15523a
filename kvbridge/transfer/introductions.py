"""A decode worker meets producer instances ahead of their first pull.

`KVConsumer.connect` starts an introduction; each poll advances it: the handshakes
(`peers.ProducerDirectory`), then the descriptor lists a whole-block request needs
(`PullPlanner.prepare`), then a short settle at the busy cadence (NIXL makes its
connections to the peers it was told of only while this worker progresses), and a
warm-up READ per producer worker read from, carrying a `Meet` notification, so the first
pull finds NIXL's and UCX's paths to it set up. A failure is logged and forgotten: the
next call or pull tries again.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from kvbridge.errors import KVBridgeError
from kvbridge.transfer.agent import XferState
from kvbridge.transfer.descriptors import num_units, unit_descs
from kvbridge.transfer.errors import TransferError
from kvbridge.transfer.messages import Meet
from kvbridge.transfer.peers import ProducerDirectory, ProducerInstance, ProducerWorker
from kvbridge.transfer.pull import RELEASE_RETRY_S, DecodeWorker
from kvbridge.transfer.pull_planner import PullPlanner
from kvbridge.transfer.regions import CacheRegions, MemType

log = logging.getLogger("kvbridge.transfer.consumer")

#: How long an introduced producer is still polled at the busy cadence once met, so the
#: connections NIXL makes to its workers complete before the first pull (seconds).
CONNECT_SETTLE_S = 0.3
#: Units each producer worker met by an introduction is read in a warm-up READ, which
#: carries a `Meet` notification: NIXL and UCX set up a peer's READ and notification
#: paths at their first use, which the first pull paid (~20 ms here; docs/benchmarks.md).
WARM_UNITS = 2


class Introductions:
    """One decode worker's introductions in flight and its warm-up READs, owned by its
    `KVConsumer` and called from the consumer's thread only. An introduction ends once
    met and settled (`CONNECT_SETTLE_S`), failed, or past the handshake timeout; a
    warm-up READ ends once done or given up on (a handshake timeout), and one NIXL
    could not cancel is retried every `RELEASE_RETRY_S`. Never raises for a producer:
    every failure is logged. The scratch buffers the warm-ups read into stay registered
    for the consumer's life (NIXL keeps a registration until the agent closes)."""

    def __init__(
        self, worker: DecodeWorker, directory: ProducerDirectory, planner: PullPlanner
    ) -> None:
        self.rank, self.instance_id, self.regions = worker.rank, worker.instance_id, worker.regions
        self.transport, self.config = worker.transport, worker.config
        self._directory, self._planner = directory, planner
        self._connecting: dict[str, ProducerInstance] = {}  # introductions in flight
        self._connect_deadline: dict[str, float] = {}
        self._settle_until: dict[str, float] = {}  # met; connections still being made
        #: warm-up READs' destinations: unit size -> (buffer, its prepared list); the
        #: READs in flight, with when to stop waiting for them
        self._scratch: dict[int, tuple[np.ndarray, Any | None]] = {}
        #: warm-up READs in flight: (READ, when to give up on it, its producer instance,
        #: the producer worker read)
        self._warming: list[tuple[Any, float, ProducerInstance, ProducerWorker]] = []
        self._warm_retry_at = 0.0  # a warm-up READ NIXL could not cancel: retried then

    def start(self, endpoint: str, inst: ProducerInstance) -> None:
        """Introduce this worker to `inst`, the producer instance at `endpoint`."""
        self._connecting[endpoint] = inst

    @property
    def is_busy(self) -> bool:
        """An introduction is in flight."""
        return bool(self._connecting)

    def is_warming(self, inst: ProducerInstance) -> bool:
        """`inst` is not met and prepared yet, or a warm-up READ from it is in flight:
        a pull now would still wait for a handshake or find a path cold."""
        return any(i is inst and not i.prepared for i in self._connecting.values()) or any(
            w[2] is inst for w in self._warming
        )

    def instances(self) -> list[ProducerInstance]:
        """The producer instances an introduction or a warm-up READ still uses."""
        return list(self._connecting.values()) + [inst for _, _, inst, _ in self._warming]

    def poll(self, now: float) -> None:
        """Advance every introduction (after the directory's poll) and warm-up READ."""
        for endpoint, inst in list(self._connecting.items()):
            if inst.reason:
                log.warning(
                    "decode worker %d: meeting %s failed: %s", self.rank, endpoint, inst.reason
                )
                del self._connecting[endpoint]
            elif inst.is_ready:
                try:
                    if not inst.prepared:
                        self._planner.prepare(inst)
                        self._warm_up(inst, now)
                except KVBridgeError as exc:
                    log.warning(
                        "decode worker %d: preparing %s failed: %s", self.rank, endpoint, exc
                    )
                    del self._connecting[endpoint]
                    continue
                # met: stay busy (polled every millisecond) a moment longer, since NIXL
                # connects to the peers it was told to (`Transport.add_peer`) only while
                # this worker progresses; the first pull then finds the connections made
                if now >= self._settle_until.setdefault(endpoint, now + CONNECT_SETTLE_S):
                    del self._connecting[endpoint]
            elif now >= self._connect_deadline.setdefault(
                endpoint, now + self.config.handshake_timeout_s + 1
            ):
                del self._connecting[endpoint]  # the directory reports its own timeout
        for waits in (self._connect_deadline, self._settle_until):
            for endpoint in [e for e in waits if e not in self._connecting]:
                del waits[endpoint]
        if self._warming and now >= self._warm_retry_at:
            self._warming = [w for w in self._warming if not self._ended_warm_up(*w, now)]

    def _warm_up(self, inst: ProducerInstance, now: float) -> None:
        """After an introduction: READ `WARM_UNITS` units of each producer worker this
        worker reads from into a scratch buffer of its own, with a `Meet` notification
        (the producer only notes it), so the first pull finds NIXL's and UCX's paths to
        it set up. Best effort: a refusal is logged, never a failure. Host-memory caches
        only (the scratch buffer is host memory)."""
        if self.regions.mem_type is not MemType.DRAM:
            return
        for p, g in inst.block_units.items():
            peer = inst.readers[p]
            assert peer.regions is not None
            n = min(WARM_UNITS, num_units(peer.regions, g))
            idx = np.arange(n, dtype=np.int32)
            meet = peer.sign(Meet(instance_id=self.instance_id, rank=self.rank))
            try:
                local = self._scratch_dlist(g)
                remote = self._directory.remote_dlist(peer, g)
                xfer, _ = self.transport.read(local, idx, remote, idx, meet)
            except TransferError as exc:
                log.info(
                    "decode worker %d: warm-up READ from %s: %s", self.rank, peer.endpoint, exc
                )
                continue
            self._warming.append((xfer, now + self.config.handshake_timeout_s, inst, peer))

    def _ended_warm_up(
        self, xfer: Any, give_up_at: float, inst: ProducerInstance, peer: ProducerWorker, now: float
    ) -> bool:
        """Whether a warm-up READ is over and released (a stuck one is given up on at
        `give_up_at`; one NIXL cannot cancel is retried after `RELEASE_RETRY_S`); one
        that completed leaves `peer`'s path warm."""
        state = self.transport.state(xfer)
        if state is XferState.PROC and now < give_up_at:
            return False
        if self.transport.release(xfer):
            peer.warm = peer.warm or state is XferState.DONE
            return True
        self._warm_retry_at = now + RELEASE_RETRY_S
        return False

    def _scratch_dlist(self, g: int) -> Any:
        """A prepared list of `WARM_UNITS` g-byte units of a host buffer registered for
        the warm-up READs (never the cache: its blocks may hold a request). The buffer is
        kept for the consumer's life once registered (NIXL keeps the registration until
        the agent closes), even if preparing its list failed."""
        if g not in self._scratch:
            buf = np.zeros(WARM_UNITS * g, dtype=np.uint8)
            self.transport.register(CacheRegions.from_array(buf[None, :]))
            self._scratch[g] = (buf, None)
        buf, handle = self._scratch[g]
        if handle is None:
            regions = CacheRegions.from_array(buf[None, :])
            handle = self.transport.prep_local(unit_descs(regions, g))
            self._scratch[g] = (buf, handle)
        return handle

    def close(self) -> list[Any]:
        """Release the warm-up READs in flight; returns the scratch buffers' prepared
        lists, for the caller to release with its own (the buffers are kept: they
        outlive the agent)."""
        for xfer, _, _, _ in self._warming:
            self.transport.release(xfer)  # (the scratch buffers outlive the agent: kept)
        self._warming.clear()
        return [h for _, h in self._scratch.values() if h is not None]
