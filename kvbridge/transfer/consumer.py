"""The consumer side: a decode worker pulls a request's KV from the producer's workers.

Lifecycle (mirrors vLLM's KV-connector): `pull` records the request and returns at
once; the owner calls `poll()` from its loop, which reports each pulled request
exactly once as DONE or FAILED (with the reason and the local block ids, handed
back either way). Under the hood, per producer instance (keyed by its worker-0
endpoint) the consumer handshakes with worker 0 (learning the instance's geometry
and every worker's endpoint), validates the pair with the planner, handshakes with
each worker it reads from, and caches all of it. Per request it posts one NIXL READ
per producer worker, built from the planner's copy lists; each READ carries the
`ReadDone` notification to its producer worker.

Bounded failure: a refused or unanswered handshake, a NIXL ERR state or a request
running past `transfer_timeout_s` fails the request with its reason; a failed
producer connection is dropped from the cache so the next pull reconnects.
Single-threaded: `pull`, `poll` and `close` from one thread.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.errors import KVBridgeError
from kvbridge.plan.copylist import copy_lists, region_nbytes
from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.plan.layout import InstanceLayout, num_regions
from kvbridge.plan.planner import TransferPlan, make_plan
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
from kvbridge.transfer.messages import (
    Hello,
    LayoutWire,
    ModelWire,
    ReadDone,
    Refused,
    Welcome,
    encode,
    spec_error,
)
from kvbridge.transfer.regions import CacheRegions, MemType
from kvbridge.transfer.side_channel import SideChannelClient

log = logging.getLogger("kvbridge.transfer.consumer")


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


class _PeerState(enum.Enum):
    CONNECTING = "connecting"
    READY = "ready"
    FAILED = "failed"


@dataclass
class _Peer:
    """One producer worker, as this consumer knows it."""

    endpoint: str
    client: SideChannelClient
    deadline: float
    state: _PeerState = _PeerState.CONNECTING
    welcome: Welcome | None = None
    agent: str = ""
    regions: CacheRegions | None = None
    reason: str = ""
    remote_dlists: dict[int, Any] = field(default_factory=dict)


@dataclass
class _Instance:
    """A producer instance, keyed by its worker-0 endpoint."""

    endpoint: str
    worker0: _Peer
    plan: TransferPlan | None = None
    peers: dict[int, _Peer] = field(default_factory=dict)  # prefill rank -> peer
    unread: dict[int, _Peer] = field(default_factory=dict)  # rank 0 only: workers nobody reads
    reason: str = ""


@dataclass
class _Pull:
    request_id: str
    instance: _Instance
    producer_block_ids: np.ndarray
    local_block_ids: np.ndarray
    num_tokens: int
    deadline: float
    state: TransferState = TransferState.HANDSHAKING
    xfers: dict[int, tuple[int, Any]] = field(default_factory=dict)  # i -> (prefill rank, READ)
    temp_dlists: list[Any] = field(default_factory=list)
    notified: set[int] = field(default_factory=set)  # prefill ranks told we are done
    stats: tuple[int, int, int, int] = (0, 0, 0, 0)


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
    ) -> None:
        self.model, self.layout, self.rank = model, layout, rank
        self.shard = layout.workers(model, "decode")[rank]
        want_n = num_regions(model, self.shard)
        want_len = region_nbytes(
            model.with_dtype(layout.kv_dtype(model)), layout, self.shard, num_blocks
        )
        if regions.num_regions != want_n or set(regions.lengths) != {want_len}:
            raise TransferError(
                f"decode worker {rank} registered {regions.num_regions} regions of "
                f"{sorted(set(regions.lengths))} bytes; its layout needs {want_n} regions of "
                f"{want_len} bytes ({num_blocks} blocks)"
            )
        self.regions, self.num_blocks = regions, num_blocks
        self.transport, self.config, self.instance_id = transport, config, instance_id
        self._clock = clock
        self._peers: dict[str, _Peer] = {}
        self._instances: dict[str, _Instance] = {}
        self._pulls: dict[str, _Pull] = {}
        self._local_dlists: dict[int, Any] = {}
        self._results: list[TransferResult] = []
        self._hello = Hello(
            instance_id=instance_id,
            rank=rank,
            model=ModelWire.of(model),
            layout=LayoutWire.of(layout),
        )

    # -- engine-facing API -------------------------------------------------------------
    def pull(
        self,
        request_id: str,
        endpoint: str,
        producer_block_ids: Sequence[int] | np.ndarray,
        local_block_ids: Sequence[int] | np.ndarray,
        num_tokens: int,
    ) -> None:
        """Start loading `request_id`'s `num_tokens` tokens from the producer instance at
        `endpoint` (its worker 0's side channel) into `local_block_ids`; returns at once."""
        if request_id in self._pulls:
            raise TransferError(f"request_id={request_id!r} is already being pulled")
        local = np.asarray(local_block_ids, dtype=np.int64).ravel()
        remote = np.asarray(producer_block_ids, dtype=np.int64).ravel()
        if len(local) and (local.min() < 0 or local.max() >= self.num_blocks):
            raise TransferError(
                f"local_block_ids of {request_id!r} must lie in "
                f"[0, {self.num_blocks}); got {local.tolist()[:8]}"
            )
        if not 0 <= num_tokens <= len(local) * self.layout.block_size:
            raise TransferError(
                f"num_tokens={num_tokens} of {request_id!r} does not fit "
                f"{len(local)} local blocks of {self.layout.block_size} tokens"
            )
        inst = self._instance(endpoint)
        self._pulls[request_id] = _Pull(
            request_id,
            inst,
            remote,
            local,
            num_tokens,
            self._clock() + self.config.transfer_timeout_s,
        )

    def poll(self) -> list[TransferResult]:
        """Advance every handshake and pull; returns the requests that finished since."""
        now = self._clock()
        for peer in list(self._peers.values()):
            if peer.state is _PeerState.CONNECTING:
                self._advance_peer(peer, now)
        for inst in list(self._instances.values()):
            if inst.plan is None and inst.worker0.state is _PeerState.READY and not inst.reason:
                self._plan_instance(inst)
        for pull in list(self._pulls.values()):
            self._advance_pull(pull, now)
        # Without NIXL's progress thread, our standalone notifications (to replicas
        # nobody reads, failure notices) leave only while our agent is progressed.
        for sender, msgs in self.transport.notifs().items():
            log.debug(
                "decode worker %d ignored %d notifications from %s", self.rank, len(msgs), sender
            )
        out, self._results = self._results, []
        return out

    @property
    def num_held_blocks(self) -> int:
        """Local blocks of requests not yet reported (the rest were handed back)."""
        return sum(len(p.local_block_ids) for p in self._pulls.values())

    def close(self) -> list[TransferResult]:
        """Fail what is in flight ("consumer closed"), drop peers; returns those results."""
        for pull in list(self._pulls.values()):
            self._finish(pull, TransferState.FAILED, "consumer closed")
        for peer in list(self._peers.values()):
            self._drop_peer(peer, "consumer closed")
        for handle in self._local_dlists.values():
            self.transport.release_dlist(handle)
        self._local_dlists.clear()
        out, self._results = self._results, []
        return out

    # -- handshakes --------------------------------------------------------------------
    def _peer(self, endpoint: str) -> _Peer:
        peer = self._peers.get(endpoint)
        if peer is None:
            client = SideChannelClient(endpoint, self.config.token, self.config.max_message_bytes)
            peer = _Peer(endpoint, client, self._clock() + self.config.handshake_timeout_s)
            client.send(self._hello)
            self._peers[endpoint] = peer
        return peer

    def _instance(self, endpoint: str) -> _Instance:
        inst = self._instances.get(endpoint)
        if inst is None:
            inst = _Instance(endpoint, self._peer(endpoint))
            self._instances[endpoint] = inst
        return inst

    def _advance_peer(self, peer: _Peer, now: float) -> None:
        try:
            reply = peer.client.try_recv()
        except ProtocolError as exc:
            self._drop_peer(peer, f"bad handshake reply from {peer.endpoint}: {exc}")
            return
        if reply is None:
            if now >= peer.deadline:
                self._drop_peer(
                    peer,
                    f"handshake with {peer.endpoint} timed out after "
                    f"{self.config.handshake_timeout_s:g} s; is the producer "
                    "worker running?",
                )
            return
        if isinstance(reply, Refused):
            self._drop_peer(peer, f"producer {peer.endpoint} refused the handshake: {reply.reason}")
        elif isinstance(reply, Welcome):
            try:
                self._accept(peer, reply)
            except KVBridgeError as exc:
                self._drop_peer(peer, f"handshake with {peer.endpoint} failed: {spec_error(exc)}")
        else:
            self._drop_peer(
                peer, f"{peer.endpoint} answered a handshake with {type(reply).__name__}"
            )

    def _accept(self, peer: _Peer, w: Welcome) -> None:
        model, layout = w.model.to_spec(), w.layout.to_layout()
        workers = layout.workers(model, "prefill")
        if w.rank >= len(workers):
            raise ProtocolError(f"rank={w.rank} outside its instance of {len(workers)} workers")
        shard = workers[w.rank]
        want_n = num_regions(model, shard)
        want_len = region_nbytes(
            model.with_dtype(layout.kv_dtype(model)), layout, shard, w.num_blocks
        )
        if len(w.regions) != want_n or any(n != want_len for _, n in w.regions):
            raise ProtocolError(
                f"worker {w.rank} offers {len(w.regions)} regions; its geometry "
                f"needs {want_n} of {want_len} bytes"
            )
        if w.mem_type not in {m.value for m in MemType}:
            raise ProtocolError(f"mem_type={w.mem_type!r}; use DRAM or VRAM")
        if len(w.worker_endpoints) != layout.world_size:
            raise ProtocolError(
                f"{len(w.worker_endpoints)} worker endpoints for an instance "
                f"of {layout.world_size} workers"
            )
        agent = self.transport.add_peer(w.agent_metadata)
        if agent != w.agent_name:
            raise ProtocolError(f"agent metadata names {agent!r}, the handshake {w.agent_name!r}")
        peer.welcome, peer.agent = w, agent
        peer.regions = CacheRegions(
            tuple(a for a, _ in w.regions),
            tuple(n for _, n in w.regions),
            MemType(w.mem_type),
            w.device_id,
        )
        peer.state = _PeerState.READY

    def _plan_instance(self, inst: _Instance) -> None:
        w = inst.worker0.welcome
        assert w is not None
        try:
            inst.plan = make_plan(w.model.to_spec(), w.layout.to_layout(), self.layout, self.model)
        except KVBridgeError as exc:
            self._fail_instance(inst, spec_error(exc))
            return
        for read in inst.plan.reads_for(self.rank):
            p = read.prefill_rank
            inst.peers[p] = inst.worker0 if p == w.rank else self._peer(w.worker_endpoints[p])
        if self.rank == 0:  # replicas nobody reads still wait for a notification: ours
            for p, n in enumerate(inst.plan.expected_notifications):
                if n == 0:
                    peer = inst.worker0 if p == w.rank else self._peer(w.worker_endpoints[p])
                    inst.unread[p] = peer

    def _drop_peer(self, peer: _Peer, reason: str) -> None:
        """Forget a producer worker (a later pull reconnects) and fail what depends on it."""
        if peer.state is not _PeerState.FAILED and reason != "consumer closed":
            log.warning("decode worker %d: %s", self.rank, reason)
        peer.state, peer.reason = _PeerState.FAILED, reason
        if self._peers.get(peer.endpoint) is peer:
            del self._peers[peer.endpoint]
        peer.client.close()
        for handle in peer.remote_dlists.values():
            self.transport.release_dlist(handle)
        peer.remote_dlists.clear()
        if peer.agent:
            self.transport.remove_peer(peer.agent)
        for inst in list(self._instances.values()):
            peers = (*inst.peers.values(), *inst.unread.values())
            if inst.worker0 is peer or any(q is peer for q in peers):
                self._fail_instance(inst, reason)

    def _fail_instance(self, inst: _Instance, reason: str) -> None:
        inst.reason = inst.reason or reason
        if self._instances.get(inst.endpoint) is inst:
            del self._instances[inst.endpoint]

    # -- requests ----------------------------------------------------------------------
    def _advance_pull(self, pull: _Pull, now: float) -> None:
        inst = pull.instance
        if pull.state is TransferState.HANDSHAKING:
            if inst.reason:
                self._finish(pull, TransferState.FAILED, inst.reason)
                return
            if inst.plan is not None and all(
                p.state is _PeerState.READY for p in (*inst.peers.values(), *inst.unread.values())
            ):
                try:
                    self._post(pull)
                except KVBridgeError as exc:
                    self._finish(pull, TransferState.FAILED, spec_error(exc))
                    return
        if pull.state is TransferState.READING:
            for i, (p, xfer) in list(pull.xfers.items()):
                st = self.transport.state(xfer)
                if st is XferState.DONE:  # NIXL delivered the READ's notification
                    self.transport.release(xfer)
                    del pull.xfers[i]
                    pull.notified.add(p)
                elif st is XferState.ERR:
                    peer = inst.peers[p]
                    reason = (
                        f"NIXL READ from prefill worker {p} ({peer.endpoint}, agent "
                        f"{peer.agent!r}) ended in ERR state; the producer worker may have died"
                    )
                    self._finish(pull, TransferState.FAILED, reason)
                    self._drop_peer(peer, reason)
                    return
            if not pull.xfers:
                self._finish(pull, TransferState.DONE, "")
                return
        if now >= pull.deadline:
            self._finish(pull, TransferState.FAILED, self._timeout_reason(pull))

    def _timeout_reason(self, pull: _Pull) -> str:
        t = f"timed out after {self.config.transfer_timeout_s:g} s"
        if pull.state is TransferState.READING:
            return f"{t} reading from prefill workers {sorted({p for p, _ in pull.xfers.values()})}"
        inst = pull.instance
        waiting = [
            p.endpoint
            for p in (inst.worker0, *inst.peers.values(), *inst.unread.values())
            if p.state is not _PeerState.READY
        ]
        return f"{t} waiting for handshakes with {sorted(set(waiting))}"

    def _post(self, pull: _Pull) -> None:
        inst = pull.instance
        assert inst.plan is not None
        lists = copy_lists(
            inst.plan, self.rank, pull.producer_block_ids, pull.local_block_ids, pull.num_tokens
        )
        notif = encode(
            ReadDone(request_id=pull.request_id, instance_id=self.instance_id, rank=self.rank),
            self.config.token,
        )
        nbytes = ndesc = nunmerged = nidx = 0
        pull.state = TransferState.READING
        for i, cl in enumerate(lists):
            p = cl.read.prefill_rank
            peer = inst.peers[p]
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
                self.transport.send_notif(peer.agent, notif)
                pull.notified.add(p)
                continue
            g = unit_size(cl, peer.regions.lengths, self.regions.lengths)
            limit = self.config.max_units
            if max(num_units(peer.regions, g), num_units(self.regions, g)) <= limit:
                local = self._local_dlist(g)
                remote = self._remote_dlist(peer, g)
                remote_idx, local_idx = unit_indices(cl, g, peer.regions, self.regions)
            else:  # too fine to prepare whole regions: this request's own descriptors
                rdescs, ldescs = exact_descs(cl, peer.regions, self.regions)
                local = self.transport.prep_local(ldescs)
                remote = self.transport.prep_remote(peer.agent, rdescs)
                pull.temp_dlists += [local, remote]
                local_idx = remote_idx = np.arange(len(ldescs), dtype=np.int32)
            try:
                xfer, _ = self.transport.read(local, local_idx, remote, remote_idx, notif)
            except TransferError as exc:
                reason = (
                    f"READ from prefill worker {p} ({peer.endpoint}) failed: {exc}; "
                    "the producer worker may have died"
                )
                self._drop_peer(peer, reason)
                raise TransferError(reason) from None
            pull.xfers[i] = (p, xfer)
            nbytes += cl.nbytes
            ndesc += cl.num_descriptors
            nunmerged += cl.num_unmerged
            nidx += len(local_idx)
        for p, peer in inst.unread.items():
            self._notify(pull, p, peer, notif)
        pull.stats = (nbytes, ndesc, nunmerged, nidx)

    def _notify(self, pull: _Pull, p: int, peer: _Peer, msg: bytes) -> None:
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

    def _local_dlist(self, g: int) -> Any:
        if g not in self._local_dlists:
            self._local_dlists[g] = self.transport.prep_local(unit_descs(self.regions, g))
        return self._local_dlists[g]

    def _remote_dlist(self, peer: _Peer, g: int) -> Any:
        assert peer.regions is not None
        if g not in peer.remote_dlists:
            peer.remote_dlists[g] = self.transport.prep_remote(
                peer.agent, unit_descs(peer.regions, g)
            )
        return peer.remote_dlists[g]

    def _finish(self, pull: _Pull, state: TransferState, reason: str) -> None:
        cancelled = all([self.transport.release(x) for _, x in pull.xfers.values()])
        pull.xfers.clear()
        if state is TransferState.FAILED and cancelled:
            # producer workers still waiting for us may release now: we will not read
            msg = encode(
                ReadDone(
                    request_id=pull.request_id,
                    instance_id=self.instance_id,
                    rank=self.rank,
                    ok=False,
                    reason=reason[:4000],
                ),
                self.config.token,
            )
            inst = pull.instance
            for p, peer in (*inst.peers.items(), *inst.unread.items()):
                if p not in pull.notified and peer.state is _PeerState.READY:
                    self._notify(pull, p, peer, msg)
        for handle in pull.temp_dlists:
            self.transport.release_dlist(handle)
        if state is TransferState.FAILED:
            log.warning(
                "decode worker %d: pull of %r failed: %s", self.rank, pull.request_id, reason
            )
        del self._pulls[pull.request_id]
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
            )
        )
