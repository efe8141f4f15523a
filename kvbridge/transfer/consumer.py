"""The consumer side: a decode worker pulls a request's KV from the producer's workers.

Lifecycle (mirrors vLLM's KV-connector): `pull` records the request and returns at
once; the owner calls `poll()` from its loop, which reports each pulled request
exactly once as DONE or FAILED (with the reason and the local block ids, handed
back either way). Handshakes and the cache of producer instances live in
`peers.ProducerDirectory`. Per request the consumer posts one NIXL READ per producer
worker, built from the planner's copy lists, carrying the `ReadDone` notification to
that worker, and reports the pull DONE once every producer worker it read from
confirmed it held the blocks for the whole read (`ReadAck`). Every failure is bounded
in time and reported with its reason.

`KVConsumer` is the engine-facing API over its parts, one concept a module:
  * `pull.py`: a pull held (`ActivePull`) and its outcome (`TransferResult`).
  * `pull_planner.py`: the prepared descriptor lists and each pull's READs, posted.
  * `pull_progress.py`: advancing the pulls: READ states, bounded failure, fencing
    (ReadAcks, digests), a fan-out's copy, outcomes and handing blocks back.
  * `notices.py`: the ReadDones producers wait for, and those owed after an outage.
  * `introductions.py`: meeting producers ahead of their first pull, warm-up READs.
  * `siblings.py`: this instance's other workers, for the fan-out on a decode host.
  * `staging.py`: where a pull lands in the prefill's KV dtype before its cast into a
    cache of another dtype (`TransferPlan.cast`), after the read, before DONE.

Not thread-safe: `pull`, `poll`, `close` from one thread at a time
(a `WorkerConnector` holds its lock around each).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvbridge.errors import ConfigError
from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.plan.layout import InstanceLayout
from kvbridge.transfer.agent import Transport
from kvbridge.transfer.config import TransferConfig
from kvbridge.transfer.errors import TransferError
from kvbridge.transfer.fence import FenceReader
from kvbridge.transfer.identity import Identity, bound_fingerprint
from kvbridge.transfer.integrity import is_checked, region_views
from kvbridge.transfer.introductions import Introductions
from kvbridge.transfer.messages import Hello, LayoutWire, ModelWire
from kvbridge.transfer.notices import ProducerNotices
from kvbridge.transfer.peers import ProducerDirectory
from kvbridge.transfer.pull import (
    ActivePull,
    DecodeWorker,
    PullFailure,
    TransferResult,
    TransferState,
)
from kvbridge.transfer.pull_planner import PullPlanner
from kvbridge.transfer.pull_progress import PullProgress
from kvbridge.transfer.regions import CacheRegions, worker_shard_checked
from kvbridge.transfer.siblings import Siblings, sibling_key
from kvbridge.transfer.staging import Staging

__all__ = ["KVConsumer", "PullFailure", "TransferResult", "TransferState"]

log = logging.getLogger("kvbridge.transfer.consumer")


class KVConsumer:
    """One decode worker's side of the transfer runtime; borrows `transport`, which
    must have `regions` (this worker's cache) registered. Owned by the worker process
    that owns the cache; its methods are called from one thread at a time. Every pull
    it accepts is reported once, by `poll` or `close`, and its blocks are handed back
    only then (a decline is never reported); every wait is bounded by the config's
    timeouts."""

    def __init__(
        self,
        *,
        model: ModelKVSpec,
        layout: InstanceLayout,
        rank: int,
        regions: CacheRegions,
        num_blocks: int,
        transport: Transport,
        config: TransferConfig,
        instance_id: str,
        clock: Callable[[], float] = time.monotonic,
        identity: Identity | None = None,
        root: bytes | None = None,
    ) -> None:
        if identity is not None:
            identity.check_id(instance_id)
        elif bound_fingerprint(instance_id) is not None and config.token is not None:
            raise ConfigError(
                f"instance_id={instance_id!r} is bound to a key but no identity was given; "
                "pass the instance's Identity (every producer would refuse this worker)"
            )
        self.model, self.layout, self.rank = model, layout, rank
        self.shard = worker_shard_checked(model, layout, "decode", rank, regions, num_blocks)
        self.regions, self.num_blocks = regions, num_blocks
        self.transport, self.config, self.instance_id = transport, config, instance_id
        self._clock = clock
        self._views = region_views(regions)  # to digest what we pulled
        self.host = socket.gethostname()
        worker = DecodeWorker(rank, instance_id, regions, num_blocks, transport, config, clock)
        self._siblings = Siblings(
            worker, layout, self.host, sibling_key(identity, config.token, instance_id)
        )
        hello = Hello(
            instance_id=instance_id,
            rank=rank,
            model=ModelWire.of(model),
            layout=LayoutWire.of(layout),
            nonce=bytes(16),  # each handshake sends a fresh one (ProducerDirectory)
        )
        self.directory = ProducerDirectory(
            model=model,
            layout=layout,
            rank=rank,
            transport=transport,
            config=config,
            hello=hello,
            clock=clock,
            identity=identity,
            root=root,
            decode_hosts=self._siblings.fan_out_hosts,
        )
        self._notices = ProducerNotices(worker)
        # failure notices producers cut off could not be told, paid after the heal
        self.owed = self._notices.owed
        self.staging = Staging(worker)  # a converting plan's reads land there
        self._fence = FenceReader(transport)  # confirms pulls by producers' fence words
        self._planner = PullPlanner(
            worker, self.directory, self._siblings, self._notices, self.staging, self._fence
        )
        self._introductions = Introductions(worker, self.directory, self._planner)
        self._progress = PullProgress(
            worker,
            self.directory,
            self._planner,
            self._siblings,
            self._notices,
            self._views,
            self.staging,
            self._fence,
        )
        self._pulls = self._progress.pulls  # by request id, until reported

    # -- engine-facing API -------------------------------------------------------------
    def pull(
        self,
        request_id: str,
        endpoint: str,
        producer_block_ids: Sequence[int] | np.ndarray,
        local_block_ids: Sequence[int] | np.ndarray,
        num_tokens: int,
        start_token: int = 0,
        generation: int = 0,
        is_state: bool = False,
    ) -> None:
        """Start loading `request_id`'s tokens [start_token, num_tokens) from the producer
        instance at `endpoint` (its worker 0's side channel) into `local_block_ids`;
        returns at once. Both block lists start with the block holding token
        `start_token` (a partial pull: this worker holds the earlier tokens already).
        `generation` is the exposure's (the capability's): the producer confirms it.
        `is_state`: the blocks hold a per-request state read whole (`Pull.is_state`)."""
        if request_id in self._pulls:
            raise TransferError(f"request_id={request_id!r} is already being pulled")
        local = np.asarray(local_block_ids, dtype=np.int64).ravel()
        remote = np.asarray(producer_block_ids, dtype=np.int64).ravel()
        if len(local) and (local.min() < 0 or local.max() >= self.num_blocks):
            raise TransferError(
                f"local_block_ids of {request_id!r} must lie in "
                f"[0, {self.num_blocks}); got {local.tolist()[:8]}"
            )
        bd = self.layout.block_size
        if not 0 <= start_token < max(num_tokens, 1):
            raise TransferError(
                f"start_token={start_token} of {request_id!r} must be in [0, "
                f"num_tokens={num_tokens})"
            )
        if not 0 <= num_tokens - start_token // bd * bd <= len(local) * bd:
            raise TransferError(
                f"tokens [{start_token}, {num_tokens}) of {request_id!r} do not fit "
                f"{len(local)} local blocks of {bd} tokens"
            )
        self._forget_unreachable()  # never start a pull on a peer known to be gone
        self.owed.forget_request(request_id, endpoint)  # this pull tells it its outcome
        inst = self.directory.instance(endpoint)
        self._pulls[request_id] = ActivePull(
            request_id,
            inst,
            remote,
            local,
            num_tokens,
            self._clock() + self.config.transfer_timeout_s,
            start_token,
            generation=generation,
            checked=is_checked(self.config.integrity, request_id),
            handshake=not (inst.is_ready and inst.prepared),
            is_state=is_state,
        )

    def decline(self, request_id: str, endpoint: str, reason: str) -> None:
        """Tell the producer instance at `endpoint` that this worker will not read
        `request_id` (the engine refused it before pulling), so its workers release the
        blocks now instead of at the lease. Handshakes first if needed; returns at once;
        nothing is reported for it."""
        if request_id in self._pulls:
            raise TransferError(f"request_id={request_id!r} is being pulled; it cannot be declined")
        empty = np.zeros(0, dtype=np.int64)
        self.owed.forget_request(request_id, endpoint)
        self._pulls[request_id] = ActivePull(
            request_id,
            self.directory.instance(endpoint),
            empty,
            empty,
            0,
            self._clock() + self.config.handshake_timeout_s + 1,
            decline=reason[:1000],
        )

    def sibling(self) -> bytes:
        """What the other workers of this instance need to copy from this one (a
        `Sibling`, encoded): hand every worker's to each one's `set_siblings`."""
        return self._siblings.sibling()

    def set_siblings(self, siblings: Sequence[bytes]) -> None:
        """Meet the other workers of this instance (every worker's `sibling()`, rank
        order), so pulls from a producer this worker fans out from
        (`TransferConfig.fan_out`) read each byte once per host. Before this call (or
        at world size 1) every pull reads its own bytes: call it before the first
        handshake (the reference engine does so when it is made), since a producer
        instance met before keeps its plan. Every worker of the instance must get the
        same list and decide alike (`TransferConfig.fans_out_from`: its workers on one
        host), else the producers see two plans and the pulls fail as stale. Once only:
        a second call with the same workers does nothing; TransferError, with nothing
        loaded, on a list that does not describe this instance (count, ranks, this
        worker's own entry, an agent or regions that do not match)."""
        self._siblings.set_siblings(siblings)

    def connect(self, endpoint: str, instance_id: str = "") -> bool:
        """Meet the producer instance at `endpoint` ahead of its first request: handshake
        with the workers this worker will read from and prepare the descriptor lists, so
        the first pull costs what a later one does. Returns at once: whether this worker
        has met it already and its warm-up READs are over (so a caller may repeat the
        call until then, and a request sent after finds warm paths); `poll`
        advances it, and a failure is logged and forgotten (the next call or pull tries
        again). With `instance_id` (the producer instance's, as its handshake names it),
        a producer met before under another id (it restarted at the same address) is
        forgotten and met afresh, unless a pull still reads from it (that pull fails or
        ends first; call again then). One whose side channel went down is forgotten by
        `poll` already."""
        inst = self.directory.instance(endpoint)
        welcome = inst.worker0.welcome
        if (
            welcome is not None
            and instance_id
            and welcome.instance_id != instance_id
            and not any(p.instance is inst for p in self._pulls.values())
        ):
            self.directory.forget(
                inst,
                f"producer {endpoint} is now instance {instance_id!r}, not "
                f"{welcome.instance_id!r}; meeting it afresh",
            )
            inst = self.directory.instance(endpoint)
        if self._introductions.is_warming(inst):
            return False
        if inst.is_ready and inst.prepared:
            return True
        self._introductions.start(endpoint, inst)
        return False

    @property
    def is_busy(self) -> bool:
        """A pull or an introduction is in flight (poll often). A pull that ended but
        waits for a READ NIXL could not cancel does not count: it is retried every
        `RELEASE_RETRY_S`, which the idle cadence serves."""
        return self._introductions.is_busy or self._progress.is_busy

    def poll(self) -> list[TransferResult]:
        """Advance every handshake and pull; returns the requests that finished since."""
        now = self._clock()
        self.directory.poll(now)
        self._introductions.poll(now)
        self._progress.abandon_lost()
        self._forget_unreachable()
        self._notices.settle(self.directory)
        self._progress.poll(now)
        # Without NIXL's progress thread, our standalone notifications (to replicas
        # nobody reads, failure notices) leave only while our agent is progressed.
        self._siblings.take_notices(self.transport.notifs())
        return self._progress.take_results()

    @property
    def num_held_blocks(self) -> int:
        """Local blocks of requests not yet reported (the rest were handed back)."""
        return self._progress.num_held_blocks

    def close(self) -> list[TransferResult]:
        """Fail what is in flight ("consumer closed"), drop peers; returns those results."""
        self._progress.close()
        self.directory.close()
        self._siblings.close()
        self._planner.close(self._introductions.close())
        self._fence.close()
        return self._progress.take_results()

    def _forget_unreachable(self) -> None:
        """Forget idle producers whose side channel is down (`forget_unreachable`), and
        those that left a pull's READs unconfirmed until its timeout: a producer that
        evicted our session ignores our ReadDones (it cannot tell us: their signature
        names a session it no longer has), so every later pull would time out the same
        way; the next pull or introduction handshakes afresh instead."""
        in_use = self._progress.instances() + self._introductions.instances()
        self.directory.forget_unreachable(in_use)
        remeet = self._progress.remeet
        for endpoint, (inst, reason) in list(remeet.items()):
            if any(i is inst for i in in_use):
                continue
            del remeet[endpoint]
            if self.directory.find(endpoint) is inst:
                self.directory.forget(inst, f"{reason}; meeting it afresh")
