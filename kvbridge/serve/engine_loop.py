"""Drive one `LLMEngine` from a dedicated thread for an asyncio HTTP server.

The engine is single-threaded; `EngineLoop` owns it. HTTP handlers submit work with
`call(fn)` (runs `fn(engine)` in the loop thread) and receive their request's events on
an asyncio queue. Between forward steps the loop polls the KV connector: a prefill
instance frees a request's blocks once every worker released them (all expected
decode workers notified, or the lease expired); a decode instance starts decoding a
request once every worker's pull is done, or handles the failure (recompute the prompt
locally, or fail the request, per `kv_load_failure`).
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
from kvbridge.serve.backend import GenerateEvent
from kvbridge.transfer.connector import Poll, TransferTracker

log = logging.getLogger("kvbridge.serve")
T = TypeVar("T")

#: How often the loop polls the connector while transfers are in flight / when idle.
BUSY_POLL_S = 0.001
IDLE_POLL_S = 0.05


@dataclass
class _Stream:
    """Where one request's events go: an asyncio queue on the server's event loop."""

    aloop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[GenerateEvent]
    prompt_tokens: int
    completion_tokens: int = 0
    stages: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    def put(self, ev: GenerateEvent) -> None:
        self.aloop.call_soon_threadsafe(self.queue.put_nowait, ev)


class EngineLoop:
    """Owns `engine` once started; all engine calls go through `call`."""

    def __init__(self, engine: LLMEngine, world_size: int) -> None:
        self.engine = engine
        self.world_size = world_size
        self.has_connector = engine.connector is not None
        # every IDLE_POLL_S even with no transfer in flight (see the engine's property)
        self.poll_when_idle = engine.connector_needs_idle_polls
        self._tasks: queue.SimpleQueue[
            tuple[Callable[[LLMEngine], Any], concurrent.futures.Future[Any]]
        ] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.streams: dict[str, _Stream] = {}
        self.tracker = TransferTracker()  # requests whose KV is pinned or being pulled
        self.on_prefilled: dict[str, Callable[[RequestOutput], None]] = {}
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
        if self.fatal:
            fut.set_exception(RuntimeError(self.fatal))
            return fut
        self._tasks.put((fn, fut))
        self._wake.set()
        return fut

    async def acall(self, fn: Callable[[LLMEngine], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

    # -- loop thread ----------------------------------------------------------------------
    def _run(self) -> None:
        last_poll = 0.0
        while not self._stop.is_set():
            worked = self._run_tasks()
            try:
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        self._deliver(out)
                    worked = True
                now = time.monotonic()
                busy = bool(self.tracker.transfers)
                due = now - last_poll >= (BUSY_POLL_S if busy else IDLE_POLL_S)
                if self.has_connector and (busy or self.poll_when_idle) and due:
                    self._poll_connector()
                    last_poll = now
            except Exception as exc:  # a worker died: fail everyone, refuse new work
                self.fatal = f"engine failed: {exc}"
                log.exception("engine loop failed")
                for rid, stream in list(self.streams.items()):
                    stream.put(GenerateEvent(error=self.fatal))
                    self.streams.pop(rid, None)
                return
            if not worked:
                self._wake.wait(BUSY_POLL_S if self.tracker.transfers else IDLE_POLL_S)
                self._wake.clear()

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

    def _deliver(self, out: RequestOutput) -> None:
        hook = self.on_prefilled.pop(out.request_id, None)
        if hook is not None:
            hook(out)
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
            self.engine.pop(out.request_id)
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
