"""Drive one `LLMEngine` from a dedicated thread for an asyncio HTTP server.

The engine is single-threaded; `EngineLoop` owns it. HTTP handlers submit work with
`call(fn)` (runs `fn(engine)` in the loop thread) and register a `Waiter` for each
request whose outputs someone awaits. Between forward steps the loop polls the engine's
KV connector as often as the engine asks (`kv_poll_interval`): the hand-overs live in
the engine (exposed blocks freed once pulled, a decode request started once its pull is
done, or recomputed or failed by the policy), the loop only passes the outputs on.

If the engine fails (a tp worker died, a step raised), the loop stops for good: `fatal`
says why, every waiter is told at once (pending calls raise `EngineFailedError`, waiters
get `fail(reason)`) and every later call raises it too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from kvbridge.engine.llm_engine import LLMEngine, RequestOutput
from kvbridge.errors import KVBridgeError

log = logging.getLogger("kvbridge.serve")
T = TypeVar("T")

#: How long the loop sleeps when there is nothing to do and no poll is due.
IDLE_WAIT_S = 0.05
#: How often the loop checks that the tp workers live (an idle loop calls no worker).
WORKER_CHECK_S = 0.5
#: Longest `acall` waits for the loop to run a call (it runs between forward steps;
#: one step is bounded by the engine's worker timeout).
CALL_TIMEOUT_S = 300.0


class EngineFailedError(KVBridgeError):
    """The instance's engine failed and serves nothing any more; the message says why."""


class Waiter(Protocol):
    """Whoever awaits one request's outputs; called in the loop thread."""

    def deliver(self, engine: LLMEngine, out: RequestOutput) -> None:
        """One output; on the last (`out.finished`) the waiter pops the completion."""

    def fail(self, reason: str) -> None:
        """The engine failed: end the request with `reason`."""


def settle(
    fut: concurrent.futures.Future[Any], result: Any = None, exc: BaseException | None = None
) -> None:
    """Set a future's outcome unless it already has one (its waiter gave up: cancelled)."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


class EngineLoop:
    """Owns `engine` once started; all engine calls go through `call`. `waiters` are
    touched only in the loop thread (by the functions given to `call`)."""

    def __init__(self, engine: LLMEngine, world_size: int) -> None:
        self.engine = engine
        self.world_size = world_size
        self._tasks: queue.SimpleQueue[
            tuple[Callable[[LLMEngine], Any], concurrent.futures.Future[Any]]
        ] = queue.SimpleQueue()
        # `fatal` and the task queue change together: no call slips in after the drain
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.waiters: dict[str, Waiter] = {}
        self.fatal: str | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # -- called from the server's threads ------------------------------------------------
    def call(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self.fatal is None:
                self._tasks.put((fn, fut))
                self._wake.set()
                return fut
            reason = self.fatal
        fut.set_exception(EngineFailedError(reason))
        return fut

    @property
    def queued_calls(self) -> int:
        """Calls waiting for the loop thread (it runs them between forward steps)."""
        return self._tasks.qsize()

    async def acall(self, fn: Callable[[LLMEngine], T], timeout: float = CALL_TIMEOUT_S) -> T:
        """`fn(engine)` in the loop thread; EngineFailedError at once if the engine
        failed, TimeoutError after `timeout` (the call is then dropped if not begun)."""
        return await asyncio.wait_for(asyncio.wrap_future(self.call(fn)), timeout)

    # -- loop thread ----------------------------------------------------------------------
    def _run(self) -> None:
        last_poll = last_check = 0.0
        engine = self.engine
        while not self._stop.is_set():
            worked = self._run_tasks()
            try:
                if engine.has_unfinished():
                    for out in engine.step():
                        self.deliver(out)
                    worked = True
                now = time.monotonic()
                interval = engine.kv_poll_interval()
                if interval is not None and now - last_poll >= interval:
                    for out in engine.poll_kv():
                        self.deliver(out)
                    last_poll = now
                if now - last_check >= WORKER_CHECK_S:
                    engine.check_workers()
                    last_check = now
            except Exception as exc:  # a worker died or the engine broke: fail everyone
                log.exception("engine loop failed")
                self._fail_all(f"engine failed: {exc}")
                return
            if not worked:
                interval = engine.kv_poll_interval()
                self._wake.wait(IDLE_WAIT_S if interval is None else min(interval, IDLE_WAIT_S))
                self._wake.clear()
        self._fail_all("the instance is shutting down")

    def _fail_all(self, reason: str) -> None:
        """Refuse new calls and tell every waiter `reason` (loop thread, once)."""
        with self._lock:
            self.fatal = reason
            tasks = []
            while True:
                try:
                    tasks.append(self._tasks.get_nowait())
                except queue.Empty:
                    break
        error = EngineFailedError(reason)
        for _, fut in tasks:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error)
        waiters, self.waiters = self.waiters, {}
        for waiter in waiters.values():
            waiter.fail(reason)

    def _run_tasks(self) -> bool:
        ran = False
        while True:
            try:
                fn, fut = self._tasks.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except Exception as exc:
                    fut.set_exception(exc)

    def deliver(self, out: RequestOutput) -> None:
        """Pass one output to its request's waiter (loop thread); a finished request
        nobody waits for is forgotten."""
        rid = out.request_id
        waiter = self.waiters.pop(rid, None) if out.finished else self.waiters.get(rid)
        if waiter is None:
            if out.finished:
                self.engine.discard(rid)
            return
        try:
            waiter.deliver(self.engine, out)
        except Exception as exc:  # this request fails, not the loop
            log.exception("request %s failed", out.request_id)
            waiter.fail(f"{type(exc).__name__}: {exc}")
