"""The consumer side: a decode worker pulls a request's KV from the producer's workers.

Lifecycle (mirrors vLLM's KV-connector): `pull` records the request and returns at
once; the owner calls `poll()` from its loop, which reports each pulled request
exactly once as DONE or FAILED (with the reason and the local block ids, handed
back either way). Handshakes and the cache of producer instances live in
`peers.ProducerDirectory`. Per request the consumer posts one NIXL READ per producer
worker, built from the planner's copy lists, carrying the `ReadDone` notification to
that worker. Copies that are not whole units of the lists prepared at handshake (a
partial last block) go in a second READ with descriptor lists of their own; a worker
read twice gets its notification from us once its last READ is done. Note that with
UCX's cma transport a READ is copied inside `transfer()`, so a `poll` that posts a large
READ takes its copy time.

Bounded failure: a refused or unanswered handshake, a NIXL error, a producer worker
whose side channel answered no heartbeat for `liveness_timeout_s` (its host or link is
down) or a request running past `transfer_timeout_s` fails the request with its reason
(a lost worker is forgotten, so the next pull reconnects); a request that gives up
tells the producer workers still waiting (`ReadDone(ok=False)`), so they release at
once instead of at the lease; one that cannot be told (its host or link is down) is
owed that notice (`owed.OwedNotices`), sent once this worker has met the same producer
instance again after the heal, until the lease would have freed the blocks. A pull's
blocks are handed back only when none of its READs can still write into them: one NIXL
could not cancel keeps the pull (and its blocks) held, retried every second, and its
outcome is reported, and its producers told, once it is released, so a late completion
never lands in blocks given to another request (and the producer keeps its source
blocks until then).

Fencing: a pull's READs are DONE once NIXL has copied the bytes, but the bytes are the
exposure's only if the producer still held it for the whole read (a reader paused or cut
off past the lease reads blocks the producer may have given to another request). So a
pull is DONE only once every producer worker it read bytes from answered its ReadDone
with `ReadAck(held=True)` for the pull's generation (the capability's); `held=False`
fails it at once as stale (`PullFailure.STALE`, its reason naming the exposure), and an
answer that never comes fails it at the liveness or transfer bound like a READ.
Fan-out on the decode host: decode workers of one instance that hold the same cells (GQA
heads replicated when decode tp > num_kv_heads; MLA's latent) need the same prefill
bytes. Once the engine told every worker its siblings (`sibling` -> `set_siblings`: each
one's host, NIXL agent and cache regions), a pull from a producer the config fans out
from (`TransferConfig.fan_out`) is planned with the workers' hosts: on each host the
lowest rank holding a set of cells reads it over the link; as soon as its READs are done
it tells each worker that copies from it (`LocalReady`, a NIXL notification signed with
the instance's sibling key), which READs those blocks from its cache on the host (CMA
for host memory) while the producers confirm; the reader tells them again once its pull
is confirmed, and only then is a copy DONE. A reader whose pull failed (stale included)
tells them so, and their copies are not used. A copier's bound is the pull's
`transfer_timeout_s`, and again as much from when its copy starts. The producer plans
the same (`Hello.decode_hosts`) and waits only for the readers' ReadDones.

Not thread-safe: `pull`, `poll`, `close` from one thread at a time
(a `WorkerConnector` holds its lock around each).
"""

from __future__ import annotations

import collections
import enum
import functools
import hashlib
import hmac
import logging
import math
import socket
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.plan.copylist import CopyList, copy_lists, local_copy_lists
from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.plan.layout import InstanceLayout
from kvbridge.transfer.agent import Transport, XferState
from kvbridge.transfer.config import TransferConfig
from kvbridge.transfer.descriptors import (
    exact_descs,
    num_units,
    unit_descs,
    unit_indices,
    unit_size,
)
from kvbridge.transfer.errors import ProtocolError, TransferError
from kvbridge.transfer.identity import Identity, bound_fingerprint
from kvbridge.transfer.integrity import Integrity, digest, is_checked, region_views
from kvbridge.transfer.messages import (
    Hello,
    LayoutWire,
    LocalReady,
    Meet,
    ModelWire,
    ReadDone,
    Sibling,
    decode,
    decode_sibling,
    encode,
    encode_sibling,
    spec_error,
)
from kvbridge.transfer.owed import OwedNotices
from kvbridge.transfer.peers import (
    PeerState,
    ProducerDirectory,
    ProducerInstance,
    ProducerWorker,
    unit_dlist,
)
from kvbridge.transfer.regions import CacheRegions, MemType, worker_shard_checked

log = logging.getLogger("kvbridge.transfer.consumer")

#: How long an introduced producer is still polled at the busy cadence once met, so the
#: connections NIXL makes to its workers complete before the first pull (seconds).
CONNECT_SETTLE_S = 0.3
#: How often an ended pull retries releasing a READ NIXL could not cancel (seconds).
RELEASE_RETRY_S = 1.0
#: `_Pull.xfers` key of a READ from a sibling's cache (the second hop of a fan-out)
LOCAL = -1
#: Units each producer worker met by an introduction is read in a warm-up READ, which
#: carries a `Meet` notification: NIXL and UCX set up a peer's READ and notification
#: paths at their first use, which the first pull paid (~20 ms here; docs/benchmarks.md).
WARM_UNITS = 2
#: LocalReady notices kept for pulls not started yet here (the oldest go first).
MAX_EARLY_READY = 4096


class PullFailure(enum.Enum):
    """Why a pull failed, where a counter tells it apart (else it has no cause)."""

    STALE = "stale"  # a producer did not hold the exposure for the whole read
    INTEGRITY = "integrity"  # the bytes read differ from the producer's digest of them


class TransferState(enum.Enum):
    HANDSHAKING = "handshaking"  # waiting for the producer's workers to answer
    READING = "reading"  # READs posted
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class TransferResult:
    """The outcome of one pull; `local_block_ids` are the caller's again."""

    request_id: str
    state: TransferState
    reason: str
    local_block_ids: tuple[int, ...]
    nbytes: int = 0
    num_descriptors: int = 0  # copy-list descriptors after merging adjacent runs
    num_unmerged: int = 0  # before merging
    num_indices: int = 0  # prepared-list entries posted (NIXL merges consecutive ones)
    failure: PullFailure | None = None  # FAILED: the cause a counter tells apart
    local_nbytes: int = 0  # copied from a sibling's cache on this host (a fan-out)


@dataclass
class _Pull:
    request_id: str
    instance: ProducerInstance
    producer_block_ids: np.ndarray
    local_block_ids: np.ndarray
    num_tokens: int
    deadline: float
    start_token: int = 0  # tokens [0, start_token) are ours already: not read
    decline: str | None = None  # not a pull: tell the producer we will not read, and why
    generation: int = 0  # the exposure read (its capability's)
    checked: bool = False  # its bytes are checked against the producers' digests
    state: TransferState = TransferState.HANDSHAKING
    xfers: dict[int, tuple[int, Any]] = field(default_factory=dict)  # i -> (prefill rank, READ)
    temp_dlists: list[Any] = field(default_factory=list)
    notified: set[int] = field(default_factory=set)  # prefill ranks told we are done
    # prefill ranks read by more than one READ: none carries the notification; it
    # follows the last
    silent: set[int] = field(default_factory=set)
    # prefill ranks we read bytes from that have not yet answered held (`ReadAck`)
    awaiting: set[int] = field(default_factory=set)
    copies: dict[int, list[CopyList]] = field(default_factory=dict)  # prefill rank -> lists
    digests: dict[int, bytes] | None = None  # of what we read, per prefill rank (checked)
    stats: tuple[int, int, int, int] = (0, 0, 0, 0)
    # set once the pull has ended: its outcome, reported when no READ of it can still
    # write into its blocks (NIXL could not cancel one: retried every RELEASE_RETRY_S)
    outcome: tuple[TransferState, str, PullFailure | None] | None = None
    retry_at: float = 0.0  # when to try releasing its uncancelled READs again
    #: fan-out: the decode rank whose cache this pull copies from once it has the bytes
    source: int | None = None
    local_posted: bool = False  # its READs from the source's cache are posted
    source_confirmed: bool = False  # its source's pull is confirmed by the producers
    source_failure: str | None = None  # why its source's pull failed, once told
    told_copiers: bool = False  # a fan-out's source: told its copiers the bytes are here
    local_nbytes: int = 0

    @property
    def awaiting_acks(self) -> bool:
        """Every READ done; waiting for the producers' ReadAcks."""
        return self.state is TransferState.READING and not self.xfers and bool(self.awaiting)


@dataclass
class _Sibling:
    """Another decode worker of this instance, as this one knows it."""

    rank: int
    host: str
    agent: str
    regions: CacheRegions
    dlists: dict[int, Any] = field(default_factory=dict)  # unit size -> prepared list
    unit: int | None = None  # whole-block unit of a copy from it (None: exact lists)


def sibling_key(identity: Identity | None, token: bytes | None, instance_id: str) -> bytes | None:
    """The key signing `LocalReady` notices between the workers of decode instance
    `instance_id`: from the instance's secret key (only its workers hold it), else from
    the shared token (every holder of the secret could derive it; a notice still needs
    the receiver's NIXL metadata, which only its instance's workers are given); None
    without either (nothing is authenticated then)."""
    secret = identity.secret if identity is not None else token
    if secret is None:
        return None
    label = b"kvbridge fan-out siblings\0" + instance_id.encode()
    return hmac.new(secret, label, hashlib.sha256).digest()


class KVConsumer:
    """One decode worker's side of the transfer runtime; borrows `transport`, which
    must have `regions` (this worker's cache) registered."""

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
        if self._views is None and config.integrity is not Integrity.OFF:
            log.warning(
                "decode worker %d: integrity=%s is not checked for a %s cache (host memory only)",
                rank,
                config.integrity.value,
                regions.mem_type.value,
            )
        self._pulls: dict[str, _Pull] = {}
        self._local_dlists: dict[int, Any] = {}
        self._orphan_dlists: list[Any] = []  # of READs still uncancelled at close
        self._results: list[TransferResult] = []
        self._connecting: dict[str, ProducerInstance] = {}  # introductions in flight
        self._connect_deadline: dict[str, float] = {}
        self._settle_until: dict[str, float] = {}  # met; connections still being made
        #: producers to meet afresh once no pull reads from them (`_forget_unreachable`)
        self._remeet: dict[str, tuple[ProducerInstance, str]] = {}
        self.host = socket.gethostname()
        self._siblings: dict[int, _Sibling] = {}  # fan-out: this instance's other workers
        self._hosts: tuple[str, ...] | None = None  # every worker's host, once told
        self._sibling_ranks: dict[str, int] = {}  # agent name -> rank
        self._sibling_key = sibling_key(identity, config.token, instance_id)
        #: warm-up READs' destinations: unit size -> (buffer, its prepared list); the
        #: READs in flight, with when to stop waiting for them
        self._scratch: dict[int, tuple[np.ndarray, Any | None]] = {}
        #: warm-up READs in flight: (READ, when to give up on it, its producer instance)
        self._warming: list[tuple[Any, float, ProducerInstance]] = []
        self._warm_retry_at = 0.0  # a warm-up READ NIXL could not cancel: retried then
        #: (request id, generation) -> a source's notices, until the pull they name takes
        #: them
        self._ready: collections.OrderedDict[tuple[str, int], list[LocalReady]] = (
            collections.OrderedDict()
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
            decode_hosts=self._fan_out_hosts,
        )
        # failure notices producers cut off could not be told, paid after the heal
        self.owed = OwedNotices(ttl_s=config.lease_s, clock=clock)

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
    ) -> None:
        """Start loading `request_id`'s tokens [start_token, num_tokens) from the producer
        instance at `endpoint` (its worker 0's side channel) into `local_block_ids`;
        returns at once. Both block lists start with the block holding token
        `start_token` (a partial pull: this worker holds the earlier tokens already).
        `generation` is the exposure's (the capability's): the producer confirms it."""
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
        self._pulls[request_id] = _Pull(
            request_id,
            inst,
            remote,
            local,
            num_tokens,
            self._clock() + self.config.transfer_timeout_s,
            start_token,
            generation=generation,
            checked=self._views is not None and is_checked(self.config.integrity, request_id),
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
        self._pulls[request_id] = _Pull(
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
        exported = self.transport.peer_regions(self.regions)
        return encode_sibling(
            Sibling(
                rank=self.rank,
                host=self.host,
                agent_name=self.transport.name,
                agent_metadata=self.transport.metadata(),
                regions=list(zip(exported.addresses, exported.lengths, strict=True)),
                mem_type=self.regions.mem_type.value,
                device_id=self.regions.device_id,
            )
        )

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
        infos = [decode_sibling(b) for b in siblings]
        world = self.layout.world_size
        if len(infos) != world or [i.rank for i in infos] != list(range(world)):
            raise TransferError(
                f"siblings: {len(infos)} entries with ranks {[i.rank for i in infos][:16]}; "
                f"this decode instance has {world} workers, ranks 0..{world - 1} in order"
            )
        if infos[self.rank].agent_name != self.transport.name:
            raise TransferError(
                f"siblings: entry {self.rank} names agent {infos[self.rank].agent_name!r}, "
                f"not this worker's {self.transport.name!r}"
            )
        if self._hosts is not None:
            if all(
                i.rank == self.rank or self._siblings[i.rank].agent == i.agent_name for i in infos
            ):
                return
            raise TransferError("siblings were set already, to other workers")
        met: dict[int, _Sibling] = {}
        try:
            for info in infos:
                if info.rank != self.rank:
                    met[info.rank] = self._meet_sibling(info)
        except BaseException:
            for sib in met.values():  # all or nothing: no half-met instance
                self.transport.remove_peer(sib.agent)
            raise
        self._siblings = met
        self._sibling_ranks = {sib.agent: rank for rank, sib in met.items()}
        self._hosts = tuple(i.host for i in infos)

    def _meet_sibling(self, info: Sibling) -> _Sibling:
        """Load sibling `info`'s agent; TransferError (nothing loaded) if its entry is not
        one of this instance's workers."""
        agent = self.transport.add_peer(info.agent_metadata)
        regions = CacheRegions(
            tuple(a for a, _ in info.regions),
            tuple(n for _, n in info.regions),
            MemType(info.mem_type),
            info.device_id,
        )
        why = ""
        if agent != info.agent_name:
            why = f"its metadata names agent {agent!r}, its entry {info.agent_name!r}"
        elif regions.lengths != self.regions.lengths:
            why = (
                f"its {len(regions.lengths)} cache regions differ from this worker's "
                f"{len(self.regions.lengths)} (every worker of an instance has the same cache)"
            )
        if why:
            self.transport.remove_peer(agent)
            raise TransferError(f"sibling {info.rank}: {why}")
        return _Sibling(info.rank, info.host, agent, regions)

    def _fan_out_hosts(self, endpoint: str) -> tuple[str, ...] | None:
        """Every decode worker's host if pulls from the producer at `endpoint` fan out
        (`TransferConfig.fan_out`, siblings met), else None."""
        if self._hosts is None or not self.config.fans_out_from(endpoint):
            return None
        return self._hosts

    def connect(self, endpoint: str, instance_id: str = "") -> bool:
        """Meet the producer instance at `endpoint` ahead of its first request: handshake
        with the workers this worker will read from and prepare the descriptor lists, so
        the first pull costs what a later one does. Returns at once: whether this worker
        has met it already (so a caller may repeat the call until it has); `poll`
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
        if inst.is_ready and inst.prepared:
            return True
        self._connecting[endpoint] = inst
        return False

    @property
    def is_busy(self) -> bool:
        """A pull or an introduction is in flight (poll often). A pull that ended but
        waits for a READ NIXL could not cancel does not count: it is retried every
        `RELEASE_RETRY_S`, which the idle cadence serves."""
        return bool(self._connecting) or any(p.outcome is None for p in self._pulls.values())

    def poll(self) -> list[TransferResult]:
        """Advance every handshake and pull; returns the requests that finished since."""
        now = self._clock()
        self.directory.poll(now)
        for endpoint, inst in list(self._connecting.items()):
            if inst.reason:
                log.warning(
                    "decode worker %d: meeting %s failed: %s", self.rank, endpoint, inst.reason
                )
                del self._connecting[endpoint]
            elif inst.is_ready:
                try:
                    if not inst.prepared:
                        self._prepare(inst)
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
            self._warming = [w for w in self._warming if not self._ended_warm_up(w[0], w[1], now)]
        self._abandon_lost()
        self._forget_unreachable()
        self.owed.settle(self.directory.find, self._send_owed)
        for pull in list(self._pulls.values()):
            self._advance_pull(pull, now)
        # Without NIXL's progress thread, our standalone notifications (to replicas
        # nobody reads, failure notices) leave only while our agent is progressed.
        self._take_notices(self.transport.notifs())
        out, self._results = self._results, []
        return out

    @property
    def num_held_blocks(self) -> int:
        """Local blocks of requests not yet reported (the rest were handed back)."""
        return sum(len(p.local_block_ids) for p in self._pulls.values())

    def close(self) -> list[TransferResult]:
        """Fail what is in flight ("consumer closed"), drop peers; returns those results."""
        for pull in list(self._pulls.values()):
            self._finish(pull, TransferState.FAILED, "consumer closed", final=True)
        self.directory.close()
        for sib in self._siblings.values():
            for handle in sib.dlists.values():
                self.transport.release_dlist(handle)
            self.transport.remove_peer(sib.agent)
        self._siblings.clear()
        for xfer, _, _ in self._warming:
            self.transport.release(xfer)  # (the scratch buffers outlive the agent: kept)
        self._warming.clear()
        self._orphan_dlists += [h for _, h in self._scratch.values() if h is not None]
        for handle in (*self._local_dlists.values(), *self._orphan_dlists):
            self.transport.release_dlist(handle)
        self._local_dlists.clear()
        self._orphan_dlists.clear()
        out, self._results = self._results, []
        return out

    # -- requests ----------------------------------------------------------------------
    def _advance_pull(self, pull: _Pull, now: float) -> None:
        if pull.outcome is not None:  # ended; a READ NIXL could not cancel yet
            if now >= pull.retry_at:
                self._finish(pull, pull.outcome[0], pull.outcome[1])
            return
        inst = pull.instance
        if pull.state is TransferState.HANDSHAKING:
            if inst.reason:
                self._finish(pull, TransferState.FAILED, inst.reason)
                return
            if inst.is_ready and pull.decline is not None:
                self._finish(pull, TransferState.FAILED, f"declined: {pull.decline}")
                return
            if inst.is_ready:
                try:
                    if not inst.prepared:
                        self._prepare(inst)
                    self._post(pull)
                except KVBridgeError as exc:
                    self._finish(pull, TransferState.FAILED, spec_error(exc))
                    return
        if pull.state is TransferState.READING:
            for i, (p, xfer) in list(pull.xfers.items()):
                st = self.transport.state(xfer)
                if p == LOCAL:
                    if st is XferState.DONE:
                        self.transport.release(xfer)
                        del pull.xfers[i]
                    elif st is XferState.ERR:
                        self._finish(
                            pull,
                            TransferState.FAILED,
                            f"NIXL READ from decode worker {pull.source}'s cache on this host "
                            "ended in ERR state; that worker may have died",
                        )
                        return
                    continue
                if st is XferState.DONE:  # NIXL delivered the READ's notification, if any
                    log.debug(
                        "decode worker %d: a READ of %r from prefill worker %d done",
                        self.rank,
                        pull.request_id,
                        p,
                    )
                    self.transport.release(xfer)
                    del pull.xfers[i]
                    if p not in pull.silent:
                        pull.notified.add(p)
                    elif all(q != p for q, _ in pull.xfers.values()):  # p's last READ
                        peer = inst.readers[p]
                        self._notify(pull, p, peer, self._done(pull, peer))
                elif st is XferState.ERR:
                    peer = inst.readers[p]
                    reason = (
                        f"NIXL READ from prefill worker {p} ({peer.endpoint}, agent "
                        f"{peer.agent!r}) ended in ERR state; the producer worker may have died"
                    )
                    self.directory.drop(peer, reason)
                    self._finish(pull, TransferState.FAILED, reason)
                    return
            if pull.source is not None:
                if self._copy_from_source(pull):
                    return
            elif not pull.xfers:
                if not pull.told_copiers:  # the bytes are here: copiers may copy them now
                    pull.told_copiers = True
                    self._tell_copiers(pull, TransferState.READING)
                if self._confirmed(pull):
                    return
        if now >= pull.deadline:
            unconfirmed = pull.awaiting_acks
            reason = self._timeout_reason(pull)
            self._finish(pull, TransferState.FAILED, reason)
            if unconfirmed:  # our session may be gone there (evicted): meet it afresh
                self._remeet[inst.endpoint] = (inst, reason)

    def _confirmed(self, pull: _Pull) -> bool:
        """Take the ReadAcks of `pull` (every READ done): DONE once every producer
        worker read answered held, FAILED (stale) at the first that did not. Whether
        the pull ended."""
        if pull.checked and pull.digests is None:  # while the producers digest theirs
            assert self._views is not None
            views = self._views
            pull.digests = {p: digest(views, pull.copies[p], "dst") for p in pull.awaiting}
        for p in sorted(pull.awaiting):
            peer = pull.instance.readers[p]
            ack = peer.acks.get((pull.request_id, pull.generation))
            if ack is None:
                continue
            del peer.acks[(pull.request_id, pull.generation)]
            log.debug(
                "decode worker %d: ReadAck of %r from prefill worker %d (held %s)",
                self.rank,
                pull.request_id,
                p,
                ack.held,
            )
            if not ack.held:
                self._finish(
                    pull,
                    TransferState.FAILED,
                    f"stale pull: prefill worker {p} ({peer.endpoint}) no longer held "
                    f"{pull.request_id!r} (generation {pull.generation}) when our ReadDone "
                    f"arrived ({ack.reason}); the bytes read may be another request's",
                    failure=PullFailure.STALE,
                )
                return True
            if pull.digests is not None and ack.digest and ack.digest != pull.digests[p]:
                nbytes = sum(cl.nbytes for cl in pull.copies[p])
                self._finish(
                    pull,
                    TransferState.FAILED,
                    f"integrity check failed: the {nbytes} bytes of {pull.request_id!r} read "
                    f"from prefill worker {p} ({peer.endpoint}) differ from its digest of what "
                    "it exposed; the KV is not used",
                    failure=PullFailure.INTEGRITY,
                )
                return True
            pull.awaiting.discard(p)
        if pull.awaiting:
            return False
        self._finish(pull, TransferState.DONE, "")
        return True

    def _copy_from_source(self, pull: _Pull) -> bool:
        """A fan-out's second hop: once `pull`'s source tells that the bytes are in its
        cache (`LocalReady`), READ them from there (on this host); DONE once those READs
        are done and the source's pull is confirmed by the producers, FAILED if the
        source's pull failed (once no READ of ours is left). Whether the pull ended."""
        assert pull.source is not None
        for notice in self._ready.pop((pull.request_id, pull.generation), []):
            if notice.rank != pull.source:
                log.warning(
                    "decode worker %d: a LocalReady of %r from decode worker %d, which does "
                    "not read it for this worker (%d does); ignored",
                    self.rank,
                    pull.request_id,
                    notice.rank,
                    pull.source,
                )
                continue
            if not notice.ok:
                pull.source_failure = notice.reason
                break
            pull.source_confirmed |= notice.confirmed
            if not pull.local_posted:
                # the second hop gets a transfer timeout of its own from here: a reader
                # that took its whole bound leaves its copiers time to copy
                pull.deadline = max(pull.deadline, self._clock() + self.config.transfer_timeout_s)
                try:
                    self._copy(pull)
                except TransferError as exc:
                    self._finish(pull, TransferState.FAILED, str(exc))
                    return True
        if pull.xfers:
            return False
        if pull.source_failure is not None:
            self._finish(
                pull,
                TransferState.FAILED,
                f"decode worker {pull.source}, which reads these bytes over the link for "
                f"this worker, failed its pull: {pull.source_failure}",
            )
            return True
        if pull.source_confirmed:
            self._finish(pull, TransferState.DONE, "")
            return True
        return False

    def _copy(self, pull: _Pull) -> None:
        """Post the READs of `pull`'s bytes from its source's cache; TransferError if
        NIXL refuses one."""
        assert pull.source is not None and pull.instance.plan is not None
        sib = self._siblings[pull.source]
        pull.local_posted = True
        for cl in local_copy_lists(
            pull.instance.plan,
            self.rank,
            pull.local_block_ids,
            pull.num_tokens,
            pull.start_token,
        ):
            for local, local_idx, remote, remote_idx in self._reads(
                pull,
                cl,
                sib.agent,
                sib.regions,
                sib.unit,
                functools.partial(self._sibling_dlist, sib),
            ):
                try:
                    xfer, _ = self.transport.read(local, local_idx, remote, remote_idx, b"")
                except TransferError as exc:
                    raise TransferError(
                        f"READ from decode worker {sib.rank}'s cache on this host failed: {exc}"
                    ) from None
                pull.xfers[max(pull.xfers, default=-1) + 1] = (LOCAL, xfer)
            pull.local_nbytes += cl.nbytes
        log.debug(
            "decode worker %d: %r copies %d bytes from decode worker %d",
            self.rank,
            pull.request_id,
            pull.local_nbytes,
            sib.rank,
        )

    def _sibling_dlist(self, sib: _Sibling, g: int) -> Any:
        """`sib`'s regions cut into g-byte units, prepared once per (sibling, g)."""
        return unit_dlist(self.transport, sib.dlists, sib.agent, sib.regions, g)

    def _take_notices(self, notifs: dict[str, list[bytes]]) -> None:
        """Keep the `LocalReady` notices of this instance's workers for the pulls they
        name; anything else is logged and dropped."""
        for sender, msgs in notifs.items():
            rank = self._sibling_ranks.get(sender)
            for raw in msgs:
                try:
                    if rank is None:
                        raise ProtocolError("not from a worker of this instance")
                    msg = decode(raw, self._sibling_key, 64 << 10)
                    if not isinstance(msg, LocalReady) or msg.rank != rank:
                        what = type(msg).__name__
                        raise ProtocolError(f"a {what} naming rank {getattr(msg, 'rank', '?')}")
                except ProtocolError as exc:
                    log.warning(
                        "decode worker %d ignored a notification from %s: %s",
                        self.rank,
                        sender,
                        exc,
                    )
                    continue
                notices = self._ready.setdefault((msg.request_id, msg.generation), [])
                if len(notices) < 4:  # in place, then confirmed or failed
                    notices.append(msg)
                while len(self._ready) > MAX_EARLY_READY:
                    self._ready.popitem(last=False)

    def _copiers(self, pull: _Pull) -> list[int]:
        """The decode workers that copy `pull`'s bytes from this one (a fan-out)."""
        plan = pull.instance.plan
        if plan is None:
            return []
        return [c.decode_rank for c in plan.local_copies if c.source_rank == self.rank]

    def _tell_copiers(self, pull: _Pull, state: TransferState, reason: str = "") -> None:
        """Tell the workers that copy `pull`'s bytes from this one (a fan-out's source)
        that they are in place (READING: copy them now), confirmed (DONE: use the copy)
        or will not come (FAILED)."""
        copiers = self._copiers(pull)
        if pull.decline is not None or not copiers:
            return
        msg = LocalReady(
            request_id=pull.request_id,
            generation=pull.generation,
            rank=self.rank,
            ok=state is not TransferState.FAILED,
            reason=reason[:4000],
            confirmed=state is TransferState.DONE,
        )
        for rank in copiers:
            try:
                self.transport.send_notif(
                    self._siblings[rank].agent, encode(msg, self._sibling_key)
                )
            except TransferError as exc:
                log.warning(
                    "decode worker %d: telling decode worker %d that %r is %s failed: %s",
                    self.rank,
                    rank,
                    pull.request_id,
                    state.value,
                    exc,
                )

    def _forget_unreachable(self) -> None:
        """Forget idle producers whose side channel is down (`forget_unreachable`), and
        those that left a pull's READs unconfirmed until its timeout: a producer that
        evicted our session ignores our ReadDones (it cannot tell us: their signature
        names a session it no longer has), so every later pull would time out the same
        way; the next pull or introduction handshakes afresh instead."""
        in_use = [p.instance for p in self._pulls.values()] + list(self._connecting.values())
        in_use += [inst for _, _, inst in self._warming]  # its lists are in use
        self.directory.forget_unreachable(in_use)
        for endpoint, (inst, reason) in list(self._remeet.items()):
            if any(i is inst for i in in_use):
                continue
            del self._remeet[endpoint]
            if self.directory.find(endpoint) is inst:
                self.directory.forget(inst, f"{reason}; meeting it afresh")

    def _abandon_lost(self) -> None:
        """Fail the pulls reading from a producer worker whose side channel is down (its
        heartbeats went unanswered for `liveness_timeout_s`: its host or the link is down,
        or it died), then forget those workers: their UCX endpoints and connections may
        be stale (a TCP connection backing off after an outage), so the next pull
        handshakes afresh instead of stalling on them. Every such pull is finished before
        any worker is dropped (dropping releases descriptor lists its READs use)."""
        lost: dict[str, tuple[ProducerWorker, str]] = {}
        for pull in list(self._pulls.values()):
            if pull.outcome is not None:
                continue  # ended already; its READs are being released
            reading = {p for p, _ in pull.xfers.values() if p != LOCAL} | pull.awaiting
            gone = [
                (p, pull.instance.readers[p])
                for p in sorted(reading)
                if not pull.instance.readers[p].client.is_connected
            ]
            if gone:
                p, peer = gone[0]
                reason = (
                    f"lost contact with prefill worker {p} ({peer.endpoint}): its side "
                    "channel was closed or answered no heartbeat for "
                    f"{self.config.liveness_timeout_s:g} s (liveness_timeout_s); its host "
                    "or the link is down, or it died"
                )
                lost.update((w.endpoint, (w, reason)) for _, w in gone)
                self._finish(pull, TransferState.FAILED, reason)
        for peer, reason in lost.values():
            if peer.state is not PeerState.FAILED:
                self.directory.drop(peer, reason, quiet=True)

    def _timeout_reason(self, pull: _Pull) -> str:
        t = f"timed out after {self.config.transfer_timeout_s:g} s"
        if pull.awaiting_acks:
            return (
                f"{t} waiting for prefill workers {sorted(pull.awaiting)} to confirm they held "
                f"{pull.request_id!r} for the whole read (ReadAck)"
            )
        if pull.source is not None and not pull.local_posted:
            return (
                f"{t} waiting for decode worker {pull.source}, which reads these bytes over "
                "the link for this worker, to have them (LocalReady)"
            )
        if pull.source is not None and pull.xfers:
            return f"{t} copying from decode worker {pull.source}'s cache on this host"
        if pull.source is not None:
            return (
                f"{t} waiting for the producers to confirm the bytes decode worker "
                f"{pull.source} read for this worker"
            )
        if pull.state is TransferState.READING:
            return f"{t} reading from prefill workers {sorted({p for p, _ in pull.xfers.values()})}"
        waiting = [w.endpoint for w in pull.instance.workers() if w.state is not PeerState.READY]
        return f"{t} waiting for handshakes with {sorted(set(waiting))}"

    def _prepare(self, inst: ProducerInstance) -> None:
        """Prepare, once per instance, the descriptor lists a whole-block request needs
        (probe: scattered odd block ids on both sides, so no run merges across blocks),
        and remember their unit per prefill rank. Copies finer than that unit (those of a
        partial last block) get per-request descriptors instead: a list of whole regions
        cut that fine would hold ~a descriptor per token and head, and take seconds."""
        assert inst.plan is not None
        inst.prepared = True
        bp, bd = inst.plan.prefill.block_size, inst.plan.decode.block_size
        tokens = math.lcm(bp, bd)
        p_ids = 1 + 2 * np.arange(tokens // bp)
        d_ids = 1 + 2 * np.arange(tokens // bd)
        if d_ids[-1] >= self.num_blocks:
            return
        for cl in copy_lists(inst.plan, self.rank, p_ids, d_ids, tokens):
            peer = inst.readers[cl.read.prefill_rank]
            assert peer.regions is not None and peer.welcome is not None
            if p_ids[-1] >= peer.welcome.num_blocks:
                continue
            g = unit_size(cl, peer.regions.lengths, self.regions.lengths)
            if max(num_units(peer.regions, g), num_units(self.regions, g)) <= self.config.max_units:
                self._local_dlist(g)
                self.directory.remote_dlist(peer, g)
                inst.block_units[cl.read.prefill_rank] = g
        for lc in local_copy_lists(inst.plan, self.rank, d_ids, tokens):
            sib = self._siblings[lc.read.source_rank]
            g = unit_size(lc, sib.regions.lengths, self.regions.lengths)
            if sib.unit is None and num_units(self.regions, g) <= self.config.max_units:
                self._local_dlist(g)
                self._sibling_dlist(sib, g)
                sib.unit = g

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
                remote = self.directory.remote_dlist(peer, g)
                xfer, _ = self.transport.read(local, idx, remote, idx, meet)
            except TransferError as exc:
                log.info(
                    "decode worker %d: warm-up READ from %s: %s", self.rank, peer.endpoint, exc
                )
                continue
            self._warming.append((xfer, now + self.config.handshake_timeout_s, inst))

    def _ended_warm_up(self, xfer: Any, give_up_at: float, now: float) -> bool:
        """Whether a warm-up READ is over and released (a stuck one is given up on at
        `give_up_at`; one NIXL cannot cancel is retried after `RELEASE_RETRY_S`)."""
        if self.transport.state(xfer) is XferState.PROC and now < give_up_at:
            return False
        if self.transport.release(xfer):
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

    def _post(self, pull: _Pull) -> None:
        inst = pull.instance
        assert inst.plan is not None
        lists = copy_lists(
            inst.plan,
            self.rank,
            pull.producer_block_ids,
            pull.local_block_ids,
            pull.num_tokens,
            pull.start_token,
        )
        nbytes = ndesc = nunmerged = nidx = 0
        pull.state = TransferState.READING
        posts: list[tuple[int, ProducerWorker, tuple[Any, np.ndarray, Any, np.ndarray]]] = []
        for cl in lists:
            p = cl.read.prefill_rank
            pull.copies.setdefault(p, []).append(cl)
            peer = inst.readers[p]
            assert peer.welcome is not None and peer.regions is not None
            if (
                len(pull.producer_block_ids)
                and pull.producer_block_ids.max() >= peer.welcome.num_blocks
            ):
                raise TransferError(
                    f"producer block id {int(pull.producer_block_ids.max())} of "
                    f"{pull.request_id!r} is outside prefill worker {p}'s "
                    f"{peer.welcome.num_blocks} blocks"
                )
            if cl.nbytes == 0:  # nothing to read, but the producer still waits for us
                self.transport.send_notif(peer.agent, self._done(pull, peer))
                pull.notified.add(p)
                continue
            assert peer.regions is not None
            reads = self._reads(
                pull,
                cl,
                peer.agent,
                peer.regions,
                inst.block_units.get(p),
                functools.partial(self.directory.remote_dlist, peer),
            )
            posts += [(p, peer, r) for r in reads]
            nbytes += cl.nbytes
            ndesc += cl.num_descriptors
            nunmerged += cl.num_unmerged
        # A prefill worker read by one READ gets the notification with it; one read by
        # several (whole blocks + a partial last block) gets it after the last completes.
        reads_of = Counter(p for p, _, _ in posts)
        pull.silent = {p for p, n in reads_of.items() if n > 1}
        pull.awaiting = set(reads_of)
        for p, peer, (local, local_idx, remote, remote_idx) in posts:
            try:
                notif = b"" if p in pull.silent else self._done(pull, peer)
                xfer, _ = self.transport.read(local, local_idx, remote, remote_idx, notif)
            except TransferError as exc:
                reason = (
                    f"READ from prefill worker {p} ({peer.endpoint}) failed: {exc}; "
                    "the producer worker may have died"
                )
                self.directory.drop(peer, reason)
                raise TransferError(reason) from None
            pull.xfers[len(pull.xfers)] = (p, xfer)
            nidx += len(local_idx)
        for p, peer in inst.unread.items():
            self._notify(pull, p, peer, self._done(pull, peer))
        pull.stats = (nbytes, ndesc, nunmerged, nidx)
        copies = inst.plan.local_copies_for(self.rank)
        if copies:  # a fan-out's copy: from the source's cache once it has the bytes
            pull.source = copies[0].source_rank
        log.debug(
            "decode worker %d: %r posted %d READs of %d bytes from prefill workers %s",
            self.rank,
            pull.request_id,
            len(pull.xfers),
            nbytes,
            sorted(pull.awaiting),
        )

    def _reads(
        self,
        pull: _Pull,
        cl: CopyList,
        agent: str,
        regions: CacheRegions,
        unit: int | None,
        remote_dlist: Callable[[int], Any],
    ) -> list[tuple[Any, np.ndarray, Any, np.ndarray]]:
        """(local list, local indices, remote list, remote indices) of each READ for `cl`
        from `agent`'s `regions`: copies that are whole `unit`s index the prepared lists
        (`remote_dlist(unit)`); the rest (a partial last block) get this request's own
        descriptors, prepared now and released with it."""
        out = []
        whole = np.zeros(len(cl.lengths), dtype=bool)
        if unit is not None:
            whole = (cl.lengths % unit == 0) & (cl.src_offsets % unit == 0)
            whole &= cl.dst_offsets % unit == 0
            if whole.any():
                remote_idx, local_idx = unit_indices(cl.select(whole), unit, regions, self.regions)
                local, remote = self._local_dlist(unit), remote_dlist(unit)
                out.append((local, local_idx, remote, remote_idx))
        if not whole.all():
            rdescs, ldescs = exact_descs(cl.select(~whole), regions, self.regions)
            local = self.transport.prep_local(ldescs)
            pull.temp_dlists.append(local)  # released with the request, even if the next fails
            remote = self.transport.prep_remote(agent, rdescs, regions.mem_type)
            pull.temp_dlists.append(remote)
            idx = np.arange(len(ldescs), dtype=np.int32)
            out.append((local, idx, remote, idx))
        return out

    def _notify(self, pull: _Pull, p: int, peer: ProducerWorker, msg: bytes) -> None:
        """Send a standalone notification; a dead peer is dropped, not fatal here."""
        try:
            self.transport.send_notif(peer.agent, msg)
            pull.notified.add(p)
        except TransferError as exc:
            log.warning(
                "decode worker %d: notifying prefill worker %d of %r failed: %s",
                self.rank,
                p,
                pull.request_id,
                exc,
            )

    def _tell_gave_up(self, pull: _Pull, reason: str) -> None:
        """Tell the producer workers still waiting for `pull` (none of whose READs can
        land any more) that we will not read, so they release now; those we cannot reach
        now (their side channel or handshake is down) are owed the notice, paid once we
        meet the same producer instance again (`OwedNotices`)."""
        inst = pull.instance
        for p, peer in (*inst.readers.items(), *inst.unread.items()):
            if p in pull.notified:
                continue
            if peer.state is PeerState.READY and peer.client.is_connected:
                self._notify(pull, p, peer, self._done(pull, peer, reason))
            elif peer.welcome is not None:  # met: we know which instance waits
                self.owed.owe(inst.endpoint, peer.welcome.instance_id, pull.request_id, p, reason)

    def _send_owed(self, peer: ProducerWorker, request_id: str, reason: str) -> bool:
        """Send a failure notice owed to `peer` (met again: its new session signs it);
        whether it went out."""
        try:
            self.transport.send_notif(peer.agent, self._read_done(request_id, peer, reason))
        except TransferError as exc:
            log.warning(
                "decode worker %d: the failure notice of %r owed to %s could not be sent "
                "(%s); it releases at its lease",
                self.rank,
                request_id,
                peer.endpoint,
                exc,
            )
            return False
        log.info(
            "decode worker %d: told %s, met again, that the pull of %r failed",
            self.rank,
            peer.endpoint,
            request_id,
        )
        return True

    def _done(self, pull: _Pull, peer: ProducerWorker, failure: str | None = None) -> bytes:
        """Our signed ReadDone of `pull` for `peer`."""
        return self._read_done(
            pull.request_id, peer, failure, pull.generation, pull.start_token, pull.checked
        )

    def _read_done(
        self,
        request_id: str,
        peer: ProducerWorker,
        failure: str | None,
        generation: int = 0,
        start_token: int = 0,
        checked: bool = False,
    ) -> bytes:
        """Our signed ReadDone for `peer` (its session's key; names it as receiver; sent
        now, so within the producer's lease)."""
        assert peer.welcome is not None
        return peer.sign(
            ReadDone(
                request_id=request_id,
                instance_id=self.instance_id,
                rank=self.rank,
                to_instance=peer.welcome.instance_id,
                to_rank=peer.welcome.rank,
                sent_at=time.time(),
                ok=failure is None,
                reason=(failure or "")[:4000],
                generation=generation,
                start_token=start_token,
                digest=checked,
            )
        )

    def _local_dlist(self, g: int) -> Any:
        if g not in self._local_dlists:
            self._local_dlists[g] = self.transport.prep_local(unit_descs(self.regions, g))
        return self._local_dlists[g]

    def _finish(
        self,
        pull: _Pull,
        state: TransferState,
        reason: str,
        *,
        final: bool = False,
        failure: PullFailure | None = None,
    ) -> None:
        """End `pull` with `state`. A READ NIXL cannot cancel may still write into the
        pull's blocks (a late completion after a link heals), so while one is left the
        pull stays held, its blocks with it, and is retried every `RELEASE_RETRY_S`: its
        outcome is reported, and its blocks handed back, once no READ of it can land
        (`final`, at close: reported anyway, the cache goes with the agent)."""
        first = pull.outcome is None
        state, reason, failure = pull.outcome = pull.outcome or (state, reason, failure)
        if first:
            self._tell_copiers(pull, state, reason)
            self._ready.pop((pull.request_id, pull.generation), None)
        pull.xfers = {i: px for i, px in pull.xfers.items() if not self.transport.release(px[1])}
        if pull.xfers and not final:
            pull.retry_at = self._clock() + RELEASE_RETRY_S
            if first:
                log.warning(
                    "decode worker %d: pull of %r ended (%s) but NIXL could not cancel %d "
                    "of its READs; its %d blocks stay held until it can",
                    self.rank,
                    pull.request_id,
                    reason or state.value,
                    len(pull.xfers),
                    len(pull.local_block_ids),
                )
            return
        cancelled = not pull.xfers
        pull.xfers.clear()
        if state is TransferState.FAILED and cancelled:
            self._tell_gave_up(pull, reason)
        if cancelled:
            for handle in pull.temp_dlists:
                self.transport.release_dlist(handle)
        elif pull.temp_dlists:  # a READ NIXL could not cancel may still use them
            self._orphan_dlists += pull.temp_dlists
            log.warning(
                "decode worker %d: keeping %d descriptor lists of %r until close: NIXL "
                "could not cancel its READ before the consumer closed",
                self.rank,
                len(pull.temp_dlists),
                pull.request_id,
            )
        if state is TransferState.FAILED and pull.decline is None:
            log.warning(
                "decode worker %d: pull of %r failed: %s", self.rank, pull.request_id, reason
            )
        del self._pulls[pull.request_id]
        if pull.decline is not None:
            return  # nobody waits for a decline's outcome
        nbytes, ndesc, nunmerged, nidx = pull.stats
        self._results.append(
            TransferResult(
                pull.request_id,
                state,
                reason,
                tuple(int(b) for b in pull.local_block_ids),
                nbytes,
                ndesc,
                nunmerged,
                nidx,
                failure,
                pull.local_nbytes,
            )
        )
