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

Waiting spins `spin_iters` polls (only when every rank can hold a core), then sleeps in
the kernel: the rank marks itself sleeping (ctrl[r].sleeping = seq), fences, checks the
flags once more and blocks in poll() on the wake FIFO of buffer b. A rank that arrives,
fences and sees every rank arrived is a last arriver: if any rank sleeps on seq it sets
header.woken[b] = seq and writes one byte to that FIFO, which wakes every sleeper at
once (one syscall, however many ranks). Both sides store, fence, then load, so either
the sleeper sees the last arrival or the last arriver sees the sleeper: no lost wake-up.

Nobody drains a byte when it is written; a byte left in FIFO b is stale once seq is
complete, and the next sleeper on b (seq + 2 or later) that is woken by it while the
flags are incomplete drains it. If woken[b] changed to its own seq during the drain, it
may have eaten that real wake-up, so it writes a byte back. Sleeping instead of spinning
or yielding matters when ranks outnumber cores (tp 9 on 2 cores): a waiting rank then
takes no CPU time from the ranks still computing.

Every ~100 ms of waiting a sleeper checks the pids of the ranks it waits for, so a dead
peer fails the collective within ~0.1-0.2 s; any failure aborts the group (a flag every
waiter checks, plus a byte in both FIFOs), so the other ranks fail promptly too, naming
the rank at the root of it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
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
    C_SLEEPING,
    CTRL_BYTES,
    H_ABORT,
    H_WOKEN,
    REASON_BYTES,
    SHM_DIR,
    WAKE_SUFFIXES,
    SegmentLayout,
    is_process_alive,
)

OP_CONNECT, OP_BARRIER, OP_ALL_REDUCE, OP_ALL_GATHER, OP_BROADCAST = 1, 2, 3, 4, 5
OP_NAMES = {1: "connect", 2: "barrier", 3: "all_reduce", 4: "all_gather", 5: "broadcast"}
_HEADER = struct.Struct("<4q")
PROBE_INTERVAL_S = 0.1
SPIN_ITERS = 16

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
        name: str,
        mm: mmap.mmap,
        layout: SegmentLayout,
        rank: int,
        *,
        timeout: float,
        spin_iters: int | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = layout.world_size
        self.timeout = timeout
        if spin_iters is None:
            # spinning pays only when every rank can hold a core; otherwise a spinning
            # rank takes the core that a rank it waits for needs
            spin_iters = SPIN_ITERS if self.world_size <= len(os.sched_getaffinity(0)) else 0
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
        self._sleeping_words = [w + C_SLEEPING for w in ctrl_words]
        # O_RDWR: opening a FIFO this way never blocks, and it is never "closed" under us
        self._wake_fds = [
            os.open(SHM_DIR / f"{name}{suffix}", os.O_RDWR | os.O_NONBLOCK)
            for suffix in WAKE_SUFFIXES
        ]
        self._pollers = []
        for fd in self._wake_fds:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            self._pollers.append(poller)
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
            memory_fence()
            if self._all_arrived(seq):
                self._wake_sleepers(seq)
            else:
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
        memory_fence()
        for fd in self._wake_fds:  # every sleeper wakes and sees the abort
            with contextlib.suppress(OSError):
                os.write(fd, b"a")

    def release(self) -> None:
        """Drop every view of the mapping (so it can be closed)."""
        self.broken = self.broken or "the communicator was closed"
        for fd in self._wake_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_fds = []
        self._words.release()
        self._slot_headers = []

    def _reason_offset(self, rank: int) -> int:
        return self._layout.ctrl_offset + rank * CTRL_BYTES + 64

    def _all_arrived(self, seq: int) -> bool:
        words = self._words
        for word in self._arrived_words:  # noqa: SIM110 - no generator on this hot path
            if words[word] < seq:
                return False
        return True

    def _wake_sleepers(self, seq: int) -> None:
        """As a last arriver of `seq`: wake every rank sleeping on it, with one write."""
        words = self._words
        if any(words[w] == seq for w in self._sleeping_words):
            buffer = seq % 2
            words[H_WOKEN + buffer] = seq
            memory_fence()
            with contextlib.suppress(BlockingIOError):  # full: plenty of bytes to wake on
                os.write(self._wake_fds[buffer], b"w")

    def _wait(self, seq: int, op: int, timeout: float) -> None:
        for _ in range(self.spin_iters):
            if self._all_arrived(seq):
                return
        self._sleep(seq, op, timeout)

    def _sleep(self, seq: int, op: int, timeout: float) -> None:
        words = self._words
        buffer = seq % 2
        fd, poller = self._wake_fds[buffer], self._pollers[buffer]
        words[self._sleeping_words[self.rank]] = seq
        memory_fence()
        start = time.monotonic()
        next_probe = start + PROBE_INTERVAL_S
        while not self._all_arrived(seq):
            if words[H_ABORT]:
                self._raise_aborted(seq, op)
            now = time.monotonic()
            if now >= next_probe:
                self._probe_peers(seq, op, now - start, timeout)
                next_probe = now + PROBE_INTERVAL_S
            if not poller.poll(max(1, int((next_probe - now) * 1000) + 1)):
                continue
            memory_fence()
            if self._all_arrived(seq) or words[H_WOKEN + buffer] == seq:
                continue  # a real wake-up for this seq: leave its byte to the others
            # a stale byte (an earlier seq of this buffer): drain it, then make sure the
            # drain did not eat this seq's byte, written meanwhile
            with contextlib.suppress(BlockingIOError):
                os.read(fd, 4096)
            memory_fence()
            if words[H_WOKEN + buffer] == seq:
                with contextlib.suppress(BlockingIOError):
                    os.write(fd, b"w")

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
