"""A producer worker's handshake sessions: one per decode worker Hello it answered.

A session binds one decode worker (instance id, rank) to its plan and to a key that
only the two workers know (`auth.session_key`: the token, both fresh nonces and both
identities). Every completion notification must be signed with a session's key and
comes from that session's worker; so a Hello can never replace another peer's plan,
it only adds a session of its own.

Room goes first to decode instances a live exposure names. A token holder can make any
number of keys, ids and network addresses, so neither an id nor a key earns room by
itself; what Hellos alone cannot earn is a pinned request that names their sender, and
an id bound to a key names only the key's holder (`identity.py`). So the table has two
parts:

  * *reserved*: sessions of a *named* decode instance, one whose id is bound to the key
    its Hello presented (the CURVE handshake proved it) and that a live exposure names
    as its reader (`Expose.reader`, from the capability). A session stays reserved once
    its instance was named (a later exposure also moves its pooled sessions here). One
    instance holds at most a quarter of the half the pool leaves (`reserved_share`);
    beyond it, its Hellos go to the pool. Reserved sessions may take any free room;
  * the shared *pool*: everybody else (unbound ids, bound ids no exposure names, every
    session without a token), at most half the table (`pool_size`), at most a quarter
    of the pool per network address (`per_source`).

So a flood of fresh keys and ids, from any number of addresses, fills the pool at most:
the other half stays for named instances, and a pooled Hello never evicts a reserved
session. Further bounds (a Hello flood cannot grow memory or evict a peer in use):

  * each Hello nonce is answered once (a replayed Hello is refused), within a bounded
    memory of recent nonces;
  * at most `MAX_PER_PEER` sessions per decode worker, `max_sessions` in all;
  * room is made by evicting the least recently used *inactive* session of the part a
    Hello may take room from (a named one: pool first, then reserved); a session is
    active while it is young (`grace_s`: its first pull may still be in flight), while
    it notified within `active_s`, or while its instance reads a pinned request. When
    every candidate is active a new Hello is refused ("busy").

Owned by one `KVProducer`; single-threaded.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from dataclasses import dataclass

from kvbridge.plan.planner import TransferPlan
from kvbridge.transfer.auth import session_id, session_key

#: Sessions kept per decode worker (instance id, rank): re-handshakes after failures.
MAX_PER_PEER = 4
#: Hello nonces remembered to refuse replays.
MAX_NONCES = 1 << 16


@dataclass
class Session:
    instance_id: str
    rank: int
    plan: TransferPlan
    key: bytes
    created: float
    last_notified: float | None = None
    #: the ZMQ routing id of the decode worker's side channel (`ReadAck`s go there)
    peer: bytes = b""
    #: the network address the Hello came from ("" if unknown)
    source: str = ""
    #: the Hello's instance id is bound to the key its connection proved it holds
    bound: bool = False
    #: in the reserved part of the table (its instance was named by a live exposure)
    reserved: bool = False


class SessionRefused(Exception):
    """A Hello the table will not take; `kind` and the message go into a `Refused`."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


class SessionTable:
    """One prefill worker's sessions, reserved and pooled (see above); owned by its
    `KVProducer`, which tells it which Hellos come from a named instance (`open`) and
    which instances an exposure names (`reserve`)."""

    def __init__(
        self,
        *,
        token: bytes | None,
        me: tuple[str, int],
        max_sessions: int,
        grace_s: float,
        active_s: float,
        clock: Callable[[], float],
    ) -> None:
        self._token, self._me = token, me
        self.max_sessions, self.grace_s, self.active_s = max_sessions, grace_s, active_s
        self._clock = clock
        self._sessions: collections.OrderedDict[bytes, Session] = collections.OrderedDict()
        self._nonces: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def pool_size(self) -> int:
        """Sessions the shared pool holds at most: half the table."""
        return max(1, self.max_sessions // 2)

    @property
    def per_source(self) -> int:
        """Pooled sessions one network address holds at most: a quarter of the pool."""
        return max(1, self.pool_size // 4)

    @property
    def reserved_share(self) -> int:
        """Reserved sessions one named instance holds at most: a quarter of the room
        the pool leaves."""
        return max(MAX_PER_PEER, (self.max_sessions - self.pool_size) // 4)

    def key_of(self, sid: bytes) -> bytes | None:
        """The key of session `sid` (a `messages.KeyLookup`), or None if unknown."""
        s = self._sessions.get(sid)
        return s.key if s is not None else None

    def get(self, sid: bytes) -> Session | None:
        return self._sessions.get(sid)

    def peers(self) -> set[tuple[str, int]]:
        return {(s.instance_id, s.rank) for s in self._sessions.values()}

    def num_reserved(self, instance_id: str | None = None) -> int:
        """Reserved sessions (of `instance_id`, if given)."""
        return sum(
            s.reserved and instance_id in (None, s.instance_id) for s in self._sessions.values()
        )

    def open(
        self,
        instance_id: str,
        rank: int,
        hello_nonce: bytes,
        plan: TransferPlan,
        reading: Callable[[str], bool],
        peer: bytes = b"",
        source: str = "",
        *,
        bound: bool = False,
        named: bool = False,
    ) -> tuple[bytes, bytes]:
        """A new session for a Hello that came from side-channel client `peer` at
        network address `source`; returns (session id, our nonce). `reading(iid)` tells
        whether instance `iid` reads a pinned request. `bound`: the Hello's id is bound
        to the key its connection proved; `named` (bound too): a live exposure names its
        instance, so it may take reserved room. Raises SessionRefused."""
        assert bound or not named, "only a bound id can be named"
        if hello_nonce in self._nonces:
            raise SessionRefused(
                "replay", "this Hello's nonce was answered before: a replayed handshake"
            )
        self._nonces[hello_nonce] = None
        while len(self._nonces) > MAX_NONCES:
            self._nonces.popitem(last=False)
        now = self._clock()
        own = [
            sid
            for sid, s in self._sessions.items()
            if (s.instance_id, s.rank) == (instance_id, rank)
        ]
        if len(own) >= MAX_PER_PEER and not self._evict(own, now, reading):
            raise SessionRefused(
                "busy",
                f"decode worker {instance_id!r} rank {rank} already has "
                f"{len(own)} sessions in use here",
            )
        reserved = named and self._room_reserved(instance_id, now, reading)
        if not reserved:
            self._room_in_pool(source, now, reading)
        nonce = os.urandom(16)
        key = session_key(self._token, hello_nonce, nonce, (instance_id, rank), self._me)
        sid = session_id(key)
        self._sessions[sid] = Session(
            instance_id,
            rank,
            plan,
            key,
            now,
            peer=peer,
            source=source,
            bound=bound,
            reserved=reserved,
        )
        return sid, nonce

    def reserve(self, instance_id: str) -> None:
        """A live exposure names `instance_id` now: its bound sessions move to the
        reserved part (within its share), where no pooled Hello may evict them."""
        room = self.reserved_share - self.num_reserved(instance_id)
        for s in self._sessions.values():
            if room <= 0:
                break
            if s.instance_id == instance_id and s.bound and not s.reserved:
                s.reserved, room = True, room - 1

    def touch(self, sid: bytes) -> None:
        """Session `sid` just notified: it is in use."""
        s = self._sessions.get(sid)
        if s is not None:
            s.last_notified = self._clock()
            self._sessions.move_to_end(sid)

    def _room_reserved(self, instance_id: str, now: float, reading: Callable[[str], bool]) -> bool:
        """Make room for a named instance's session in the reserved part; False if
        its share is used up (it then competes in the pool). Raises SessionRefused when
        the whole table is in use."""
        mine = [
            sid for sid, s in self._sessions.items() if s.reserved and s.instance_id == instance_id
        ]
        if len(mine) >= self.reserved_share and not self._evict(mine, now, reading):
            return False
        if len(self._sessions) < self.max_sessions:
            return True
        pooled = [sid for sid, s in self._sessions.items() if not s.reserved]
        reserved = [sid for sid, s in self._sessions.items() if s.reserved]
        if not self._evict(pooled + reserved, now, reading):
            raise SessionRefused(
                "busy",
                f"all {self.max_sessions} handshake sessions of this prefill worker "
                "are in use; try again later",
            )
        return True

    def _room_in_pool(self, source: str, now: float, reading: Callable[[str], bool]) -> None:
        """Make room for a session in the shared pool, or raise SessionRefused."""
        pooled = [sid for sid, s in self._sessions.items() if not s.reserved]
        same = [sid for sid in pooled if source and self._sessions[sid].source == source]
        if len(same) >= self.per_source and not self._evict(same, now, reading):
            raise SessionRefused(
                "busy",
                f"{len(same)} handshake sessions of this prefill worker come from {source} "
                f"already, all in use (at most {self.per_source} per address in the shared "
                "pool); try again later",
            )
        if len(same) >= self.per_source:  # one was evicted: the pool shrank with it
            return
        if (
            len(pooled) >= self.pool_size or len(self._sessions) >= self.max_sessions
        ) and not self._evict(pooled, now, reading):
            raise SessionRefused(
                "busy",
                f"all {self.pool_size} handshake sessions of this prefill worker's shared "
                "pool are in use; try again later (room is kept for decode instances that "
                "a pending request names by an id bound to their own key)",
            )

    def _evict(self, candidates: list[bytes], now: float, reading: Callable[[str], bool]) -> bool:
        """Drop the least recently used inactive session among `candidates` (table order
        is LRU); False if all are active."""
        for sid in candidates:
            s = self._sessions[sid]
            young = now - s.created < self.grace_s
            recent = s.last_notified is not None and now - s.last_notified < self.active_s
            if not (young or recent or reading(s.instance_id)):
                del self._sessions[sid]
                return True
        return False
