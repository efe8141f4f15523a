"""One pull a decode worker holds, and its outcome.

A pull is held from `KVConsumer.pull` (or `decline`) until its outcome is reported:
`ActivePull` is its state while held, `TransferResult` the outcome `KVConsumer.poll`
reports once, `TransferState` where it stands and `PullFailure` the cause a counter
tells apart. Plain data: the consumer's parts (`pull_planner.PullPlanner` posts its
READs, `pull_progress.PullProgress` advances and ends it) change it, from the one thread
that calls the consumer. `DecodeWorker` is what every part knows of the worker.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.plan.copylist import CopyList
from kvbridge.transfer.agent import Transport
from kvbridge.transfer.config import TransferConfig
from kvbridge.transfer.fence import FenceRead
from kvbridge.transfer.peers import PeerState, ProducerInstance
from kvbridge.transfer.regions import CacheRegions

#: How often an ended pull retries releasing a READ NIXL could not cancel (seconds).
RELEASE_RETRY_S = 1.0
#: `ActivePull.xfers` key of a READ from a sibling's cache (the second hop of a fan-out)
LOCAL = -1


@dataclass(frozen=True)
class DecodeWorker:
    """The decode worker a `KVConsumer` serves, as each of its parts knows it: its rank
    and instance, its cache (`regions`, `num_blocks` blocks) registered with
    `transport`, its config and its clock."""

    rank: int
    instance_id: str
    regions: CacheRegions
    num_blocks: int
    transport: Transport
    config: TransferConfig
    clock: Callable[[], float]


class PullFailure(enum.Enum):
    """Why a pull failed, where a counter tells it apart (else it has no cause)."""

    STALE = "stale"  # a producer did not hold the exposure for the whole read
    INTEGRITY = "integrity"  # the bytes read differ from the producer's digest of them


class TransferState(enum.Enum):
    """Where a pull stands; DONE and FAILED are reported once, in a `TransferResult`."""

    HANDSHAKING = "handshaking"  # waiting for the producer's workers to answer
    READING = "reading"  # READs posted
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class PullPhases:
    """Where one pull's time went, in seconds of `time.perf_counter`, phase after phase
    from `KVConsumer.pull` to its outcome (a figure for benchmarks and logs, never for
    a decision; a phase the pull never reached is 0):

        queued   pull() -> its READs are planned: the handshake, or the next poll
        post     copy lists, descriptor indices, the READs posted (with UCX's cma
                 transport the copy runs inside the post: post holds most of a READ)
        read     posted -> every READ seen done by a poll
        digest   hashing the bytes read (a checked pull, `integrity.py`)
        confirm  -> every producer worker read answered held (`ReadAck`): the ReadDone
                 notification, the producer's fence check (and its digest), the answer
        cast     converting the bytes read from the staging into the cache (a plan
                 between two KV dtypes, `staging.py`)
    """

    queued_s: float = 0.0
    post_s: float = 0.0
    read_s: float = 0.0
    digest_s: float = 0.0
    confirm_s: float = 0.0
    cast_s: float = 0.0

    @property
    def total_s(self) -> float:
        return (
            self.queued_s + self.post_s + self.read_s + self.digest_s + self.confirm_s + self.cast_s
        )

    @property
    def ms(self) -> tuple[float, ...]:
        """The phases in milliseconds, in their order (for a log line or a report)."""
        phases = (
            self.queued_s,
            self.post_s,
            self.read_s,
            self.digest_s,
            self.confirm_s,
            self.cast_s,
        )
        return tuple(round(s * 1e3, 3) for s in phases)


@dataclass
class PullClock:
    """The instants a pull reached each phase (`time.perf_counter`), set by the
    consumer's parts as it goes; `phases` turns them into a `PullPhases`."""

    pulled: float = field(default_factory=time.perf_counter)
    posting: float = 0.0  # its READs began to be planned
    posted: float = 0.0  # every READ posted
    read: float = 0.0  # every READ seen done
    digest_s: float = 0.0  # hashing what was read
    cast_s: float = 0.0  # casting what was read into the cache

    def phases(self, now: float) -> PullPhases:
        """The phases up to `now` (the outcome), each the gap to the last mark reached."""
        marks = [self.pulled, self.posting, self.posted, self.read]
        reached = [m for m in marks if m]
        gaps = [b - a for a, b in zip(reached, [*reached[1:], now], strict=True)]
        gaps += [0.0] * (len(marks) - len(gaps))
        return PullPhases(
            queued_s=gaps[0],
            post_s=gaps[1],
            read_s=gaps[2],
            digest_s=self.digest_s,
            confirm_s=max(gaps[3] - self.digest_s - self.cast_s, 0.0),
            cast_s=self.cast_s,
        )


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
    checked: bool = False  # its bytes were checked against the producers' digests
    phases: PullPhases = PullPhases()
    handshake: bool = False  # it waited for a handshake with its producer instance
    cold_peers: int = 0  # producer workers it was the first READ from (`ActivePull`)
    fenced: int = 0  # producer workers whose fence word confirmed it (`fence.py`)


@dataclass
class ActivePull:
    """One pull (or decline) a `KVConsumer` holds, from `pull` until its outcome is
    reported: its blocks stay the consumer's until then."""

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
    is_state: bool = False  # its blocks hold a per-request state, read whole (`Pull`)
    state: TransferState = TransferState.HANDSHAKING
    xfers: dict[int, tuple[int, Any]] = field(default_factory=dict)  # i -> (prefill rank, READ)
    temp_dlists: list[Any] = field(default_factory=list)
    notified: set[int] = field(default_factory=set)  # prefill ranks told we are done
    # prefill ranks read by more than one READ: none carries the notification; it
    # follows the last
    silent: set[int] = field(default_factory=set)
    # prefill ranks we read bytes from that have not yet answered held (`ReadAck`)
    awaiting: set[int] = field(default_factory=set)
    # prefill rank -> the READ of its fence word, posted once its READs are done, until
    # it is checked (`fence.py`)
    fences: dict[int, FenceRead] = field(default_factory=dict)
    fenced: int = 0  # prefill ranks whose fence word confirmed the pull
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
    clock: PullClock = field(default_factory=PullClock)  # where its time went
    #: its producer instance was not met when it began: it waited for the handshake
    handshake: bool = False
    #: producer workers it read from that no READ had crossed before (cold paths)
    cold_peers: int = 0

    @property
    def awaiting_acks(self) -> bool:
        """Every READ done; waiting for the producers' ReadAcks."""
        return self.state is TransferState.READING and not self.xfers and bool(self.awaiting)

    def timeout_reason(self, transfer_timeout_s: float) -> str:
        """Why this pull timed out after `transfer_timeout_s`: what it was waiting for."""
        t = f"timed out after {transfer_timeout_s:g} s"
        if self.awaiting_acks:
            return (
                f"{t} waiting for prefill workers {sorted(self.awaiting)} to confirm they held "
                f"{self.request_id!r} for the whole read (ReadAck)"
            )
        if self.source is not None and not self.local_posted:
            return (
                f"{t} waiting for decode worker {self.source}, which reads these bytes over "
                "the link for this worker, to have them (LocalReady)"
            )
        if self.source is not None and self.xfers:
            return f"{t} copying from decode worker {self.source}'s cache on this host"
        if self.source is not None:
            return (
                f"{t} waiting for the producers to confirm the bytes decode worker "
                f"{self.source} read for this worker"
            )
        if self.state is TransferState.READING:
            return f"{t} reading from prefill workers {sorted({p for p, _ in self.xfers.values()})}"
        waiting = [w.endpoint for w in self.instance.workers() if w.state is not PeerState.READY]
        return f"{t} waiting for handshakes with {sorted(set(waiting))}"
