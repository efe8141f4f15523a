"""The driver's handle on the tensor-parallel worker processes of one instance."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from kvbridge.engine.parallel.errors import (
    ParallelError,
    WorkerDiedError,
    WorkerError,
    WorkerGroupClosedError,
    WorkerStartError,
    WorkerTimeoutError,
)
from kvbridge.engine.parallel.reply_buffer import (
    DEFAULT_CALL_MAX_BYTES,
    DEFAULT_REPLY_MAX_BYTES,
    SHM_MIN_BYTES,
    CallBuffer,
    ReplyBuffer,
)
from kvbridge.engine.parallel.shm_segment import DEFAULT_MAX_BYTES, ShmSegment
from kvbridge.engine.parallel.worker import (
    Kind,
    decode_frame,
    decode_length,
    encode_frame,
    encode_length,
    worker_main,
)

#: on_progress(rank, text): start-up progress of one worker.
ProgressCallback = Callable[[int, str], None]
#: After a first error, how long to wait for the other ranks' answers to find the root cause.
ERROR_GRACE_S = 2.0
STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class CallHandle:
    """One submitted call; pass it to `WorkerGroup.collect`."""

    seq: int
    method: str
    ranks: tuple[int, ...]


@dataclass
class _Answers:
    replies: dict[int, bytes] = field(default_factory=dict)
    errors: dict[int, dict[str, object]] = field(default_factory=dict)

    def count(self) -> int:
        return len(self.replies) + len(self.errors)


#: What multiprocessing's fork server imports once, before it forks each worker: torch
#: and the worker's entry module. A spawned worker imported them itself, which was most
#: of its start-up (seconds of CPU per worker; nine for a tp-9 engine).
FORKSERVER_PRELOAD = ["torch", "kvbridge.engine.parallel.worker"]


def worker_context() -> mp.context.ForkServerContext:
    """Workers fork from multiprocessing's fork server (one per driver process, started
    at its first group; it holds no thread, lock or device state of the driver's): a
    fresh interpreter's state like "spawn", without re-importing torch in each. Each
    worker still takes the driver's `sys.path` and main module, and its environment as it
    is when the group starts (`worker_main` applies it). Other processes that load a
    model's shard (the benchmark's floor ranks) fork from it too."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def _shutdown(
    procs: list[BaseProcess],
    conns: list[Connection],
    segment: ShmSegment,
    buffers: list[CallBuffer | ReplyBuffer],
) -> None:
    """Stop workers (politely, then by force), close pipes, remove shared memory. Idempotent."""
    for proc, conn in zip(procs, conns, strict=True):
        if proc.is_alive() and not conn.closed:
            with contextlib.suppress(OSError):
                conn.send_bytes(encode_frame(Kind.STOP))
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
    for conn in conns:
        conn.close()
    for buffer in buffers:
        buffer.close()
    buffers.clear()
    segment.close()


class WorkerGroup:
    """Spawns `world_size` worker processes and runs calls on all of them.

    Owned and called by one driver thread. Each worker runs `target(ctx)` (a
    "package.module:function" string, imported in the worker) with a `WorkerContext`
    whose `comm` is a connected `ShmCommunicator`; the target initialises itself from
    `ctx.init_payload` and then calls `ctx.serve(handler)`. The constructor returns once
    every worker serves, or raises `WorkerStartError` and leaves nothing running.

    Guarantees: every call reaches every worker, in submission order. A worker that raises
    makes the call raise `WorkerError` (rank + traceback) as soon as the root cause is
    known; a worker that dies makes it raise `WorkerDiedError` (rank + exit code) as soon
    as the driver sees the process end; a call that exceeds its timeout raises
    `WorkerTimeoutError`. After any of these the group is broken (its collectives were
    aborted): further calls raise `WorkerGroupClosedError`; close it and start a new one.
    `close()` (also on context exit and at interpreter exit) leaves no process and no
    /dev/shm file; workers exit by themselves if the driver dies.

    Example::

        # driver
        with WorkerGroup(3, "kvbridge.engine.tp_worker:main", init_payload=config) as group:
            sampled = group.call("step", batch_bytes, ranks=[0])[0]

        # kvbridge/engine/tp_worker.py, in each worker process
        def main(ctx: WorkerContext) -> None:
            runner = ModelRunner(json.loads(ctx.init_payload), ctx.rank, ctx.comm)
            ctx.report_progress("weights loaded")
            ctx.serve(runner.handle)  # handle(method: str, payload: bytes) -> bytes

    Payloads and replies travel through pipes: meant for control messages (token ids,
    block tables, sampled tokens), not bulk tensors. Workers start as fresh interpreters
    (forked from multiprocessing's fork server) and re-import the driver's main module, as
    spawned ones do: a driver script needs `if __name__ == "__main__":`.
    """

    def __init__(
        self,
        world_size: int,
        target: str,
        init_payload: bytes = b"",
        *,
        start_timeout: float = 300.0,
        call_timeout: float = 120.0,
        comm_timeout: float = 60.0,
        comm_max_bytes: int = DEFAULT_MAX_BYTES,
        call_max_bytes: int = DEFAULT_CALL_MAX_BYTES,
        reply_max_bytes: int = DEFAULT_REPLY_MAX_BYTES,
        num_threads: int = 1,
        on_progress: ProgressCallback | None = None,
    ) -> None:
        if world_size < 1:
            raise WorkerStartError(f"world_size={world_size} must be >= 1")
        if ":" not in target:
            raise WorkerStartError(f"target={target!r} must look like 'package.module:function'")
        self.world_size = world_size
        self.target = target
        self.call_timeout = call_timeout
        self._on_progress = on_progress
        self._seq = 0
        self._answers: dict[int, _Answers] = {}
        self._broken: str | None = None
        self._ready: set[int] = set()
        # each rank's last words: the error it sent before exiting (seq 0), by rank
        self._start_errors: dict[int, dict[str, object]] = {}
        self._segment = ShmSegment(world_size, comm_max_bytes)
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._call_buffer = CallBuffer.create(world_size, call_max_bytes)
        self._reply_buffers: list[ReplyBuffer] = []
        buffers: list[CallBuffer | ReplyBuffer] = [self._call_buffer]
        self._finalizer = weakref.finalize(
            self, _shutdown, self._procs, self._conns, self._segment, buffers
        )
        ctx = worker_context()
        try:
            for rank in range(world_size):
                self._reply_buffers.append(ReplyBuffer.create(reply_max_bytes))
                buffers.append(self._reply_buffers[-1])
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=worker_main,
                    args=(
                        rank,
                        world_size,
                        target,
                        init_payload,
                        self._segment.name,
                        child_conn,
                        os.getpid(),
                        comm_timeout,
                        start_timeout,
                        num_threads,
                        self._call_buffer.name,
                        self._reply_buffers[rank].name,
                        dict(os.environ),
                    ),
                    name=f"kvbridge-tp{rank}",
                    daemon=True,
                )
                proc.start()
                child_conn.close()  # the worker holds the only other end: EOF when it dies
                self._procs.append(proc)
                self._conns.append(parent_conn)
                self._progress(rank, f"spawned pid {proc.pid}")
            self._wait_ready(start_timeout)
        except BaseException:
            self._finalizer()
            raise

    @property
    def pids(self) -> list[int]:
        return [proc.pid or 0 for proc in self._procs]

    # ---- calls ------------------------------------------------------------------------

    def call(
        self,
        method: str,
        payload: bytes = b"",
        *,
        ranks: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> list[bytes]:
        """Run `method` on every worker; return the replies of `ranks` (default: all), in
        that order. Workers outside `ranks` still run the call but send no bytes back."""
        return self.collect(self.submit(method, payload, ranks=ranks), timeout=timeout)

    def submit(
        self, method: str, payload: bytes = b"", *, ranks: Sequence[int] | None = None
    ) -> CallHandle:
        """Send a call to every worker without waiting; `collect` its replies later.
        Calls run in submission order; several may be outstanding."""
        self._check_usable()
        wanted = tuple(range(self.world_size)) if ranks is None else tuple(ranks)
        bad = [r for r in wanted if not 0 <= r < self.world_size]
        if bad:
            raise ParallelError(f"ranks={list(wanted)}: {bad} outside [0, {self.world_size})")
        self._seq += 1
        handle = CallHandle(self._seq, method, wanted)
        self._answers[handle.seq] = _Answers()
        shared = SHM_MIN_BYTES <= len(payload) <= self._call_buffer.capacity
        if shared:
            # one copy for all workers; wait (handling replies) until they took the last one
            deadline = time.monotonic() + self.call_timeout
            self._pump(deadline, self._call_buffer.is_free)
            if not self._call_buffer.is_free():
                reason = (
                    f"{method!r}: workers did not take call #{self._call_buffer.last_seq}'s "
                    f"payload within call_timeout={self.call_timeout} s"
                )
                self._fail(reason, WorkerTimeoutError(reason))
            self._call_buffer.write(handle.seq, payload)
            payload = encode_length(len(payload))
        for rank, conn in enumerate(self._conns):
            if rank in wanted:
                kind = Kind.CALL_SHM if shared else Kind.CALL
            else:
                kind = Kind.CALL_NO_REPLY_SHM if shared else Kind.CALL_NO_REPLY
            try:
                conn.send_bytes(encode_frame(kind, handle.seq, method, payload))
            except OSError:
                self._pump(time.monotonic() + 0.5, lambda: False)  # finds the dead rank
                self._fail(f"sending {method!r} to rank {rank} failed", None)
        return handle

    def collect(self, handle: CallHandle, timeout: float | None = None) -> list[bytes]:
        """Wait for every worker's answer to `handle`; raise as described in the class."""
        answers = self._answers.get(handle.seq)
        if answers is None:
            raise ParallelError(f"call #{handle.seq} ({handle.method}) was already collected")
        limit = self.call_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        self._pump(deadline, lambda: answers.count() == self.world_size or bool(answers.errors))
        if answers.errors:
            self._pump(
                min(deadline, time.monotonic() + ERROR_GRACE_S),
                lambda: answers.count() == self.world_size,
            )
            del self._answers[handle.seq]
            self._raise_worker_error(handle, answers)
        if answers.count() < self.world_size:
            missing = [r for r in range(self.world_size) if r not in answers.replies]
            self._broken = f"call #{handle.seq} ({handle.method}) timed out"
            raise WorkerTimeoutError(
                f"{handle.method!r} (call #{handle.seq}) got no answer from ranks {missing} "
                f"within timeout={limit} s; the group is broken, close it"
            )
        del self._answers[handle.seq]
        return [answers.replies[r] for r in handle.ranks]

    def check_alive(self) -> None:
        """Raise WorkerDiedError if a worker process has exited (without waiting), or
        WorkerGroupClosedError if the group is already broken. For a driver that is
        idle between calls and still wants to notice a death."""
        self._check_usable()
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                self._on_death(rank)

    def close(self) -> None:
        """Stop every worker (kill stragglers after a grace period) and remove the
        shared-memory segment. Idempotent."""
        self._broken = self._broken or "the group was closed"
        self._finalizer()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------

    def _progress(self, rank: int, text: str) -> None:
        if self._on_progress is not None:
            self._on_progress(rank, text)

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise WorkerGroupClosedError(
                f"worker group is unusable: {self._broken}; close it and start a new one"
            )

    def _fail(self, reason: str, error: ParallelError | WorkerError | None) -> None:
        self._broken = reason
        raise error or WorkerGroupClosedError(reason)

    def _wait_ready(self, timeout: float) -> None:
        ready = self._ready
        deadline = time.monotonic() + timeout
        try:
            self._pump(deadline, lambda: len(ready) == self.world_size)
        except WorkerDiedError as exc:
            raise WorkerStartError(f"worker start-up failed: {exc}") from exc
        if len(ready) < self.world_size:
            missing = sorted(set(range(self.world_size)) - ready)
            raise WorkerStartError(
                f"workers {missing} of {self.world_size} not ready after start_timeout="
                f"{timeout} s (target {self.target}); raise start_timeout if loading is slow"
            )

    def _pump(self, deadline: float, done: Callable[[], bool]) -> None:
        """Handle worker messages until `done()` or the deadline; a worker's death raises."""
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        conns = {id(conn): rank for rank, conn in enumerate(self._conns)}
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            ready = wait([*self._conns, *sentinels], timeout=min(remaining, 1.0))
            for obj in ready:
                if isinstance(obj, Connection):
                    self._drain(conns[id(obj)])
            for obj in ready:
                if isinstance(obj, int):
                    self._on_death(sentinels[obj])

    def _drain(self, rank: int) -> None:
        if self._read_frames(rank):
            self._procs[rank].join(1.0)  # its pipe closed: it is exiting
            self._on_death(rank)

    def _on_death(self, rank: int) -> None:
        """Raise WorkerDiedError for a rank whose process ended, with the reason it gave.

        The reason travels on the pipe, the exit on the sentinel: whichever the driver
        notices first, the pipe is read to its end before the death is reported. A rank
        that died before it was ready, or that failed only as a consequence of another
        rank's failure, may not hold the root cause: the other ranks' pipes are read for
        up to ERROR_GRACE_S until one of them says it failed first.
        """
        proc = self._procs[rank]
        proc.join(1.0)
        if proc.is_alive():
            return
        self._read_frames(rank)
        own = self._start_errors.get(rank)
        if (own is None and rank not in self._ready) or (own is not None and own["secondary"]):
            self._await_root_cause(time.monotonic() + ERROR_GRACE_S)
        reason = f"worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        traceback_text = ""
        cause = self._root_cause(rank)
        if cause is not None:
            cause_rank, info = cause
            traceback_text = str(info["traceback"])
            text = f"{info['type']}: {info['message']}\n{traceback_text}"
            reason += (
                f": {text}" if cause_rank == rank else f"; rank {cause_rank} failed first: {text}"
            )
        error = WorkerDiedError(reason, rank=rank, exitcode=proc.exitcode)
        error.traceback_text = traceback_text
        self._fail(reason, error)

    def _read_frames(self, rank: int) -> bool:
        """Handle every frame `rank`'s pipe holds now; True once the pipe is at its end."""
        conn = self._conns[rank]
        try:
            while conn.poll(0):
                self._handle(rank, conn.recv_bytes())
        except (EOFError, OSError):
            return True
        return False

    def _root_cause(self, rank: int) -> tuple[int, dict[str, object]] | None:
        """The error that explains `rank`'s death: its own, unless it is only a
        consequence of another's; then the first rank's that is not; else any known."""
        errors = self._start_errors
        own = errors.get(rank)
        if own is not None and not own["secondary"]:
            return rank, own
        primary = [r for r in sorted(errors) if not errors[r]["secondary"]]
        if primary:
            return primary[0], errors[primary[0]]
        if own is not None:
            return rank, own
        return (min(errors), errors[min(errors)]) if errors else None

    def _await_root_cause(self, deadline: float) -> None:
        """Read the ranks' pipes until one reports a primary error, every pipe has
        ended, or the deadline passes."""
        open_ranks = {id(conn): rank for rank, conn in enumerate(self._conns)}
        while not any(not e["secondary"] for e in self._start_errors.values()):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not open_ranks:
                return
            live = [self._conns[r] for r in open_ranks.values()]
            for conn in wait(live, timeout=remaining):
                if self._read_frames(open_ranks[id(conn)]):
                    del open_ranks[id(conn)]

    def _handle(self, rank: int, frame: bytes) -> None:
        kind, seq, _method, payload = decode_frame(frame)
        if kind == Kind.REPLY_SHM:
            # copy it out now, even for an abandoned call: that frees the worker's buffer
            kind, payload = Kind.REPLY, self._reply_buffers[rank].read(seq, decode_length(payload))
        if kind == Kind.PROGRESS:
            self._progress(rank, payload.decode(errors="replace"))
        elif kind == Kind.READY:
            self._ready.add(rank)
            self._progress(rank, "ready")
        elif kind == Kind.ERROR and seq == 0:
            self._start_errors[rank] = json.loads(payload)
        elif seq in self._answers:
            if kind == Kind.REPLY:
                self._answers[seq].replies[rank] = payload
            elif kind == Kind.ERROR:
                self._answers[seq].errors[rank] = json.loads(payload)

    def _raise_worker_error(self, handle: CallHandle, answers: _Answers) -> None:
        # the root cause is the first error that is not a consequence of another's failure
        ordered = sorted(answers.errors.items(), key=lambda item: bool(item[1]["secondary"]))
        rank, info = ordered[0]
        also = sorted(r for r, i in ordered[1:] if not i["secondary"])
        after = sorted(r for r, i in ordered[1:] if i["secondary"])
        reason = (
            f"worker rank {rank} raised {info['type']} in {handle.method!r} "
            f"(call #{handle.seq}): {info['message']}"
        )
        if also:
            reason += f" (ranks {also} raised too)"
        if after:
            reason += f" (ranks {after} failed as a consequence)"
        self._fail(reason, WorkerError(reason, rank=rank, traceback_text=str(info["traceback"])))
