"""A consumer's directory of producer instances: handshakes, validation, caching.

Per producer instance (keyed by its worker-0 side-channel endpoint) the directory
handshakes with worker 0 (learning the instance's geometry and every worker's
endpoint), plans the pair with the planner (an incompatible pair fails here with the
planner's error), then handshakes with each producer worker this decode worker reads
from -- and, on decode worker 0, with the workers nobody reads (they still wait for a
notification). Everything is cached until a peer fails; a failed peer is forgotten,
so the next pull reconnects. Handshakes never block: `poll` advances them, and each
has a deadline (`handshake_timeout_s`); a Hello refused "busy" (no room in the
producer's session table) is sent again, backing off, until then. Single-threaded, owned
by one `KVConsumer`.
"""

from __future__ import annotations

import collections
import enum
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvbridge.errors import KVBridgeError
from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.plan.layout import InstanceLayout, num_regions, region_nbytes
from kvbridge.plan.planner import TransferPlan, make_plan
from kvbridge.transfer.agent import Transport
from kvbridge.transfer.auth import session_id, session_key
from kvbridge.transfer.config import TransferConfig
from kvbridge.transfer.credential import signed_by_prefill
from kvbridge.transfer.descriptors import unit_descs
from kvbridge.transfer.errors import AuthError, ProtocolError
from kvbridge.transfer.identity import Identity
from kvbridge.transfer.messages import (
    Hello,
    Meet,
    ReadAck,
    ReadDone,
    Refused,
    Welcome,
    encode,
    spec_error,
    welcome_body,
)
from kvbridge.transfer.regions import CacheRegions, MemType
from kvbridge.transfer.side_channel import SideChannelClient

log = logging.getLogger("kvbridge.transfer.consumer")

#: ReadAcks kept per producer worker until their pull takes them (the oldest go first).
MAX_ACKS = 4096
#: A Hello refused "busy" is sent again (fresh nonce) after this long, doubling up to
#: `BUSY_RETRY_MAX_S`, until the handshake's deadline: room opens as sessions age, and
#: a prefill worker may learn of the request that names this instance (its `expose`)
#: just after the capability reached us, which gives it reserved room (sessions.py)
BUSY_RETRY_S = 0.02
BUSY_RETRY_MAX_S = 1.0


def unit_dlist(
    transport: Transport, cache: dict[int, Any], agent: str, regions: CacheRegions, g: int
) -> Any:
    """Peer `agent`'s `regions` cut into g-byte units as a prepared remote list, made once
    per unit size and kept in `cache` (the caller releases them when it drops the peer)."""
    if g not in cache:
        cache[g] = transport.prep_remote(agent, unit_descs(regions, g), regions.mem_type)
    return cache[g]


class PeerState(enum.Enum):
    CONNECTING = "connecting"
    READY = "ready"
    FAILED = "failed"


@dataclass
class ProducerWorker:
    """One producer worker as a consumer knows it (valid once READY)."""

    endpoint: str
    client: SideChannelClient
    deadline: float
    state: PeerState = PeerState.CONNECTING
    welcome: Welcome | None = None
    agent: str = ""
    regions: CacheRegions | None = None
    reason: str = ""
    remote_dlists: dict[int, Any] = field(default_factory=dict)  # unit size -> prepared list
    hello_nonce: bytes = b""  # our Hello's; the Welcome must echo it
    hello: Hello | None = None  # the Hello sent (sent again, with a fresh nonce, if busy)
    retry_at: float | None = None  # refused "busy": when to send the Hello again
    num_busy: int = 0  # "busy" refusals so far
    busy_reason: str = ""  # the last one's reason
    #: a READ from this worker completed (a warm-up's or a pull's): NIXL's and UCX's
    #: paths to it are set up, which the first READ over them pays
    warm: bool = False
    session_key: bytes = b""  # signs our notifications to this worker (auth.session_key)
    session_id: bytes = b""
    #: (request id, generation) -> the worker's answer to our ReadDone (`ReadAck`)
    acks: collections.OrderedDict[tuple[str, int], ReadAck] = field(
        default_factory=collections.OrderedDict
    )
    #: its fence words prepared for reading (`fence.py`; None: it has none)
    fence: Any = None
    #: pulls its fence word confirmed: their ReadAcks are dropped as they come
    fenced: collections.OrderedDict[tuple[str, int], None] = field(
        default_factory=collections.OrderedDict
    )

    def sign(self, msg: ReadDone | Meet) -> bytes:
        """`msg` as this session's signed notification to the worker."""
        return encode(msg, self.session_key, self.session_id)


@dataclass
class ProducerInstance:
    """A producer instance: its plan with this decode worker and the workers it needs."""

    endpoint: str
    worker0: ProducerWorker
    plan: TransferPlan | None = None
    readers: dict[int, ProducerWorker] = field(default_factory=dict)  # prefill rank we read
    unread: dict[int, ProducerWorker] = field(default_factory=dict)  # rank 0: nobody reads
    reason: str = ""  # set once failed
    #: every decode worker's host when pulls from it fan out (`Hello.decode_hosts`)
    decode_hosts: tuple[str, ...] | None = None
    prepared: bool = False  # descriptor lists of a whole-block request prepared
    block_units: dict[int, int] = field(default_factory=dict)  # prefill rank -> their unit

    def workers(self) -> list[ProducerWorker]:
        return [self.worker0, *self.readers.values(), *self.unread.values()]

    @property
    def is_ready(self) -> bool:
        return self.plan is not None and all(w.state is PeerState.READY for w in self.workers())


class ProducerDirectory:
    """Handshakes and caches producer instances for one decode worker."""

    def __init__(
        self,
        *,
        model: ModelKVSpec,
        layout: InstanceLayout,
        rank: int,
        transport: Transport,
        config: TransferConfig,
        hello: Hello,
        clock: Callable[[], float],
        identity: Identity | None = None,
        root: bytes | None = None,
        decode_hosts: Callable[[str], tuple[str, ...] | None] = lambda endpoint: None,
    ) -> None:
        self.model, self.layout, self.rank = model, layout, rank
        #: whether (with which hosts) pulls from the producer at an endpoint fan out
        self._decode_hosts = decode_hosts
        self.transport, self.config, self._hello, self._clock = transport, config, hello, clock
        self.identity = identity  # the key pair every side-channel connection presents
        #: the root whose prefill instances may answer our handshakes (None: any, open mode)
        self.root = root
        self._workers: dict[str, ProducerWorker] = {}
        self._instances: dict[str, ProducerInstance] = {}

    def instance(self, endpoint: str) -> ProducerInstance:
        """The (cached) producer instance whose worker 0 serves `endpoint`."""
        inst = self._instances.get(endpoint)
        if inst is None:
            hosts = self._decode_hosts(endpoint)
            inst = ProducerInstance(endpoint, self._worker(endpoint, hosts), decode_hosts=hosts)
            self._instances[endpoint] = inst
        return inst

    def find(self, endpoint: str) -> ProducerInstance | None:
        """The producer instance at `endpoint` if it is met or being met; starts nothing."""
        return self._instances.get(endpoint)

    def poll(self, now: float) -> None:
        """Advance every handshake in flight and plan instances whose worker 0 answered."""
        for w in list(self._workers.values()):
            if w.state is PeerState.CONNECTING:
                self._advance(w, now)
            elif w.state is PeerState.READY:
                self._take_acks(w)
        for inst in list(self._instances.values()):
            if inst.plan is None and inst.worker0.state is PeerState.READY and not inst.reason:
                self._plan(inst)

    def remote_dlist(self, w: ProducerWorker, g: int) -> Any:
        """`w`'s regions cut into g-byte units, prepared once per (worker, g)."""
        assert w.regions is not None
        return unit_dlist(self.transport, w.remote_dlists, w.agent, w.regions, g)

    def drop(self, w: ProducerWorker, reason: str, quiet: bool = False) -> None:
        """Forget a producer worker (a later pull reconnects) and fail its instances."""
        if w.state is not PeerState.FAILED and not quiet:
            log.warning("decode worker %d: %s", self.rank, reason)
        w.state, w.reason = PeerState.FAILED, reason
        if self._workers.get(w.endpoint) is w:
            del self._workers[w.endpoint]
        w.client.close()
        for handle in w.remote_dlists.values():
            self.transport.release_dlist(handle)
        w.remote_dlists.clear()
        if w.fence is not None:
            self.transport.release_dlist(w.fence)
            w.fence = None
        if w.agent:
            self.transport.remove_peer(w.agent)
        for inst in list(self._instances.values()):
            if any(q is w for q in inst.workers()):
                inst.reason = inst.reason or reason
                del self._instances[inst.endpoint]

    def forget(self, inst: ProducerInstance, reason: str) -> None:
        """Forget a producer instance and its workers (quietly; a later pull or
        introduction meets it afresh). Only when no pull reads from it."""
        log.info("decode worker %d forgets producer %s: %s", self.rank, inst.endpoint, reason)
        for w in {id(w): w for w in inst.workers()}.values():  # worker 0 may read too
            self.drop(w, reason, quiet=True)

    def forget_unreachable(self, in_use: list[ProducerInstance]) -> None:
        """Forget the producer instances met before whose worker 0's side channel is
        down now (its host or the link is down, or it is gone) and that no pull in
        `in_use` reads from: the next pull or introduction handshakes afresh instead of
        reusing UCX endpoints that may be stale, and nothing of a producer gone for good
        stays loaded."""
        for inst in list(self._instances.values()):
            if (
                inst.worker0.state is PeerState.READY
                and not any(i is inst for i in in_use)
                and inst.worker0.client.is_lost
            ):
                self.forget(inst, f"the side channel to producer {inst.endpoint} is down")

    def close(self) -> None:
        for w in list(self._workers.values()):
            self.drop(w, "consumer closed", quiet=True)

    # -- internals ---------------------------------------------------------------------
    def _worker(self, endpoint: str, decode_hosts: tuple[str, ...] | None) -> ProducerWorker:
        w = self._workers.get(endpoint)
        if w is None:
            client = SideChannelClient(
                endpoint,
                self.config.token,
                self.config.max_message_bytes,
                self.config.liveness_timeout_s,
                self.identity,
            )
            w = ProducerWorker(endpoint, client, self._clock() + self.config.handshake_timeout_s)
            hosts = list(decode_hosts) if decode_hosts is not None else None
            w.hello = msgspec.structs.replace(self._hello, decode_hosts=hosts)
            self._workers[endpoint] = w
            self._send_hello(w)
        return w

    def _send_hello(self, w: ProducerWorker) -> None:
        """Send `w` our Hello with a fresh nonce (a producer answers each nonce once)."""
        assert w.hello is not None
        w.hello_nonce, w.retry_at = os.urandom(16), None
        w.client.send(msgspec.structs.replace(w.hello, nonce=w.hello_nonce))
        log.debug("decode worker %d: Hello sent to %s", self.rank, w.endpoint)

    def _busy(self, w: ProducerWorker, reply: Refused, now: float) -> None:
        """`w` refused our Hello for want of room: ask again later, within the deadline."""
        delay = min(BUSY_RETRY_S * 2**w.num_busy, BUSY_RETRY_MAX_S)
        w.num_busy += 1
        w.busy_reason = reply.reason
        if now + delay >= w.deadline:
            self.drop(
                w,
                f"producer {w.endpoint} refused the handshake {w.num_busy} times until its "
                f"deadline ({self.config.handshake_timeout_s:g} s): {reply.reason}",
            )
            return
        log.info(
            "decode worker %d: %s refused the handshake (%s); asking again in %g s",
            self.rank,
            w.endpoint,
            reply.reason,
            delay,
        )
        w.retry_at = now + delay

    def _advance(self, w: ProducerWorker, now: float) -> None:
        if w.retry_at is not None:
            if now >= w.retry_at:
                self._send_hello(w)
            return
        try:
            reply = w.client.try_recv()
        except ProtocolError as exc:
            self.drop(w, f"bad handshake reply from {w.endpoint}: {exc}")
            return
        if reply is None:
            if w.client.is_refused:
                self.drop(
                    w,
                    f"handshake with {w.endpoint} failed: its host refused every connection "
                    f"for {self.config.liveness_timeout_s:g} s (liveness_timeout_s); is the "
                    "producer worker running?",
                )
            elif now >= w.deadline and w.num_busy:  # the cause is known: say it
                self.drop(
                    w,
                    f"producer {w.endpoint} refused the handshake {w.num_busy} times until its "
                    f"deadline ({self.config.handshake_timeout_s:g} s), the last Hello "
                    f"unanswered: {w.busy_reason}",
                )
            elif now >= w.deadline:
                self.drop(
                    w,
                    f"handshake with {w.endpoint} timed out after "
                    f"{self.config.handshake_timeout_s:g} s; is the producer worker "
                    "running, and (with a shared token) the token the same on both sides?",
                )
        elif isinstance(reply, Refused) and reply.kind == "busy":
            self._busy(w, reply, now)
        elif isinstance(reply, Refused):
            self.drop(w, f"producer {w.endpoint} refused the handshake: {reply.reason}")
        elif isinstance(reply, Welcome):
            log.debug(
                "decode worker %d: Welcome from %s, %.3f s before the handshake deadline",
                self.rank,
                w.endpoint,
                w.deadline - now,
            )
            try:
                self._accept(w, reply)
            except KVBridgeError as exc:
                self.drop(w, f"handshake with {w.endpoint} failed: {spec_error(exc)}")
        else:
            self.drop(w, f"{w.endpoint} answered a handshake with {type(reply).__name__}")

    def _take_acks(self, w: ProducerWorker) -> None:
        """Keep the ReadAcks a met worker sent (its answers to our ReadDones) for their
        pulls; anything else it sends unasked is logged and dropped."""
        while True:
            try:
                msg = w.client.try_recv()
            except ProtocolError as exc:
                log.warning("decode worker %d: bad message from %s: %s", self.rank, w.endpoint, exc)
                continue
            if msg is None:
                return
            if not isinstance(msg, ReadAck):
                log.warning(
                    "decode worker %d: %s sent an unasked %s; ignored",
                    self.rank,
                    w.endpoint,
                    type(msg).__name__,
                )
                continue
            key = (msg.request_id, msg.generation)
            if key in w.fenced:  # its fence word confirmed that pull already
                del w.fenced[key]
                continue
            # the answer to our one ReadDone of that exposure; a later one answers a
            # duplicate (never ours to believe over the first)
            w.acks.setdefault(key, msg)
            while len(w.acks) > MAX_ACKS:
                w.acks.popitem(last=False)

    def _accept(self, w: ProducerWorker, welcome: Welcome) -> None:
        """Validate a Welcome against our Hello and the geometry it claims, derive the
        session key, then load the agent."""
        if welcome.hello_nonce != w.hello_nonce:
            raise ProtocolError(
                "the Welcome does not answer our Hello (its nonce differs): a replayed or "
                "stale reply"
            )
        model, layout = welcome.model.to_spec(), welcome.layout.to_layout()
        workers = layout.workers(model, "prefill")
        if welcome.rank >= len(workers):
            raise ProtocolError(
                f"rank={welcome.rank} outside an instance of {len(workers)} workers"
            )
        shard = workers[welcome.rank]
        want_n = num_regions(model, layout, shard)
        want_len = region_nbytes(model, layout, shard, welcome.num_blocks)
        if len(welcome.regions) != want_n or any(n != want_len for _, n in welcome.regions):
            raise ProtocolError(
                f"worker {welcome.rank} offers {len(welcome.regions)} regions; "
                f"its geometry needs {want_n} of {want_len} bytes"
            )
        if welcome.mem_type not in {m.value for m in MemType}:
            raise ProtocolError(f"mem_type={welcome.mem_type!r}; use DRAM or VRAM")
        if len(welcome.worker_endpoints) != layout.world_size:
            raise ProtocolError(
                f"{len(welcome.worker_endpoints)} worker endpoints for an "
                f"instance of {layout.world_size} workers"
            )
        if self.root is not None:
            self._check_signed(w, welcome)
        agent = self.transport.add_peer(welcome.agent_metadata)
        if agent != welcome.agent_name:
            self.transport.remove_peer(agent)  # loaded above: unload before refusing
            raise ProtocolError(
                f"agent metadata names {agent!r}, the handshake {welcome.agent_name!r}"
            )
        w.welcome, w.agent = welcome, agent
        w.session_key = session_key(
            self.config.token,
            w.hello_nonce,
            welcome.nonce,
            (self._hello.instance_id, self._hello.rank),
            (welcome.instance_id, welcome.rank),
        )
        w.session_id = session_id(w.session_key)
        w.regions = CacheRegions(
            tuple(a for a, _ in welcome.regions),
            tuple(n for _, n in welcome.regions),
            MemType(welcome.mem_type),
            welcome.device_id,
        )
        w.state = PeerState.READY

    def _check_signed(self, w: ProducerWorker, welcome: Welcome) -> None:
        """Refuse a Welcome no prefill instance our root enrolled signed, or one signed
        for another instance than it names: its NIXL metadata would have us read
        someone else's memory as that instance's KV."""
        if not welcome.certificate:
            raise AuthError(
                f"prefill worker at {w.endpoint} sent no certificate: it runs without a "
                "credential, and this decode instance takes only prefill instances its "
                "root enrolled; give the prefill instance its credential"
            )
        body = welcome_body(welcome)
        cert = signed_by_prefill(welcome.certificate, welcome.signature, body, self.root, "Welcome")
        if cert.instance_id != welcome.instance_id:
            raise AuthError(
                f"the Welcome from {w.endpoint} names instance {welcome.instance_id!r} but is "
                f"signed by {cert.instance_id!r}"
            )

    def _plan(self, inst: ProducerInstance) -> None:
        w0 = inst.worker0.welcome
        assert w0 is not None
        try:
            inst.plan = make_plan(
                w0.model.to_spec(),
                w0.layout.to_layout(),
                self.layout,
                self.model,
                decode_hosts=inst.decode_hosts,
            )
        except KVBridgeError as exc:
            inst.reason = spec_error(exc)
            del self._instances[inst.endpoint]
            return

        def worker(p: int) -> ProducerWorker:
            if p == w0.rank:
                return inst.worker0
            return self._worker(w0.worker_endpoints[p], inst.decode_hosts)

        try:
            for read in inst.plan.reads_for(self.rank):
                inst.readers[read.prefill_rank] = worker(read.prefill_rank)
            if self.rank == 0:  # replicas nobody reads still wait for a notification: ours
                for p, n in enumerate(inst.plan.expected_notifications):
                    if n == 0:
                        inst.unread[p] = worker(p)
        except KVBridgeError as exc:  # e.g. a malformed worker endpoint in the Welcome
            inst.reason = f"producer {inst.endpoint}: {exc}"
            del self._instances[inst.endpoint]
