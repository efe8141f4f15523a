"""A producer worker's handshake sessions: one per decode worker Hello it answered.

A session binds one decode worker (instance id, rank) to its plan and to a key that
only the two workers know (`auth.session_key`: the token, both fresh nonces and both
identities). Every completion notification must be signed with a session's key and
comes from that session's worker; so a Hello can never replace another peer's plan,
it only adds a session of its own. Bounds (a Hello flood cannot grow memory or evict
a peer in use):

  * each Hello nonce is answered once (a replayed Hello is refused), within a bounded
    memory of recent nonces;
  * at most `MAX_PER_PEER` sessions per decode worker, a quarter of `max_sessions` per
    network address they come from (so a flood from one host, even of fresh keys and
    bound ids, leaves room for the others), `max_sessions` in all;
  * room is made by evicting the least recently used *inactive* session; a session is
    active while it is young (`grace_s`: its first pull may still be in flight), while
    it notified within `active_s`, or while its instance reads a pinned request. When
    every session is active a new Hello is refused ("busy").

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


class SessionRefused(Exception):
    """A Hello the table will not take; `kind` and the message go into a `Refused`."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


class SessionTable:
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

    def key_of(self, sid: bytes) -> bytes | None:
        """The key of session `sid` (a `messages.KeyLookup`), or None if unknown."""
        s = self._sessions.get(sid)
        return s.key if s is not None else None

    def get(self, sid: bytes) -> Session | None:
        return self._sessions.get(sid)

    def peers(self) -> set[tuple[str, int]]:
        return {(s.instance_id, s.rank) for s in self._sessions.values()}

    def open(
        self,
        instance_id: str,
        rank: int,
        hello_nonce: bytes,
        plan: TransferPlan,
        reading: Callable[[str], bool],
        peer: bytes = b"",
        source: str = "",
    ) -> tuple[bytes, bytes]:
        """A new session for a Hello that came from side-channel client `peer` at
        network address `source`; returns (session id, our nonce). `reading(iid)` tells
        whether instance `iid` reads a pinned request. Raises SessionRefused."""
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
        per_source = max(1, self.max_sessions // 4)
        same = [sid for sid, s in self._sessions.items() if source and s.source == source]
        if len(same) >= per_source and not self._evict(same, now, reading):
            raise SessionRefused(
                "busy",
                f"{len(same)} handshake sessions of this prefill worker come from {source} "
                f"already, all in use (at most {per_source} per address); try again later",
            )
        if len(self._sessions) >= self.max_sessions and not self._evict(
            list(self._sessions), now, reading
        ):
            raise SessionRefused(
                "busy",
                f"all {self.max_sessions} handshake sessions of this prefill worker "
                "are in use; try again later",
            )
        nonce = os.urandom(16)
        key = session_key(self._token, hello_nonce, nonce, (instance_id, rank), self._me)
        sid = session_id(key)
        self._sessions[sid] = Session(instance_id, rank, plan, key, now, peer=peer, source=source)
        return sid, nonce

    def touch(self, sid: bytes) -> None:
        """Session `sid` just notified: it is in use."""
        s = self._sessions.get(sid)
        if s is not None:
            s.last_notified = self._clock()
            self._sessions.move_to_end(sid)

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
