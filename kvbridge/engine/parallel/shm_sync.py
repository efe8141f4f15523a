"""The synchronisation protocol under `ShmCommunicator`: arrival flags, slot headers, abort.

Protocol of one collective (all ranks count collectives alike: seq = 2, 3, ...; the
connect barrier is seq 1), with buffer b = seq % 2 and W ranks:

    every rank r (writer side)              every rank r (reader side)
    1. copy its tensor -> slot[b][r].data
    2. slot[b][r].header = (seq, op, nbytes, dtype)
    3. fence
    4. ctrl[r].arrived = seq  ------------> 5. wait until ctrl[j].arrived >= seq, all j
                                            6. fence
                                            7. check slot[b][j].header == (seq, op, ...)
                                            8. read slot[b][0..W-1] in rank order

Why two buffers and no "done reading" flags: rank r writes buffer b again at seq + 2
only after passing step 5 of seq + 1, i.e. after every rank arrived at seq + 1; a rank
arrives at seq + 1 only after it finished step 8 of seq. So nobody still reads buffer b
when it is overwritten, however ranks are delayed or preempted. The other buffer lets a
fast rank publish seq + 1 while slow ones still read seq. Step 7 turns any violation of
this (or an SPMD mismatch between ranks) into an error instead of silently stale data.

Ordering: on x86-64 (TSO) stores become visible in program order and loads are not
reordered with loads, which is all steps 1-4 / 5-8 need; the fence (an uncontended lock
acquire/release, a locked instruction on x86) also stops the compiler and CPU from moving
the flag store. Other CPUs (aarch64) are untested. Flags are aligned int64 words, each
written by its own rank only (the abort word by whichever rank fails first; any one is a
valid root cause), so their loads and stores are single-copy atomic.

Waiting spins `spin_iters` polls, then yields the core (`os.sched_yield`, essential when
ranks outnumber cores), then sleeps briefly once a wait passes 20 ms. Every ~100 ms of
waiting it checks the pids of the ranks it waits for, so a dead peer fails the collective
within ~0.1-0.2 s; any failure aborts the group (a flag every waiter polls), so the other
ranks fail promptly too, naming the rank at the root of it.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time

import numpy as np

from kvbridge.engine.parallel.errors import (
    CommError,
    CommMismatchError,
    CommTimeoutError,
    PeerAbortedError,
    PeerDiedError,
)
from kvbridge.engine.parallel.shm_segment import (
    C_ARRIVED,
    C_PID,
    CTRL_BYTES,
    H_ABORT,
    REASON_BYTES,
    SegmentLayout,
    is_process_alive,
)

OP_CONNECT, OP_BARRIER, OP_ALL_REDUCE, OP_ALL_GATHER, OP_BROADCAST = 1, 2, 3, 4, 5
OP_NAMES = {1: "connect", 2: "barrier", 3: "all_reduce", 4: "all_gather", 5: "broadcast"}
_HEADER = struct.Struct("<4q")
PROBE_INTERVAL_S = 0.1
YIELD_PHASE_S = 0.02
MAX_SLEEP_S = 0.001

_fence_lock = threading.Lock()


def memory_fence() -> None:
    """Acquire and release an uncontended lock: a locked instruction (full barrier on x86)
    the compiler cannot move loads or stores across."""
    _fence_lock.acquire()
    _fence_lock.release()


class ShmArrivals:
    """One rank's side of the protocol over a mapped segment: counts collectives,
    publishes this rank's arrival, waits for the others, aborts the group on failure.

    Owned by a `ShmCommunicator`; the data slots are its business. After any `CommError`
    `broken` says why and every later call refuses at once.
    """

    def __init__(
        self,
        mm: mmap.mmap,
        layout: SegmentLayout,
        rank: int,
        *,
        timeout: float,
        spin_iters: int,
    ) -> None:
        self.rank = rank
        self.world_size = layout.world_size
        self.timeout = timeout
        self.spin_iters = spin_iters
        self.seq = 0  # collectives this rank has started
        self.broken: str | None = None
        self._mm = mm
        self._layout = layout
        # int64 words of the segment: flags are read and written one aligned word at a time
        self._words = memoryview(mm).cast("q")
        ctrl_words = [(layout.ctrl_offset + r * CTRL_BYTES) // 8 for r in range(self.world_size)]
        self._pid_words = [w + C_PID for w in ctrl_words]
        self._arrived_words = [w + C_ARRIVED for w in ctrl_words]
        # slot_headers[b]: (W, 4) int64 view of the slot headers of buffer b
        self._slot_headers = [
            np.ndarray(
                (self.world_size, 4),
                dtype=np.int64,
                buffer=mm,
                offset=layout.slot_offset(b, 0),
                strides=(layout.slot_stride, 8),
            )
            for b in range(2)
        ]
        self._words[self._pid_words[rank]] = os.getpid()

    @property
    def next_buffer(self) -> int:
        """The buffer (0 or 1) the next collective's data goes to."""
        return (self.seq + 1) % 2

    def arrive_and_wait(
        self, op: int, nbytes: int, dtype_code: int, timeout: float | None = None
    ) -> None:
        """Steps 2-7 for this rank's next collective (its data is already in its slot).
        Returns when every rank's data for it is readable; raises `CommError` otherwise."""
        if self.broken is not None:
            raise CommError(f"communicator rank {self.rank} is unusable: {self.broken}")
        self.seq += 1
        seq = self.seq
        try:
            headers = self._slot_headers[seq % 2]
            expected = (seq, op, nbytes, dtype_code)
            headers[self.rank] = expected
            memory_fence()
            self._words[self._arrived_words[self.rank]] = seq
            self._wait(seq, op, timeout or self.timeout)
            memory_fence()
            if headers.tobytes() != _HEADER.pack(*expected) * self.world_size:
                self._raise_mismatch(headers, expected)
        except CommError as exc:
            self.abort(str(exc))
            raise

    def abort(self, reason: str) -> None:
        """Mark this rank and the group failed; peers waiting now or later raise
        `PeerAbortedError` quoting `reason`. Idempotent."""
        if self.broken is None:
            self.broken = f"rank {self.rank} aborted the group: {reason}"
        if self._mm.closed:
            return
        raw = reason.encode("utf-8", "replace")[: REASON_BYTES - 1]
        start = self._reason_offset(self.rank)
        self._mm[start : start + len(raw) + 1] = raw + b"\0"
        memory_fence()
        if self._words[H_ABORT] == 0:
            self._words[H_ABORT] = self.rank + 1

    def release(self) -> None:
        """Drop every view of the mapping (so it can be closed)."""
        self.broken = self.broken or "the communicator was closed"
        self._words.release()
        self._slot_headers = []

    def _reason_offset(self, rank: int) -> int:
        return self._layout.ctrl_offset + rank * CTRL_BYTES + 64

    def _wait(self, seq: int, op: int, timeout: float) -> None:
        words = self._words
        for word in self._arrived_words:
            if words[word] >= seq:
                continue
            for _ in range(self.spin_iters):
                if words[word] >= seq:
                    break
            else:
                self._wait_slow(seq, op, timeout)
                return

    def _wait_slow(self, seq: int, op: int, timeout: float) -> None:
        words = self._words
        start = time.monotonic()
        next_probe = start + PROBE_INTERVAL_S
        sleep_s = 0.0001
        while any(words[word] < seq for word in self._arrived_words):
            if words[H_ABORT]:
                self._raise_aborted(seq, op)
            now = time.monotonic()
            if now >= next_probe:
                self._probe_peers(seq, op, now - start, timeout)
                next_probe = now + PROBE_INTERVAL_S
            if now - start < YIELD_PHASE_S:
                os.sched_yield()
            else:
                time.sleep(sleep_s)
                sleep_s = min(sleep_s * 2, MAX_SLEEP_S)

    def _probe_peers(self, seq: int, op: int, waited: float, timeout: float) -> None:
        missing = [r for r in range(self.world_size) if self._words[self._arrived_words[r]] < seq]
        for peer in missing:
            pid = self._words[self._pid_words[peer]]
            if pid and not is_process_alive(pid):
                raise PeerDiedError(
                    f"rank {self.rank}: {OP_NAMES[op]} #{seq} cannot complete: "
                    f"rank {peer} (pid {pid}) died",
                    rank=peer,
                )
        if waited >= timeout and missing:
            raise CommTimeoutError(
                f"rank {self.rank}: {OP_NAMES[op]} #{seq} timed out after {timeout:.1f} s "
                f"waiting for ranks {missing} (timeout={timeout} s); are all ranks making "
                "the same collectives?",
                missing_ranks=missing,
            )

    def _raise_aborted(self, seq: int, op: int) -> None:
        peer = self._words[H_ABORT] - 1
        start = self._reason_offset(peer)
        raw = bytes(self._mm[start : start + REASON_BYTES])
        reason = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
        raise PeerAbortedError(
            f"rank {self.rank}: {OP_NAMES[op]} #{seq} cannot complete: rank {peer} "
            f"aborted the group: {reason}",
            rank=peer,
        )

    def _raise_mismatch(self, headers: np.ndarray, expected: tuple[int, int, int, int]) -> None:
        seq, op, nbytes, code = expected
        for peer in range(self.world_size):
            got = tuple(int(v) for v in headers[peer])
            if got[0] != seq:
                raise CommError(
                    f"rank {self.rank}: slot of rank {peer} holds collective #{got[0]} "
                    f"while #{seq} was expected (protocol violation)"
                )
            if got != expected:
                raise CommMismatchError(
                    f"rank {self.rank}: collective #{seq} mismatch: this rank called "
                    f"{OP_NAMES[op]}(nbytes={nbytes}, dtype code {code}) but rank {peer} "
                    f"called {OP_NAMES.get(got[1], '?')}(nbytes={got[2]}, dtype code "
                    f"{got[3]}); all ranks must call the same collectives with the same shapes"
                )
