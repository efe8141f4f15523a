"""Drive one `LLMEngine` from a dedicated thread for an asyncio HTTP server.

The engine is single-threaded; `EngineLoop` owns it. HTTP handlers submit work with
`call(fn)` (runs `fn(engine)` in the loop thread) and receive their request's events on
an asyncio queue (`streams`) or a future (`prefills`). Between forward steps the loop
polls the KV connector: a prefill instance frees a request's blocks once every worker
released them (all expected decode workers notified, or the lease expired); a decode
instance starts decoding a request once every worker's pull is done, or handles the
failure (recompute the prompt locally, or fail the request, per `kv_load_failure`).

If the engine fails (a tp worker died, a step raised), the loop stops for good: `fatal`
says why, every waiter is told at once (pending calls and prefills raise
`EngineFailedError`, streams get an error event) and every later call raises it too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvbridge.engine.llm_engine import LLMEngine, RequestOutput
from kvbridge.engine.sampling import SamplingParams as EngineSampling
from kvbridge.errors import KVBridgeError
from kvbridge.serve.backend import GenerateEvent
from kvbridge.transfer.connector import Poll, TransferTracker

log = logging.getLogger("kvbridge.serve")
T = TypeVar("T")

#: How often the loop polls the connector while transfers are in flight / when idle.
BUSY_POLL_S = 0.001
IDLE_POLL_S = 0.05
#: How often the loop checks that the tp workers live (an idle loop calls no worker).
WORKER_CHECK_S = 0.5
#: Longest `acall` waits for the loop to run a call (it runs between forward steps;
#: one step is bounded by the engine's worker timeout).
CALL_TIMEOUT_S = 300.0


class EngineFailedError(KVBridgeError):
    """The instance's engine failed and serves nothing any more; the message says why."""


@dataclass
class Stream:
    """Where one request's events go: an asyncio queue on the server's event loop."""

    aloop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[GenerateEvent]
    prompt_tokens: int
    completion_tokens: int = 0
    stages: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    kv_load_error: str | None = None  # why the KV pull failed, if it did
    #: prompt tokens whose KV was not computed: the prefill instance's prefix-cache hit
    #: (disaggregated), else this engine's (set when the request finishes)
    cached_tokens: int | None = None
    route: dict[str, str] = field(default_factory=dict)  # instances that served it

    def put(self, ev: GenerateEvent) -> None:
        self.aloop.call_soon_threadsafe(self.queue.put_nowait, ev)


@dataclass
class PendingPrefill:
    """A prefill-only request waiting for its first token. `on_done(output)` runs in the
    loop thread and settles `future` (the handler awaits it); if it raises, the loop
    sets the exception instead."""

    future: concurrent.futures.Future[Any]
    on_done: Callable[[RequestOutput], None]


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
    """Owns `engine` once started; all engine calls go through `call`.

    `streams`, `prefills` and `tracker` are the requests this instance holds; they are
    touched only in the loop thread (by the functions given to `call`)."""

    def __init__(self, engine: LLMEngine, world_size: int) -> None:
        self.engine = engine
        self.world_size = world_size
        self.has_connector = engine.connector is not None
        # every IDLE_POLL_S even with no transfer in flight (see the engine's property)
        self.poll_when_idle = engine.connector_needs_idle_polls
        # workers whose connectors progress themselves need no busy polls to advance
        # introductions (busy_until); the loop polls them only to collect outcomes
        self._polls_itself = engine.connector_polls_itself
        self._tasks: queue.SimpleQueue[
            tuple[Callable[[LLMEngine], Any], concurrent.futures.Future[Any]]
        ] = queue.SimpleQueue()
        # `fatal` and the task queue change together: no call slips in after the drain
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.streams: dict[str, Stream] = {}
        self.prefills: dict[str, PendingPrefill] = {}
        self.tracker = TransferTracker()  # requests whose KV is pinned or being pulled
        #: poll the connector at the busy cadence until then (introductions in flight)
        self.busy_until = 0.0
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
        while not self._stop.is_set():
            worked = self._run_tasks()
            try:
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        self.deliver(out)
                    worked = True
                now = time.monotonic()
                busy = self._busy(now)
                due = now - last_poll >= (BUSY_POLL_S if busy else IDLE_POLL_S)
                if self.has_connector and (busy or self.poll_when_idle) and due:
                    self._poll_connector()
                    last_poll = now
                if now - last_check >= WORKER_CHECK_S:
                    self.engine.check_workers()
                    last_check = now
            except Exception as exc:  # a worker died or the engine broke: fail everyone
                log.exception("engine loop failed")
                self._fail_all(f"engine failed: {exc}")
                return
            if not worked:
                busy = self._busy(time.monotonic())
                self._wake.wait(BUSY_POLL_S if busy else IDLE_POLL_S)
                self._wake.clear()
        self._fail_all("the instance is shutting down")

    def _busy(self, now: float) -> bool:
        """Poll the connector at the busy cadence: transfers are tracked, or an
        introduction is in flight on workers that do not progress it themselves."""
        return bool(self.tracker.transfers) or (now < self.busy_until and not self._polls_itself)

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
        for prefill in self.prefills.values():
            settle(prefill.future, exc=error)
        self.prefills.clear()
        for stream in self.streams.values():
            stream.put(GenerateEvent(error=reason, error_status=503))
        self.streams.clear()

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
        """Route one output to its request's prefill hook or stream (loop thread)."""
        prefill = self.prefills.pop(out.request_id, None)
        if prefill is not None:
            try:
                prefill.on_done(out)
            except Exception as exc:  # this request fails, not the loop
                log.exception("prefill %s failed", out.request_id)
                settle(prefill.future, exc=exc)
            return
        stream = self.streams.get(out.request_id)
        if stream is None:
            return
        stream.completion_tokens += len(out.new_token_ids)
        finish = None
        if out.finished and out.finish_reason is not None:
            finish = out.finish_reason.value
            if finish not in ("stop", "length"):
                finish = None
        if out.finished:
            self.streams.pop(out.request_id, None)
            comp = self.engine.pop(out.request_id)
            stream.stages["cached_tokens"] = float(comp.num_cached_tokens)  # this engine's
            if stream.cached_tokens is None:
                stream.cached_tokens = comp.num_cached_tokens
            elapsed_ms = (time.perf_counter() - stream.started) * 1e3
            # decode only: a decode instance's stream starts before its KV load
            stream.stages["decode_ms"] = elapsed_ms - stream.stages.get("transfer_ms", 0.0)
            if finish is None:
                stream.put(GenerateEvent(error=f"request ended: {out.finish_reason}"))
                return
        stream.put(
            GenerateEvent(
                text=out.new_text,
                token_ids=list(out.new_token_ids),
                finish_reason=finish,
                prompt_tokens=stream.prompt_tokens,
                completion_tokens=stream.completion_tokens,
                stages=dict(stream.stages) if finish else {},
                kv_load_error=stream.kv_load_error if finish else None,
                cached_tokens=(stream.cached_tokens or 0) if finish else 0,
                route=dict(stream.route) if finish else {},
            )
        )

    def _poll_connector(self) -> None:
        self.tracker.feed(self.engine.connector_call(Poll()))


def engine_sampling(
    max_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None, stop: list[str]
) -> EngineSampling:
    """The engine's sampling parameters from the OpenAI-style ones (top_k <= 0: off)."""
    return EngineSampling(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        seed=seed,
        stop=tuple(stop),
    )
