"""The progress thread: a worker's transfers advance while its engine computes.

NIXL runs here without its own progress thread (NIXL's spins a core per agent even when
idle), so a READ of a worker's memory, a notification to it and the side channel's
handshakes advance only while that worker polls its agent. An engine's main thread
polls only between its calls (forward steps of tens to hundreds of milliseconds), so a
pull would wait for the steps of the requests already running. `ProgressThread` polls
instead, in its own thread, at the cadence the connector's state asks for:

    pending transfer        poll every `step()`'s answer (1 ms), woken at once by new work
    idle producer           every 50 ms (handshakes); 0.5 s after 10 s of nothing
    idle consumer           every 0.5 s; blocked on an Event in between (no spin)

Thread safety: NIXL's agent is made with `NIXL_THREAD_SYNC_NONE` (no lock of its own) and
then runs its UCX worker in UCX's SERIALIZED mode: any thread may call it, one at a time.
The owner therefore runs `step` under the same lock as every other use of the agent, the
producer and the consumer (`WorkerConnector` does). NIXL's bindings release the GIL in
`transfer`, `check_xfer_state`, `get_new_notifs` and `send_notif`, so a copy posted here
does not stop the engine's Python; the lock is held only for one poll (tens of
microseconds to a READ's copy), never while waiting.

A `step` that raises stops the thread; `failure` says why, and the owner reports it to
whoever calls next (nothing hangs: a pull that would have finished fails with it).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator
from time import monotonic

log = logging.getLogger("kvbridge.transfer.progress")

#: How long `close` waits for the thread to end its current poll (one poll is bounded).
JOIN_TIMEOUT_S = 10.0
#: A wake-up later than this past its time is logged: the host did not run the thread.
LATE_WAKE_S = 2.0
#: prctl's option that names the calling thread (linux/prctl.h)
PR_SET_NAME = 15


@contextlib.contextmanager
def threads_on_every_cpu() -> Iterator[None]:
    """Threads started inside may run on every CPU of the host, whichever core the
    calling thread is pinned to. A thread inherits its creator's CPUs, and vLLM's CPU
    workers pin theirs to one core each (VLLM_CPU_OMP_THREADS_BIND), so UCX's, ZMQ's and
    the progress thread made by a connector there shared that core with the worker's
    compute and whatever else was pinned to it: on the 2-core host, with a vLLM pair of
    5 workers, a prefill worker's progress thread woke 7-40 s late and handshakes went
    unanswered for 180 s (docs/vllm.md). The caller's own pinning is restored after."""
    getter = getattr(os, "sched_getaffinity", None)
    setter = getattr(os, "sched_setaffinity", None)
    if getter is None or setter is None:  # not Linux: nothing is pinned this way
        yield
        return
    pinned = getter(0)
    every = set(range(os.cpu_count() or 1))
    try:
        if not pinned >= every:
            setter(0, every)
    except OSError as exc:  # a cpuset that forbids it: the threads keep the caller's CPUs
        log.warning("cannot widen this thread's CPUs %s for the transfer threads: %s", pinned, exc)
    try:
        yield
    finally:
        if getter(0) != pinned:
            setter(0, pinned)


def name_this_thread(name: str) -> None:
    """Give the calling thread `name` (its first 15 bytes) where the OS shows thread
    names (Linux: top -H, perf, /proc/PID/task/TID/comm); elsewhere nothing. A thread
    otherwise shows its process's name, and in a vLLM worker it is "VLLM::Worker"."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


class ProgressThread:
    """Runs `step()` again after the number of seconds it returns, or at once after
    `wake()`; owned by one `WorkerConnector` (started with it, joined by `close`).

    `step` is called from this thread only and must take the owner's lock itself.
    State for tests and metrics: `num_polls` (steps run), `num_sleeps` (waits begun),
    `is_waiting` and `wait_s` (blocked now, and for at most how long).
    """

    def __init__(self, step: Callable[[], float], name: str) -> None:
        self._step = step
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.num_polls = 0
        self.num_sleeps = 0
        self.num_late_wakes = 0  # waits that ended more than LATE_WAKE_S past their time
        self.is_waiting = False  # True while blocked between two polls
        self.wait_s = 0.0  # the longest the current (or last) wait lasts
        self._due = math.inf  # when the thread is to poll next (`late_s`); not yet begun
        self.failure: str | None = None  # why `step` raised, if it did; the thread ended
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> ProgressThread:
        self._thread.start()
        return self

    def wake(self) -> None:
        """Poll now: new work arrived (a pull, an exposure, an introduction)."""
        self._due = min(self._due, monotonic())
        self._wake.set()

    def late_s(self) -> float:
        """How long past its time the thread's next poll is (0 if not due yet); from
        another thread, which cannot run while the thread's poll holds the owner's lock."""
        return max(0.0, monotonic() - self._due)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float = JOIN_TIMEOUT_S) -> bool:
        """Stop and join the thread; False if it did not end within `timeout_s`."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        name_this_thread(self._thread.name)
        while not self._stop.is_set():
            self._wake.clear()  # a wake() from here on is seen by the next wait
            try:
                wait_s = self._step()
            except Exception as exc:  # reported by the owner to its next caller
                self.failure = f"{type(exc).__name__}: {exc}"
                log.exception("transfer progress thread %s failed", self._thread.name)
                return
            self.num_polls += 1
            if self._stop.is_set():
                return
            self.num_sleeps += 1
            self.wait_s = max(wait_s, 0.0)
            self.is_waiting = True
            began = monotonic()
            self._due = began + self.wait_s
            woken = self._wake.wait(self.wait_s)
            self.is_waiting = False
            late = monotonic() - began - (0.0 if woken else self.wait_s)
            if late > LATE_WAKE_S:  # the host starved this thread: say so, once per event
                self.num_late_wakes += 1
                log.warning(
                    "transfer progress thread %s ran %.1f s later than asked (a starved "
                    "host: its transfers, handshakes and leases waited as long)",
                    self._thread.name,
                    late,
                )
