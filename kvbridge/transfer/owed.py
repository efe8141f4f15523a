"""Failure notices a decode worker owes producer workers it could not tell at the time.

A pull that gives up tells the producer workers still waiting for it
(`ReadDone(ok=False)`), so they release the request's blocks at once. A producer worker
whose host or link is down cannot be told: its notification has no connection to
travel on, and without it the producer keeps the blocks pinned until its lease expires.
`OwedNotices` remembers such notices, per producer instance, and pays them once this
decode worker has met the *same* producer instance again (same instance id in its
Welcome; the heal's handshake, made by the next pull or introduction): each goes out
once, signed with the new session, and the producer releases at the heal instead of at
the lease. A producer met again under another instance id restarted: it holds nothing
of ours, so what it was owed is dropped.

Bounds: a notice expires `ttl_s` after the failure (the producer's lease would have
freed the blocks by then anyway), and at most `max_per_producer` are kept per producer
instance (the oldest go first). Only pulls none of whose READs can still land are owed
(the consumer records them after its fencing has released every READ). Owned by one
`KVConsumer`; single-threaded.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kvbridge.transfer.peers import PeerState, ProducerInstance, ProducerWorker

log = logging.getLogger("kvbridge.transfer.consumer")

#: Notices kept per producer instance; the oldest are dropped beyond it.
MAX_OWED_PER_PRODUCER = 1024
#: A notice's reason is cut to this many characters (bounds the memory kept).
MAX_REASON_CHARS = 1000


@dataclass
class _Owed:
    """What one producer instance (as identified by its instance id) is owed."""

    instance_id: str
    #: (request id, prefill rank) -> (reason, expires at), oldest first
    notices: collections.OrderedDict[tuple[str, int], tuple[str, float]] = field(
        default_factory=collections.OrderedDict
    )


class OwedNotices:
    """Failure notices owed to producer instances, keyed by the instance's endpoint
    (its worker 0's side channel, as `ProducerDirectory` keys it).

    `owe` records one; `settle` (from the consumer's poll) sends those whose producer
    instance is met again under the same instance id, drops those whose instance came
    back under another id or that expired, and keeps the rest. `send(worker, request_id,
    reason)` sends one notice to a producer worker and says whether it went out; a
    notice that could not go out is dropped (the lease frees its blocks, as before)."""

    def __init__(
        self,
        *,
        ttl_s: float,
        clock: Callable[[], float],
        max_per_producer: int = MAX_OWED_PER_PRODUCER,
    ) -> None:
        assert ttl_s > 0 and max_per_producer > 0
        self.ttl_s, self.max_per_producer = ttl_s, max_per_producer
        self._clock = clock
        self._owed: dict[str, _Owed] = {}
        self.num_sent = 0  # notices paid since start
        self.num_dropped = 0  # expired, over the bound, or their producer restarted

    def __len__(self) -> int:
        return sum(len(o.notices) for o in self._owed.values())

    def owe(
        self, endpoint: str, instance_id: str, request_id: str, prefill_rank: int, reason: str
    ) -> None:
        """Remember that producer instance `instance_id` at `endpoint` waits for our
        failed notice of `request_id` on its worker `prefill_rank`."""
        owed = self._owed.get(endpoint)
        if owed is None or owed.instance_id != instance_id:
            if owed is not None:  # a restarted producer at that address holds none of them
                self.num_dropped += len(owed.notices)
            owed = self._owed[endpoint] = _Owed(instance_id)
        key = (request_id, prefill_rank)
        owed.notices.pop(key, None)
        owed.notices[key] = (reason[:MAX_REASON_CHARS], self._clock() + self.ttl_s)
        while len(owed.notices) > self.max_per_producer:
            owed.notices.popitem(last=False)
            self.num_dropped += 1

    def forget_request(self, request_id: str, endpoint: str) -> None:
        """Drop what producer `endpoint` is owed for `request_id` (pulled from it anew:
        that pull tells it its own outcome); what other producers are owed stays."""
        owed = self._owed.get(endpoint)
        if owed is not None:
            for key in [k for k in owed.notices if k[0] == request_id]:
                del owed.notices[key]

    def settle(
        self,
        find: Callable[[str], ProducerInstance | None],
        send: Callable[[ProducerWorker, str, str], bool],
    ) -> None:
        """Pay, drop or keep every notice. `find(endpoint)` is the producer instance
        met (or being met) at `endpoint`, if any, without starting a handshake."""
        now = self._clock()
        for endpoint, owed in list(self._owed.items()):
            while owed.notices:  # expiries grow with insertion order: the oldest first
                key, (_, expires) = next(iter(owed.notices.items()))
                if expires > now:
                    break
                del owed.notices[key]
                self.num_dropped += 1
            inst = find(endpoint)
            welcome = inst.worker0.welcome if inst is not None else None
            if owed.notices and inst is not None and welcome is not None:
                if welcome.instance_id != owed.instance_id:
                    log.info(
                        "dropping %d failure notices owed to producer %s: it is instance "
                        "%r now, not %r (it restarted and holds none of those blocks)",
                        len(owed.notices),
                        endpoint,
                        welcome.instance_id,
                        owed.instance_id,
                    )
                    self.num_dropped += len(owed.notices)
                    owed.notices.clear()
                elif inst.is_ready:
                    self._pay(inst, owed, send)
            if not owed.notices:
                del self._owed[endpoint]

    def _pay(
        self,
        inst: ProducerInstance,
        owed: _Owed,
        send: Callable[[ProducerWorker, str, str], bool],
    ) -> None:
        """Send `owed`'s notices to the workers of `inst` (met again, same instance id)
        whose side channel is up; a rank the plan no longer has us notify waits for
        nothing of ours."""
        for (request_id, rank), (reason, _) in list(owed.notices.items()):
            worker = inst.readers.get(rank) or inst.unread.get(rank)
            if worker is None:
                del owed.notices[(request_id, rank)]
                self.num_dropped += 1
                continue
            if worker.state is not PeerState.READY or not worker.client.is_connected:
                continue  # not reachable yet: kept until it is, or until it expires
            del owed.notices[(request_id, rank)]
            if send(worker, request_id, reason):
                self.num_sent += 1
            else:
                self.num_dropped += 1
