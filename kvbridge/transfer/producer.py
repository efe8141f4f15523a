"""The producer side: a prefill worker exposes finished requests' blocks for reading.

Lifecycle (mirrors vLLM's KV-connector): the engine calls `expose` when a request's
prefill finished; its blocks stay pinned until every decode worker that the plan
says reads from this worker (`plan.readers_of(rank)`, known from their handshakes)
has sent a `ReadDone` notification, or until the lease expires; then `on_release`
hands the blocks back, with the cause. A worker nobody reads from (an unused replica
when prefill tp > num_kv_heads) waits for decode worker 0 alone, which notifies it
once per request. A decode worker that gave up sends `ReadDone(ok=False)`: it will
not read again, so it counts as done, and the release says ABORTED with its reason.
One cut off when it gave up sends it after the link heals, over its new handshake
session (any session of that decode worker whose plan matches is taken); one for a
request released meanwhile (by its lease) is ignored, not counted as a replay.
Exposing zeroes the slots past the request's last token in its last block (readers read
that block whole, `TransferPlan.read_end`; those slots may hold another request's KV).
A notification that arrives before its request's `expose` (engines race) is kept for
one lease and applied by `expose`. Notifications for already released (or never
exposed) requests and from workers the plan does not expect are ignored (logged).

Fencing: each exposure carries a generation (`expose(..., generation)`, from the
pull's capability, named again by the consumer's ReadDone). Every ok ReadDone is
answered over the side channel with a `ReadAck`: `held` True only if that exposure (same
generation) was still pinned when the ReadDone arrived (its reads ended before it was
sent, and began after the exposure was pinned, so the bytes read were held throughout);
False, with the reason, for a request released meanwhile (lease expired, aborted),
another generation, or a refused notification. A consumer uses its pulled bytes only
after every producer worker it read from answered held, or its fence word showed the
exposure held when the reads ended (`fence.py`: written here at expose and release,
before the blocks go back).

Who may notify: every notification is signed with the key of the handshake session
of the decode worker that sends it (`sessions.py`), names this worker as receiver, is
recent (`sent_at` within a lease) and is taken once; a request exposed for a given
decode instance (its capability's reader) takes notifications from that instance only.
Anything else is refused and counted in `num_replays` (forged, replayed, misdirected). The owner must call
`poll()` often: it serves the side channel, drives NIXL progress (reads of our memory
progress only while we poll) and enforces leases. Not thread-safe: `expose`, `poll`
and `close` from one thread at a time (a `WorkerConnector` holds its lock around each).
"""

from __future__ import annotations

import collections
import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from kvbridge.errors import KVBridgeError
from kvbridge.plan.copylist import blocks_needed, copy_lists
from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.plan.layout import InstanceLayout
from kvbridge.plan.planner import TransferPlan, make_plan
from kvbridge.transfer.agent import Transport
from kvbridge.transfer.config import TransferConfig
from kvbridge.transfer.credential import Credential
from kvbridge.transfer.errors import ProtocolError, TransferError
from kvbridge.transfer.fence import FenceTable
from kvbridge.transfer.identity import binding_refusal, bound_fingerprint
from kvbridge.transfer.integrity import digest, region_views
from kvbridge.transfer.messages import (
    Hello,
    LayoutWire,
    Meet,
    Message,
    ModelWire,
    Ping,
    Pong,
    ReadAck,
    ReadDone,
    Refused,
    Welcome,
    decode_signed,
    spec_error,
    welcome_body,
)
from kvbridge.transfer.regions import (
    CacheRegions,
    MemType,
    clear_slots,
    tail_slots,
    worker_shard_checked,
)
from kvbridge.transfer.sessions import Session, SessionRefused, SessionTable
from kvbridge.transfer.side_channel import SideChannelServer

log = logging.getLogger("kvbridge.transfer.producer")

#: How many released request ids are remembered to tell "stale" from "unknown".
_RECENT = 4096
#: Notifications kept per request that arrive before its `expose`.
_MAX_EARLY_PER_REQUEST = 1024
#: Handshake sessions a producer worker keeps: half for decode instances a pinned
#: request names, half a pool shared by every other Hello (see sessions.py).
MAX_SESSIONS = 1024


class ReleaseCause(enum.Enum):
    COMPLETED = "completed"  # every expected decode worker notified
    ABORTED = "aborted"  # every expected decode worker is done, some gave up
    LEASE_EXPIRED = "lease_expired"  # no (complete) consumer within the lease
    CLOSED = "closed"  # the producer shut down


@dataclass(frozen=True)
class Release:
    """Blocks handed back to the engine, and why."""

    request_id: str
    block_ids: tuple[int, ...]
    cause: ReleaseCause
    reason: str


@dataclass
class _Exposure:
    block_ids: tuple[int, ...]
    num_tokens: int
    deadline: float
    lease_s: float
    reader: str | None = None  # the only decode instance allowed to notify, if given
    generation: int = 0  # which exposure of `request_id` this is (the capability's)
    start_token: int = 0  # `block_ids` hold tokens [start_token, num_tokens)
    instance_id: str | None = None  # the decode instance whose workers notified
    plan: TransferPlan | None = None  # that instance's plan with us
    notified: set[int] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)


def expected_notifiers(plan: TransferPlan, prefill_rank: int) -> tuple[int, ...]:
    """Decode ranks whose notification completes a request on `prefill_rank`: its
    readers, or decode worker 0 alone for a worker nobody reads from."""
    return plan.readers_of(prefill_rank) or (0,)


class KVProducer:
    """One prefill worker's side of the transfer runtime.

    Owns the worker's side-channel server (endpoint `endpoint`); borrows the
    transport, which must have `regions` registered. `worker_endpoints` lists the
    side channels of every worker of this instance (rank order), sent in handshakes;
    worker 0's is the instance's endpoint. Blocks are never released twice.
    """

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
        on_release: Callable[[Release], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        credential: Credential | None = None,
    ) -> None:
        self.model, self.layout, self.rank = model, layout, rank
        self.shard = worker_shard_checked(model, layout, "prefill", rank, regions, num_blocks)
        self.regions, self.num_blocks = regions, num_blocks
        self._views = region_views(regions)  # to digest what a reader asks for
        self.transport, self.config, self.instance_id = transport, config, instance_id
        self.on_release = on_release
        self._clock = clock
        #: when a peer was last heard from or a request exposed or released (`clock`)
        self.active_at = clock()
        words = transport.fence_words()  # registered now, before any handshake
        self._fence = FenceTable(words[0]) if words is not None else None
        #: the instance's credential: signs each Welcome (None: open mode, unsigned)
        self.credential = credential
        self._exposed: dict[str, _Exposure] = {}
        # how many pinned exposures name each bound reader id (its Hellos get reserved
        # room in the session table: sessions.py)
        self._named: collections.Counter[str] = collections.Counter()
        # released request ids -> how (for a late ReadDone's ReadAck)
        self._recent: collections.OrderedDict[str, str] = collections.OrderedDict()
        # notifications that arrived before their request's `expose`, by request id
        self._early: collections.OrderedDict[str, list[tuple[float, ReadDone, Session]]] = (
            collections.OrderedDict()
        )
        self._sessions = SessionTable(
            token=config.token,
            me=(instance_id, rank),
            max_sessions=MAX_SESSIONS,
            grace_s=config.transfer_timeout_s + config.handshake_timeout_s,
            active_s=config.lease_s,
            clock=clock,
        )
        self.num_replays = 0  # notifications and Hellos refused as forged or replayed
        self.releases: list[Release] = []  # every release, in order (for the owner/tests)
        self.num_ignored_notifs = 0
        self.num_stale_acks = 0  # ReadAcks answered held=False
        self.refusals: collections.deque[str] = collections.deque(maxlen=64)  # recent, for owners
        self._server = SideChannelServer(
            config.host, config.port_of(rank), config.token, config.max_message_bytes, self._handle
        )
        bound = self._server.endpoint  # tcp://HOST:PORT as bound
        port = bound.rsplit(":", 1)[1]
        host = config.reachable_host
        self.endpoint = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        self.worker_endpoints: list[str] = [self.endpoint]

    # -- engine-facing API -------------------------------------------------------------
    def set_worker_endpoints(self, endpoints: Sequence[str]) -> None:
        """Tell this worker its instance's side channels (rank order), once all are bound."""
        if len(endpoints) != self.layout.world_size or endpoints[self.rank] != self.endpoint:
            raise TransferError(
                f"worker_endpoints has {len(endpoints)} entries (rank {self.rank}: "
                f"{endpoints[self.rank] if self.rank < len(endpoints) else None}); expected "
                f"{self.layout.world_size} with this worker's {self.endpoint} at {self.rank}"
            )
        self.worker_endpoints = list(endpoints)

    def expose(
        self,
        request_id: str,
        block_ids: Sequence[int] | np.ndarray,
        num_tokens: int,
        lease_s: float | None = None,
        reader: str | None = None,
        start_token: int = 0,
        generation: int = 0,
    ) -> None:
        """Pin `block_ids` (this request's KV of tokens [start_token, num_tokens), from the
        block holding token `start_token` on) for decode workers to read; with `reader`,
        only that decode instance's notifications count, and, if its id is bound to its
        key, its handshakes take reserved room in the session table while this exposure is
        pinned (`sessions.py`). `generation` names this exposure (the pull's capability
        carries it): only ReadDones naming it are answered held."""
        ids = tuple(int(b) for b in np.asarray(block_ids).ravel())
        if request_id in self._exposed:
            raise TransferError(f"request_id={request_id!r} is already exposed; ids must be unique")
        if any(not 0 <= b < self.num_blocks for b in ids):
            raise TransferError(
                f"block_ids of {request_id!r} must lie in [0, {self.num_blocks}); got "
                f"{[b for b in ids if not 0 <= b < self.num_blocks][:4]}"
            )
        bp = self.layout.block_size
        if not 0 <= start_token <= num_tokens <= start_token // bp * bp + len(ids) * bp:
            span = (
                f"tokens [{start_token}, {num_tokens})"
                if start_token
                else f"num_tokens={num_tokens}"
            )
            raise TransferError(
                f"{span} of {request_id!r} does not fit {len(ids)} blocks of {bp} tokens"
            )
        self._clear_tail(ids, num_tokens, start_token)
        lease = self.config.lease_s if lease_s is None else lease_s
        self.active_at = self._clock()
        self._exposed[request_id] = _Exposure(
            ids, num_tokens, self._clock() + lease, lease, reader, generation, start_token
        )
        if self._fence is not None:
            self._fence.hold(request_id, generation)
        if reader is not None and bound_fingerprint(reader) is not None:
            self._named[reader] += 1
            self._sessions.reserve(reader)
        for _, msg, session in self._early.pop(request_id, []):
            self._apply(msg, session)

    def _clear_tail(self, block_ids: tuple[int, ...], num_tokens: int, start_token: int) -> None:
        """Zero the slots past token `num_tokens` in the block holding its last token
        (every layer, head and K/V half this worker holds) as it is exposed: a reader
        may read that block whole (`regions.read_end`), and those slots may still hold
        another request's KV. The block is this request's own (a partial block is never
        shared) and nothing writes it while it is pinned. A READ that raced the expose
        may still have read them; its decode worker zeroes its own copy of them
        (`PullProgress`). A device-memory cache is not cleared; its readers stop at the
        last token."""
        if self.regions.mem_type is MemType.DRAM:
            bp = self.layout.block_size
            end = -(-num_tokens // bp) * bp  # no reader reads past it (`TransferPlan.read_end`)
            boxes = tail_slots(
                self.model, self.layout, self.shard, block_ids, start_token, num_tokens, end
            )
            clear_slots(self.regions, boxes)

    def cancel(self, request_id: str, reason: str) -> bool:
        """Release `request_id`'s blocks now (cause ABORTED): its router gave up on it
        before any decode instance took it. False if it is not exposed (any more)."""
        if request_id not in self._exposed:
            return False
        self._release(request_id, ReleaseCause.ABORTED, f"cancelled: {reason}")
        return True

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(e.block_ids) for e in self._exposed.values())

    def quiet_s(self) -> float:
        """How long since `active_at` (by this producer's clock)."""
        return self._clock() - self.active_at

    @property
    def num_rejected(self) -> int:
        """Side-channel messages rejected so far (malformed, oversized, unauthenticated)."""
        return self._server.num_rejected

    def poll(self, timeout_ms: int = 0) -> list[Release]:
        """Serve the side channel, take notifications, enforce leases; returns new releases.
        `active_at` becomes now when a side-channel message or a notification came."""
        start = len(self.releases)
        heard = self._server.poll(timeout_ms)
        for sender, msgs in self.transport.notifs().items():
            for raw in msgs:
                heard += 1
                self._on_notif(sender, raw)
        now = self._clock()
        if heard:
            self.active_at = now
        while self._early:  # forget early notifications no expose claimed within a lease
            rid, early = next(iter(self._early.items()))
            if early and early[0][0] + self.config.lease_s > now:
                break
            del self._early[rid]
            self._ignore(f"notification for unknown request {rid!r} (never exposed)", warn=True)
        for rid in [r for r, e in self._exposed.items() if e.deadline <= now]:
            self._release(rid, ReleaseCause.LEASE_EXPIRED, self._lease_reason(rid))
        return self.releases[start:]

    def close(self) -> None:
        """Release everything still pinned (cause CLOSED) and stop serving."""
        for rid in list(self._exposed):
            self._release(rid, ReleaseCause.CLOSED, "producer closed")
        self._server.close()

    # -- internals ---------------------------------------------------------------------
    def _release(self, request_id: str, cause: ReleaseCause, reason: str) -> None:
        exp = self._exposed.pop(request_id)
        self.active_at = self._clock()
        if self._fence is not None:  # before the blocks go back (`fence.py`)
            self._fence.release(request_id, exp.generation, cause is ReleaseCause.COMPLETED)
        if exp.reader is not None and exp.reader in self._named:
            self._named[exp.reader] -= 1
            if not self._named[exp.reader]:
                del self._named[exp.reader]
        self._recent[request_id] = f"released ({cause.value}): {reason}"[:1000]
        while len(self._recent) > _RECENT:
            self._recent.popitem(last=False)
        rel = Release(request_id, exp.block_ids, cause, reason)
        self.releases.append(rel)
        if cause is not ReleaseCause.COMPLETED:
            log.warning("prefill worker %d released %r: %s", self.rank, request_id, reason)
        if self.on_release is not None:
            self.on_release(rel)

    def _lease_reason(self, request_id: str) -> str:
        exp = self._exposed[request_id]
        lease = f"lease expired after {exp.lease_s:g} s"
        if exp.instance_id is None:
            return f"{lease}: no decode worker notified completion of {request_id!r}"
        readers = expected_notifiers(exp.plan, self.rank) if exp.plan is not None else ()
        missing = sorted(set(readers) - exp.notified)
        return (
            f"{lease}: {len(exp.notified)} of {len(readers)} decode workers of instance "
            f"{exp.instance_id!r} notified; missing ranks {missing}"
        )

    def _on_notif(self, sender: str, raw: bytes) -> None:
        try:
            msg, sid = decode_signed(raw, self._sessions.key_of, 64 << 10)
            if isinstance(msg, Meet):
                self._met(msg, sid)
                return
            if not isinstance(msg, ReadDone):
                raise ProtocolError(f"notification of kind {type(msg).__name__}; expected ReadDone")
        except ProtocolError as exc:
            self.num_replays += 1
            self._ignore(f"notification from agent {sender!r} rejected: {exc}", warn=True)
            return
        session = self._sessions.get(sid)
        assert session is not None  # its key verified the message
        why = ""
        if (msg.instance_id, msg.rank) != (session.instance_id, session.rank):
            why = (
                f"it claims decode worker {msg.instance_id!r} rank {msg.rank} but is signed "
                f"by the session of {session.instance_id!r} rank {session.rank}"
            )
        elif (msg.to_instance, msg.to_rank) != (self.instance_id, self.rank):
            why = f"it is addressed to {msg.to_instance!r} rank {msg.to_rank}, not to us"
        elif abs(time.time() - msg.sent_at) > self.config.lease_s:
            why = f"it was sent {time.time() - msg.sent_at:.0f} s ago, beyond a lease"
        if why:
            self.num_replays += 1
            self._ignore(f"notification for {msg.request_id!r} refused: {why}", warn=True)
            self._ack(msg, session, f"the ReadDone was refused: {why}")
            return
        self._sessions.touch(sid)
        log.debug(
            "prefill worker %d: ReadDone of %r from %r rank %d, sent %.3f s ago",
            self.rank,
            msg.request_id,
            msg.instance_id,
            msg.rank,
            time.time() - msg.sent_at,
        )
        self._apply(msg, session)

    def _met(self, msg: Meet, sid: bytes) -> None:
        """A decode worker's warm-up notification (`Meet`): nothing to do but note it."""
        session = self._sessions.get(sid)
        assert session is not None  # its key verified the message
        if (msg.instance_id, msg.rank) != (session.instance_id, session.rank):
            self.num_replays += 1
            self._ignore(f"a Meet naming {msg.instance_id!r} rank {msg.rank}, signed by "
                         f"the session of {session.instance_id!r} rank {session.rank}", warn=True)  # fmt: skip
            return
        self._sessions.touch(sid)
        log.debug("prefill worker %d: met %r rank %d", self.rank, msg.instance_id, msg.rank)

    def _apply(self, msg: ReadDone, session: Session) -> None:
        exp = self._exposed.get(msg.request_id)
        if exp is None:
            if msg.request_id in self._recent:  # the reader was not done before the release
                self._ack(msg, session, self._recent[msg.request_id])
            if msg.request_id in self._recent and not msg.ok:
                # a decode worker that gave up while cut off tells us after the heal
                # (consumer's owed notices), maybe after the lease released it: harmless
                self._ignore(
                    f"late failure notice for {msg.request_id!r} (released already) from "
                    f"{msg.instance_id!r} rank {msg.rank}"
                )
            elif msg.request_id in self._recent:
                self.num_replays += 1
                self._ignore(
                    f"stale notification for {msg.request_id!r} from "
                    f"{msg.instance_id!r} rank {msg.rank}"
                )
            else:  # may precede `expose` (a race between engines): keep it for a lease
                early = self._early.setdefault(msg.request_id, [])
                if len(early) < _MAX_EARLY_PER_REQUEST:
                    early.append((self._clock(), msg, session))
                while len(self._early) > _RECENT:
                    self._early.popitem(last=False)
            return
        # (a failure notice of another generation still releases: the reader of this
        # one then hears held=False and recomputes, which is safe)
        if msg.ok and msg.generation != exp.generation:
            why = (
                f"{msg.request_id!r} is exposed now as generation {exp.generation}, not the "
                f"generation {msg.generation} that was read"
            )
            self._ignore(f"notification: {why}", warn=True)
            self._ack(msg, session, why)
            return
        if exp.reader is not None and msg.instance_id != exp.reader:
            self.num_replays += 1
            self._ignore(
                f"notification for {msg.request_id!r} from decode instance "
                f"{msg.instance_id!r}; its capability went to {exp.reader!r}",
                warn=True,
            )
            self._ack(msg, session, f"its capability went to {exp.reader!r}")
            return
        readers = expected_notifiers(session.plan, self.rank)
        if msg.rank not in readers:
            self._ignore(
                f"notification for {msg.request_id!r} from decode rank {msg.rank}, "
                f"which the plan does not have read here (readers {list(readers)})",
                warn=True,
            )
            self._ack(msg, session, f"decode rank {msg.rank} is not a reader here")
            return
        if exp.instance_id is None:
            exp.instance_id, exp.plan = msg.instance_id, session.plan
        elif exp.instance_id != msg.instance_id or exp.plan != session.plan:
            self._ignore(
                f"notification for {msg.request_id!r} from a second decode instance "
                f"{msg.instance_id!r} (first: {exp.instance_id!r}) or another plan",
                warn=True,
            )
            self._ack(msg, session, "another decode instance or plan notified it first")
            return
        if msg.rank in exp.notified:
            self.num_replays += 1
            self._ignore(f"duplicate notification for {msg.request_id!r} rank {msg.rank}")
            return
        exp.notified.add(msg.rank)
        # pinned (same generation) since before the reads began
        self._ack(msg, session, digest=self._digest(exp, msg, session) if msg.digest else b"")
        if not msg.ok:
            exp.failures.append(f"decode rank {msg.rank}: {msg.reason}")
        if exp.notified >= set(readers):
            if exp.failures:
                self._release(
                    msg.request_id,
                    ReleaseCause.ABORTED,
                    "decode workers gave up: " + "; ".join(exp.failures),
                )
            else:
                self._release(
                    msg.request_id,
                    ReleaseCause.COMPLETED,
                    f"{len(readers)} decode workers notified",
                )

    def _ack(
        self, msg: ReadDone, session: Session, stale: str | None = None, digest: bytes = b""
    ) -> None:
        """Answer an ok `msg` over its sender's side channel: held (with the `digest` it
        asked for), or not (`stale`: why the bytes it read may not be the exposure's). A
        failure notice gets no answer."""
        if not msg.ok:
            return
        if stale is not None:
            self.num_stale_acks += 1
            log.warning(
                "prefill worker %d: %r was read by %r rank %d but not held when its ReadDone "
                "arrived: %s",
                self.rank,
                msg.request_id,
                msg.instance_id,
                msg.rank,
                stale,
            )
        ack = ReadAck(msg.request_id, msg.generation, self.rank, stale is None, stale or "", digest)
        self._server.send_to(session.peer, ack)

    def _digest(self, exp: _Exposure, msg: ReadDone, session: Session) -> bytes:
        """The digest of our bytes that decode worker `msg.rank` read for its pull from
        token `msg.start_token` (`integrity.digest`); b"" if it cannot be computed."""
        plan, views = session.plan, self._views
        bp, bd = plan.prefill.block_size, plan.decode.block_size
        skip = msg.start_token // bp - exp.start_token // bp
        if not 0 <= skip < len(exp.block_ids) or msg.start_token >= exp.num_tokens:
            return b""
        # the prompt's bytes only: slots past it a reader may read too are zeroed by it
        # stand-in decode block ids: the source runs (and their order) do not depend on them
        d_ids = np.arange(blocks_needed(exp.num_tokens, bd, msg.start_token))
        try:
            lists = copy_lists(
                plan, msg.rank, exp.block_ids[skip:], d_ids, exp.num_tokens, msg.start_token
            )
        except KVBridgeError as exc:
            log.warning("prefill worker %d: no digest of %r: %s", self.rank, msg.request_id, exc)
            return b""
        return digest(views, [cl for cl in lists if cl.read.prefill_rank == self.rank], "src")

    def _ignore(self, what: str, warn: bool = False) -> None:
        self.num_ignored_notifs += 1
        (log.warning if warn else log.debug)("prefill worker %d ignored %s", self.rank, what)

    def _handle(self, msg: Message, peer: bytes = b"") -> Message | None:
        if isinstance(msg, Ping):
            return Pong(nonce=msg.nonce, instance_id=self.instance_id)
        if not isinstance(msg, Hello):
            raise ProtocolError(
                f"a {type(msg).__name__} message is not a request; send Hello or Ping"
            )
        log.debug("prefill worker %d: Hello from %r rank %d", self.rank, msg.instance_id, msg.rank)
        impostor = binding_refusal(msg.instance_id, self._server.peer_key)
        if impostor is not None:
            log.warning("prefill worker %d refused a handshake: %s", self.rank, impostor)
            self.refusals.append(impostor)
            return Refused(kind="auth", reason=impostor)
        if len(self.worker_endpoints) != self.layout.world_size:
            return Refused(
                kind="not_ready",
                reason=f"prefill worker {self.rank} does not know its instance's "
                f"{self.layout.world_size} worker endpoints yet (set_worker_endpoints)",
            )
        try:
            decode_model = msg.model.to_spec()
            decode_layout = msg.layout.to_layout()
            plan = make_plan(
                self.model, self.layout, decode_layout, decode_model, decode_hosts=msg.decode_hosts
            )
            if msg.rank >= decode_layout.world_size:
                raise TransferError(
                    f"decode rank={msg.rank} is outside its world of "
                    f"{decode_layout.world_size} workers"
                )
        except KVBridgeError as exc:
            log.warning(
                "prefill worker %d refused the handshake of instance %r rank %d: %s",
                self.rank,
                msg.instance_id,
                msg.rank,
                exc,
            )
            self.refusals.append(spec_error(exc))
            return Refused(kind="incompatible", reason=spec_error(exc))
        # the CURVE handshake proved the key; binding_refusal above, that the id names it
        bound = self._server.peer_key is not None and bound_fingerprint(msg.instance_id) is not None
        try:
            _, nonce = self._sessions.open(
                msg.instance_id,
                msg.rank,
                msg.nonce,
                plan,
                self._is_reading,
                peer,
                self._server.peer_address or "",
                bound=bound,
                named=bound and msg.instance_id in self._named,
            )
        except SessionRefused as exc:
            if exc.kind == "replay":
                self.num_replays += 1
            log.warning(
                "prefill worker %d refused the handshake of instance %r rank %d: %s",
                self.rank,
                msg.instance_id,
                msg.rank,
                exc,
            )
            return Refused(kind=exc.kind, reason=str(exc))
        exported = self.transport.peer_regions(self.regions)
        fence = self.transport.fence_words()  # (an export process's may move: asked here)
        cred = self.credential
        welcome = Welcome(
            instance_id=self.instance_id,
            rank=self.rank,
            model=ModelWire.of(self.model),
            layout=LayoutWire.of(self.layout),
            num_blocks=self.num_blocks,
            regions=list(zip(exported.addresses, exported.lengths, strict=True)),
            mem_type=self.regions.mem_type.value,
            device_id=self.regions.device_id,
            agent_name=self.transport.name,
            agent_metadata=self.transport.metadata(),
            worker_endpoints=self.worker_endpoints,
            hello_nonce=msg.nonce,
            nonce=nonce,
            fence_words=fence[1] if fence is not None else 0,
            certificate=cred.certificate if cred is not None else b"",
        )
        if cred is None:
            return welcome
        return msgspec.structs.replace(welcome, signature=cred.sign(welcome_body(welcome)))

    def _is_reading(self, instance_id: str) -> bool:
        """Whether decode instance `instance_id` reads (or may read) a pinned request."""
        return any(
            e.instance_id == instance_id or e.reader in (instance_id, None)
            for e in self._exposed.values()
        )
