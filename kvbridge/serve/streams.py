"""What an instance's HTTP caller gets from one request's engine outputs: a generate
request's NDJSON events (`Stream`), a prefill's `PrefillResult` (`PendingPrefill`).
Both are `engine_loop.Waiter`s, called in the loop thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvbridge.connector import RemotePrefill
from kvbridge.engine.llm_engine import Completion, LLMEngine, RequestOutput
from kvbridge.engine.sequence import FinishReason
from kvbridge.serve import wire
from kvbridge.serve.backend import GenerateEvent, RequestStages
from kvbridge.serve.engine_loop import EngineFailedError, settle

#: What the API says of a request that ended with one of these.
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


@dataclass
class Stream:
    """A generate request's events, onto an asyncio queue on the server's event loop.
    `prefill`: the prefill instance's result it continues (disaggregated), else None."""

    aloop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[GenerateEvent]
    instance_id: str
    prefill: wire.PrefillResult | None = None
    on_finish: Callable[[Completion], None] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        if self.prefill is not None:
            self.prompt_tokens = len(self.prefill.prompt_token_ids)
            self.completion_tokens = 1  # the proxy already sent the first token

    def put(self, ev: GenerateEvent) -> None:
        self.aloop.call_soon_threadsafe(self.queue.put_nowait, ev)

    def fail(self, reason: str) -> None:
        self.put(GenerateEvent(error=reason, error_status=503))

    def deliver(self, engine: LLMEngine, out: RequestOutput) -> None:
        self.completion_tokens += len(out.new_token_ids)
        if not out.finished:
            self.put(GenerateEvent(text=out.new_text, token_ids=list(out.new_token_ids)))
            return
        comp = engine.pop(out.request_id)
        if self.on_finish is not None:
            self.on_finish(comp)
        finish = _FINISH.get(comp.finish_reason)
        if finish is None:
            error = comp.error or f"request ended: {comp.finish_reason}"
            self.put(GenerateEvent(error=error, kv_load_error=comp.kv_load_error))
            return
        pf = self.prefill
        route = {"decode_instance": self.instance_id}
        if pf is not None:
            route["prefill_instance"] = pf.instance_id
        # a pulled prompt's cached tokens are the prefill instance's hit; computed here
        # (colocated, or recomputed after a failed pull): this engine's
        pulled = pf is not None and comp.kv_load_error is None
        self.put(
            GenerateEvent(
                text=out.new_text,
                token_ids=list(out.new_token_ids),
                finish_reason=finish,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens,
                stages=self.stages(comp),
                kv_load_error=comp.kv_load_error,
                cached_tokens=pf.cached_tokens
                if pf is not None and pulled
                else comp.num_cached_tokens,
                route=route,
            )
        )

    def stages(self, comp: Completion) -> RequestStages:
        elapsed_ms = (time.perf_counter() - self.started) * 1e3
        transfer_ms = comp.kv_transfer_ms
        stages = RequestStages(
            transfer_ms=transfer_ms,
            kv_ready_ms=comp.kv_ready_ms if transfer_ms is not None else None,
            kv_bytes=comp.kv_nbytes if transfer_ms is not None else None,
            kv_local_bytes=comp.kv_local_nbytes or None,
            kv_handshakes=comp.kv_handshakes if transfer_ms is not None else None,
            kv_cold_peers=comp.kv_cold_peers if transfer_ms is not None else None,
            decode_ms=elapsed_ms - (transfer_ms or 0.0),  # after the KV load
            cached_tokens=comp.num_cached_tokens,
            kv_load_failed=True if comp.kv_load_error is not None else None,
        )
        if self.prefill is not None:
            stages.prefill_ms = self.prefill.prefill_ms
            stages.prefill_cached_tokens = self.prefill.cached_tokens
        return stages


@dataclass
class PendingPrefill:
    """A prefill request's caller, waiting for its first token and hand-over record."""

    future: concurrent.futures.Future[wire.PrefillResult]
    prompt_ids: list[int]
    instance_id: str
    on_finish: Callable[[Completion], None] | None = None
    started: float = field(default_factory=time.perf_counter)

    def fail(self, reason: str) -> None:
        settle(self.future, exc=EngineFailedError(reason))

    def deliver(self, engine: LLMEngine, out: RequestOutput) -> None:
        if not out.finished:
            return
        comp = engine.pop(out.request_id)
        if self.on_finish is not None:
            self.on_finish(comp)
        kv = comp.kv_transfer_params if isinstance(comp.kv_transfer_params, RemotePrefill) else None
        if self.future.cancelled():  # the caller gave up waiting: nobody will pull this KV
            if kv is not None:
                engine.cancel_kv(out.request_id, "the caller went away")
            return
        if comp.finish_reason is not FinishReason.PREFILLED and comp.finish_reason not in _FINISH:
            self.fail(comp.error or f"the prefill ended: {comp.finish_reason}")
            return
        result = wire.PrefillResult(
            out.request_id,
            self.prompt_ids,
            comp.token_ids[0],
            comp.text,
            _FINISH.get(comp.finish_reason),
            kv,
            (time.perf_counter() - self.started) * 1e3,
            comp.num_cached_tokens,
            self.instance_id,
        )
        settle(self.future, result)
