"""The worker-side connector: the transfer runtime of one worker process.

An engine runs one `WorkerConnector` in every worker process that owns a KV cache: the
transport (one NIXL agent, the cache's regions registered once) and a `KVProducer`
(prefill instance) or `KVConsumer` (decode instance) over it. The engine's driver
talks to all of its workers with typed requests and gets one typed reply per worker:

    GetEndpoint               -> reply.endpoint: this worker's side channel (producers)
                                 reply.sibling: what its instance's other workers need
                                 to copy from it (consumers: `KVConsumer.sibling`, as
                                 base64 text, as engines pass handshake metadata)
    SetEndpoints(endpoints)   every producer worker learns all its instance's endpoints
                              (gather GetEndpoint from every worker first, rank order)
    SetSiblings(siblings)     every consumer worker meets its instance's other workers
                              (their GetEndpoint `sibling`s, rank order): the fan-out
    Expose(request, blocks)   producer workers pin a prefilled request's blocks
    Pull(request, ...)        consumer workers start reading it into local blocks
    Cancel(request)           producer workers release a request nobody took
    Decline(request, ...)     consumer workers tell a producer they will not read it
    Connect(endpoint)         consumer workers meet a producer instance ahead of its
                              first request (handshakes, descriptor lists)
                              -> reply.connected: whether this worker has met it
    Poll                      -> reply.events: requests finished since (released on a
                              producer, DONE/FAILED on a consumer), reply.pinned_blocks

Progress: without NIXL's progress thread (it spins a core per agent) a read from a
worker's memory, a notification to it and a handshake progress only while that worker
polls its agent. Each `WorkerConnector` therefore runs a `ProgressThread`
(`progress.py`) that polls while the engine computes, at the cadence its state needs:
`BUSY_POLL_S` while a transfer is pending (woken at once by a Pull, Expose, Connect or
Decline), `IDLE_POLL_S` for an idle producer (it answers handshakes; `DORMANT_POLL_S`
once nothing happened for `DORMANT_AFTER_S`),
`CONSUMER_IDLE_S` for an idle consumer, blocked on an event in between. One lock
serializes the thread's polls with the driver's requests (NIXL's agent has no lock of
its own here); a driver's Poll then only collects what the thread found, so the
transfers' work (a READ's copy runs in whichever thread polls) stays on the thread, at
its priority, not on an engine thread that computes at a lower one (unless the thread
is over `STARVED_S` late for its poll: then the Poll polls too). An engine that
wants to poll from its own loop instead builds the connector with
`progress_thread=False` and calls `idle_poll()` between driver calls, waiting no longer
than it returns.

The connector layer's `KVConnectorWorker` (`kvbridge.connector.worker`) wraps this and
sends these requests; its scheduler side (`KVConnectorScheduler.update_connector_output`)
folds every worker's events into one outcome per request, once every worker reported.

Requests and replies are msgspec structs (`encode`, `request_decoder`, `reply_decoder`)
so they can cross a process boundary as bytes; nothing is pickled. NIXL, ZMQ and the
runtime's modules are imported when a `WorkerConnector` is built, not before.
"""

from __future__ import annotations

import base64
import enum
import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec

from kvbridge.errors import ConfigError
from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.plan.layout import InstanceLayout
from kvbridge.transfer.config import KVExport, TransferConfig
from kvbridge.transfer.errors import TransferError

if TYPE_CHECKING:
    from kvbridge.transfer.agent import Transport
    from kvbridge.transfer.consumer import KVConsumer
    from kvbridge.transfer.export import SharedSegment
    from kvbridge.transfer.producer import KVProducer
    from kvbridge.transfer.progress import ProgressThread
    from kvbridge.transfer.regions import CacheRegions

#: How often an idle producer worker polls its side channel (seconds), for
#: `DORMANT_AFTER_S` after a peer was last heard from or a request exposed or released.
IDLE_POLL_S = 0.05
#: How often a producer worker idle for longer polls: each wake-up of a sleeping thread
#: costs 0.1-0.2 ms of CPU on a virtual machine's core (docs/benchmarks.md), so a
#: producer that nobody talks to costs a tenth of a core percent instead of half a
#: percent; the first message after the pause waits up to this long, the next ones
#: `IDLE_POLL_S`.
DORMANT_POLL_S = 0.5
#: How long after its last activity an idle producer worker keeps `IDLE_POLL_S`.
DORMANT_AFTER_S = 10.0
#: How often a worker polls while one of its transfers is pending (seconds).
BUSY_POLL_S = 0.001
#: How often an idle consumer worker polls (nothing is pending; a pull wakes it).
CONSUMER_IDLE_S = 0.5
#: A progress thread this late for its next poll is starved (the host does not run it):
#: a driver's Poll then polls itself rather than only collecting.
STARVED_S = 0.1


class ConnectorRole(enum.Enum):
    PRODUCER = "producer"  # prefill instance: exposes blocks
    CONSUMER = "consumer"  # decode instance: pulls blocks


class ConnectorSpec(msgspec.Struct, frozen=True):
    """How every worker of one instance sets up its side of the transfer runtime."""

    role: ConnectorRole
    instance_id: str
    transfer: TransferConfig = TransferConfig()
    #: the instance's role credential (msgpack of `credential.Credential`; b"": none, open
    #: mode): a prefill worker signs its Welcomes with it, a decode worker takes Welcomes
    #: only from prefill instances its root enrolled, and presents the instance's key
    credential: bytes = b""
    #: without a credential, a decode instance's CURVE secret key (Z85;
    #: `identity.Identity`), shared by its workers: their side-channel connections present
    #: it, and `instance_id` names it (`Identity.bind`); "" for none (an ephemeral key per
    #: connection, an unbound id)
    identity: str = ""

    @property
    def exports_kv(self) -> bool:
        """Whether a producer worker of this spec wants its KV exported from a process
        of its own, its cache in shared memory (`TransferConfig.kv_export`)."""
        return self.role is ConnectorRole.PRODUCER and self.transfer.wants_export_process


class GetEndpoint(msgspec.Struct, frozen=True, tag="endpoint"):
    """Ask each worker for its side-channel endpoint ("" on a consumer)."""


class SetEndpoints(msgspec.Struct, frozen=True, tag="set_endpoints"):
    """Tell each producer worker every worker's endpoint of its instance, in rank order."""

    endpoints: list[str]


class SetSiblings(msgspec.Struct, frozen=True, tag="set_siblings"):
    """Tell each consumer worker every worker's `ConnectorReply.sibling` of its instance,
    in rank order (`KVConsumer.set_siblings`)."""

    siblings: list[str]


class Expose(msgspec.Struct, frozen=True, tag="expose"):
    """Producer workers: pin `block_ids` holding `num_tokens` tokens of `request_id`;
    with `reader`, only that decode instance's notifications release them. `lease_s`
    (default: the configured lease) bounds how long they stay pinned unread."""

    request_id: str
    block_ids: list[int]
    num_tokens: int
    reader: str | None = None
    start_token: int = 0  # a partial pull: block_ids hold tokens [start_token, num_tokens)
    lease_s: float | None = None
    generation: int = 0  # names this exposure; its capability carries it to the reader


class Pull(msgspec.Struct, frozen=True, tag="pull"):
    """Consumer workers: read `request_id` from the producer instance at `endpoint`."""

    request_id: str
    endpoint: str
    producer_block_ids: list[int]
    local_block_ids: list[int]
    num_tokens: int
    start_token: int = 0  # read tokens [start_token, num_tokens); both lists from its block
    generation: int = 0  # the exposure's (its capability's): the producer confirms it
    #: the blocks hold a per-request state (an SSM layer's), read whole: it fails unless
    #: both instances page it alike (`same_pages`)
    is_state: bool = False


class Cancel(msgspec.Struct, frozen=True, tag="cancel"):
    """Producer workers: release `request_id` now; no decode instance will read it.
    Only for a request no decode instance took (the router knows)."""

    request_id: str
    reason: str


class Decline(msgspec.Struct, frozen=True, tag="decline"):
    """Consumer workers: tell the producer instance at `endpoint` we will not read
    `request_id` (refused before pulling), so it releases at once."""

    request_id: str
    endpoint: str
    reason: str


class Connect(msgspec.Struct, frozen=True, tag="connect"):
    """Consumer workers: meet the producer instance at `endpoint` before its first
    request (handshakes, prepared descriptor lists); returns at once, each reply's
    `connected` saying whether that worker has met it already (repeat until all have).
    `instance_id`, when given, is the producer instance's: one met before under another
    id (restarted at the same address) is met afresh."""

    endpoint: str
    instance_id: str = ""


class Poll(msgspec.Struct, frozen=True, tag="poll"):
    """Report the requests finished since the last Poll; a worker without a progress
    thread, or whose thread is starved (`STARVED_S`), also progresses its transfers now
    (otherwise the thread does)."""


ConnectorRequest = (
    GetEndpoint | SetEndpoints | SetSiblings | Expose | Pull | Connect | Cancel | Decline | Poll
)


class ConnectorEvent(msgspec.Struct, frozen=True):
    """A request's transfer finished on one worker: released (producer) or DONE /
    FAILED (consumer), with the reason, the bytes it read, and how long it took there
    (from the worker's Expose or Pull to the moment it finished, in the worker's clock:
    the transfer's own time, whenever the driver asks)."""

    request_id: str
    ok: bool
    reason: str = ""
    nbytes: int = 0
    elapsed_ms: float = 0.0
    #: producer: why the blocks were released (`ReleaseCause` value: completed, aborted,
    #: lease_expired, closed); consumer: why a pull failed where a counter tells it apart
    #: (`PullFailure` value: stale, integrity), else ""; "" for a refused order
    cause: str = ""
    #: consumer: bytes copied from another decode worker's cache on this host (the
    #: second hop of a fan-out), besides the `nbytes` read from the producer
    local_nbytes: int = 0
    #: consumer: the pull waited for a handshake with its producer instance
    handshake: bool = False
    #: consumer: producer workers the pull was the first READ from (`TransferResult`)
    cold_peers: int = 0
    #: consumer: the READs' descriptors (copy-list runs after merging) and where the
    #: pull's time went (`PullPhases`: queued, post, read, digest, confirm, cast; ms)
    num_descriptors: int = 0
    phases_ms: tuple[float, ...] = ()


class ConnectorReply(msgspec.Struct, frozen=True):
    """One worker's answer to any request."""

    endpoint: str = ""
    events: list[ConnectorEvent] = msgspec.field(default_factory=list)
    pinned_blocks: int = 0  # producer: blocks pinned; consumer: blocks being pulled into
    replays_refused: int = 0  # producer: forged, replayed or misdirected messages so far
    connected: bool = False  # Connect: this consumer worker has met that producer instance
    sibling: str = ""  # GetEndpoint on a consumer: `KVConsumer.sibling`, base64


request_decoder = msgspec.msgpack.Decoder(ConnectorRequest)
reply_decoder = msgspec.msgpack.Decoder(ConnectorReply)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: ConnectorRequest | ConnectorReply) -> bytes:
    return _encoder.encode(msg)


class WorkerConnector:
    """One worker's producer or consumer over its registered cache, built and closed by
    the process that owns the cache memory.

    `handle`, `idle_poll` and `close` may be called from any one thread of that process
    (the engine's); with `progress_thread` (the default) a `ProgressThread` of its own
    polls the agent meanwhile. Every use of the agent, the producer and the consumer
    holds `self.lock`, so the two never race. `close` stops and joins the thread, then
    releases what is in flight, closes the side channel and deregisters the memory.
    """

    def __init__(
        self,
        spec: ConnectorSpec,
        model: ModelKVSpec,
        layout: InstanceLayout,
        rank: int,
        regions: CacheRegions,
        num_blocks: int,
        transport: Transport | None = None,
        progress_thread: bool = True,
        segment: SharedSegment | None = None,
    ) -> None:
        from kvbridge.transfer.progress import threads_on_every_cpu

        # the agent's, the side channel's and the progress thread are made here: none
        # inherits a core the engine pinned its calling thread to
        with threads_on_every_cpu():
            self._init(
                spec, model, layout, rank, regions, num_blocks, transport, progress_thread, segment
            )

    def _init(
        self,
        spec: ConnectorSpec,
        model: ModelKVSpec,
        layout: InstanceLayout,
        rank: int,
        regions: CacheRegions,
        num_blocks: int,
        transport: Transport | None,
        progress_thread: bool,
        segment: SharedSegment | None,
    ) -> None:
        from kvbridge.transfer.agent import NixlTransport
        from kvbridge.transfer.consumer import KVConsumer
        from kvbridge.transfer.credential import Credential
        from kvbridge.transfer.identity import Identity
        from kvbridge.transfer.netdev import device_of
        from kvbridge.transfer.producer import KVProducer
        from kvbridge.transfer.side_channel import start_io_threads

        start_io_threads()  # (among the connector's threads: engine/cpu_share.py)
        self.role = spec.role
        name = f"{spec.instance_id}-{spec.role.value}-{rank}"
        net_device = device_of(spec.transfer.reachable_host)
        if transport is not None:
            self.transport = transport
        elif self.exports_kv(spec, segment):
            from kvbridge.transfer.export import ExportedTransport

            assert segment is not None
            self.transport = ExportedTransport(name, regions, segment, net_device=net_device)
        else:
            self.transport = NixlTransport(name, regions, net_device=net_device)
        common: dict[str, Any] = dict(
            model=model,
            layout=layout,
            rank=rank,
            regions=regions,
            num_blocks=num_blocks,
            transport=self.transport,
            config=spec.transfer,
            instance_id=spec.instance_id,
        )
        try:
            runtime: KVProducer | KVConsumer
            cred = Credential.unpacked(spec.credential)
            if self.role is ConnectorRole.PRODUCER:
                runtime = KVProducer(**common, credential=cred)
            elif cred is not None:
                runtime = KVConsumer(**common, identity=cred.identity, root=cred.root)
            else:
                identity = Identity(spec.identity.encode()) if spec.identity else None
                runtime = KVConsumer(**common, identity=identity)
        except BaseException:
            if transport is None:  # ours: deregister the memory and drop the agent
                self.transport.close()
            raise
        self.producer = runtime if isinstance(runtime, KVProducer) else None
        self.consumer = runtime if isinstance(runtime, KVConsumer) else None
        self.rank = rank
        self._events: list[ConnectorEvent] = []
        #: set while `_events` holds something a Poll would report (`wait_for_events`)
        self._has_events = threading.Event()
        self._started: dict[str, float] = {}  # request id -> its Expose or Pull here
        self._num_reported = 0  # the producer's releases reported as events so far
        self._last_poll = 0.0
        self._closed = False
        #: held by every use of the agent, the producer and the consumer
        self.lock = threading.Lock()
        self.progress: ProgressThread | None = None
        if progress_thread:
            from kvbridge.transfer.progress import ProgressThread

            self.progress = ProgressThread(
                self._progress_step, f"kvb-{spec.role.value}-{rank}"
            ).start()

    @staticmethod
    def exports_kv(spec: ConnectorSpec, segment: SharedSegment | None) -> bool:
        """Whether a worker of `spec` with its cache in `segment` (None: its own memory)
        gives peers an export process's agent (`TransferConfig.kv_export`); ConfigError
        if `kv_export` asks for one the cache cannot have."""
        if spec.role is not ConnectorRole.PRODUCER:
            return False
        if spec.transfer.kv_export is KVExport.PROCESS and segment is None:
            raise ConfigError(
                "kv_export='process' needs the KV cache in shared memory, and this worker "
                "registered its own (give a SharedSegment, e.g. SharedSegment.adopt); use "
                "kv_export='inline' (or 'auto', which picks it for such a cache)"
            )
        return segment is not None and spec.exports_kv

    def handle(self, request: ConnectorRequest) -> ConnectorReply:
        """Serve one driver request; raises a KVBridgeError on a bad one, or if the
        progress thread failed (its reason)."""
        with self.lock:
            self._check_progress()
            reply = self._handle(request)
        if self.progress is not None and isinstance(request, Expose | Pull | Connect | Decline):
            self.progress.wake()  # work to progress now: poll at the busy cadence
        return reply

    def wait_for_events(self, timeout_s: float) -> bool:
        """Block (without the lock) until a request finished here and the next Poll
        would report it, or `timeout_s` passed; True if one did. With the progress
        thread, this is how an engine with nothing to compute waits for its transfers
        instead of spinning; without it nothing polls meanwhile, so it only waits."""
        return self._has_events.wait(max(timeout_s, 0.0))

    def _check_progress(self) -> None:
        if self._closed:
            raise TransferError(f"the {self.role.value} connector of worker {self.rank} is closed")
        if self.progress is not None and self.progress.failure is not None:
            raise TransferError(
                f"the transfer progress thread of {self.role.value} worker {self.rank} "
                f"failed: {self.progress.failure}; its transfers no longer progress"
            )

    def _progress_step(self) -> float:
        """One poll of the progress thread; returns how long it may wait for the next."""
        with self.lock:
            if self._closed:
                return CONSUMER_IDLE_S
            self._last_poll = 0.0
            return self._poll_if_due()

    def _handle(self, request: ConnectorRequest) -> ConnectorReply:
        if isinstance(request, GetEndpoint):
            if self.producer is not None:
                return ConnectorReply(endpoint=self.producer.endpoint)
            assert self.consumer is not None
            return ConnectorReply(sibling=base64.b64encode(self.consumer.sibling()).decode())
        if isinstance(request, SetEndpoints):
            self._need(self.producer, request).set_worker_endpoints(request.endpoints)
        elif isinstance(request, SetSiblings):
            self._need(self.consumer, request).set_siblings(
                [base64.b64decode(s) for s in request.siblings]
            )
        elif isinstance(request, Expose):
            self._need(self.producer, request).expose(
                request.request_id,
                request.block_ids,
                request.num_tokens,
                lease_s=request.lease_s,
                reader=request.reader,
                start_token=request.start_token,
                generation=request.generation,
            )
            self._started[request.request_id] = time.monotonic()
        elif isinstance(request, Pull):
            self._need(self.consumer, request).pull(
                request.request_id,
                request.endpoint,
                request.producer_block_ids,
                request.local_block_ids,
                request.num_tokens,
                request.start_token,
                request.generation,
                request.is_state,
            )
            self._started[request.request_id] = time.monotonic()
        elif isinstance(request, Cancel):
            self._need(self.producer, request).cancel(request.request_id, request.reason)
            self._report_releases()  # made outside `poll`: the next Poll reports it
        elif isinstance(request, Decline):
            self._need(self.consumer, request).decline(
                request.request_id, request.endpoint, request.reason
            )
            self._last_poll = 0.0
        elif isinstance(request, Connect):
            met = self._need(self.consumer, request).connect(request.endpoint, request.instance_id)
            self._last_poll = 0.0
            return ConnectorReply(connected=met)
        elif isinstance(request, Poll):
            if self.progress is None or self.progress.late_s() > STARVED_S:
                self._last_poll = 0.0  # the driver asks: poll now
                self._poll_if_due()
            # else only collect: the progress thread polls, at its own priority (the
            # driver's thread may run the compute at a lower one, engine/cpu_share.py,
            # and the thread that polls the agent posts and progresses a pull's READs)
            events, self._events = self._events, []
            self._has_events.clear()
            replays = self.producer.num_replays if self.producer is not None else 0
            return ConnectorReply(
                events=events, pinned_blocks=self.num_pinned_blocks, replays_refused=replays
            )
        return ConnectorReply()

    def _need(self, side: KVProducer | KVConsumer | None, request: ConnectorRequest) -> Any:
        if side is None:
            raise TransferError(
                f"{type(request).__name__} is not a request for a {self.role.value} worker"
            )
        return side

    @property
    def num_pinned_blocks(self) -> int:
        if self.producer is not None:
            return self.producer.num_pinned_blocks
        return self.consumer.num_held_blocks if self.consumer is not None else 0

    def idle_poll(self) -> float:
        """For an engine that polls from its own loop (`progress_thread=False`): progress
        transfers and collect finished requests, at most as often as the state needs;
        returns how long the caller may wait before the next call. With the progress
        thread this polls nothing and returns `CONSUMER_IDLE_S`."""
        if self.progress is not None:
            return CONSUMER_IDLE_S
        with self.lock:
            self._check_progress()
            return self._poll_if_due()

    def _poll_if_due(self) -> float:
        """`idle_poll`'s work, with the lock held."""
        now = time.monotonic()
        interval = self.poll_interval()
        if now - self._last_poll < interval:
            return interval - (now - self._last_poll)
        self._last_poll = now
        if self.producer is not None:
            self.producer.poll(0)
            self._report_releases()
        if self.consumer is not None:
            for res in self.consumer.poll():
                ok = res.state.value == "done"
                elapsed = self._elapsed_ms(res.request_id)
                cause = res.failure.value if res.failure is not None else ""
                self._events.append(
                    ConnectorEvent(
                        res.request_id,
                        ok,
                        res.reason,
                        res.nbytes,
                        elapsed,
                        cause,
                        res.local_nbytes,
                        res.handshake,
                        res.cold_peers,
                        res.num_descriptors,
                        res.phases.ms,
                    )
                )
                self._has_events.set()
        return self.poll_interval()

    def _report_releases(self) -> None:
        """Queue an event for every release of the producer not reported yet, whether
        its `poll` made it (notifications, leases) or a `cancel` did."""
        assert self.producer is not None
        for rel in self.producer.releases[self._num_reported :]:
            ok = rel.cause.value == "completed"
            elapsed = self._elapsed_ms(rel.request_id)
            self._events.append(
                ConnectorEvent(rel.request_id, ok, rel.reason, 0, elapsed, rel.cause.value)
            )
            self._has_events.set()
        self._num_reported = len(self.producer.releases)

    def _elapsed_ms(self, request_id: str) -> float:
        started = self._started.pop(request_id, None)
        return 0.0 if started is None else (time.monotonic() - started) * 1e3

    def poll_interval(self) -> float:
        """BUSY_POLL_S while a transfer is pending (a read from this worker's memory
        progresses only while it polls); IDLE_POLL_S for an idle producer (it answers
        handshakes), DORMANT_POLL_S once it has been idle for DORMANT_AFTER_S;
        CONSUMER_IDLE_S for an idle consumer, which has nothing to progress until the next
        pull (a driver call, which wakes the worker)."""
        if self.producer is not None:
            if self.producer.num_pinned_blocks > 0:
                return BUSY_POLL_S
            return IDLE_POLL_S if self.producer.quiet_s() < DORMANT_AFTER_S else DORMANT_POLL_S
        if self.consumer is not None and self.consumer.is_busy:
            return BUSY_POLL_S
        return CONSUMER_IDLE_S

    def close(self) -> None:
        """Stop and join the progress thread, fail or release what is in flight, close
        the side channel, drop the agent. Raises TransferError, leaving the memory
        registered, if the thread is stuck in a poll (its NIXL call still uses it)."""
        if self.progress is not None and not self.progress.close():
            raise TransferError(
                f"the transfer progress thread of {self.role.value} worker {self.rank} did "
                "not stop within its join timeout; the cache memory stays registered"
            )
        with self.lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self.producer is not None:
                    self.producer.close()
                if self.consumer is not None:
                    self.consumer.close()
            finally:
                self.transport.close()
