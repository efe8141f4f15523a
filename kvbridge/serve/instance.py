"""A prefill or decode instance: one `LLMEngine` (with its tp workers and KV connector)
behind an internal HTTP API the proxy calls.

    POST /internal/prefill   GenerateRequest -> PrefillResult      (prefill role)
    POST /internal/generate  DecodeRequest   -> NDJSON GenerateEvents
         with `prefill` set: pull the KV from the prefill instance, then decode;
         without: compute the prompt here (colocated; also the recompute fallback)
    GET  /health, /metrics, /internal/info

Bodies are msgspec JSON, at most `wire.MAX_BODY_BYTES`; a malformed or oversized
body is refused with 400/413 and a reason. Binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvbridge.engine.llm_engine import LLMEngine, RequestOutput
from kvbridge.errors import KVBridgeError
from kvbridge.serve import wire
from kvbridge.serve.backend import PROTOCOL_VERSION, GenerateEvent, GenerateRequest
from kvbridge.serve.config import KVLoadFailure, Role
from kvbridge.serve.engine_loop import EngineLoop, _Stream, engine_sampling
from kvbridge.serve.metrics import Metrics
from kvbridge.serve.openai_protocol import error_body
from kvbridge.transfer.connector import Expose, Pull, TrackedTransfer

#: Longest a handler waits for the engine before answering 503 (a prefill of a long
#: prompt on 2 cores takes seconds; a stuck engine must not hold clients forever).
REQUEST_TIMEOUT_S = 300.0


def _error(status: int, message: str) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse(error_body(message, type_=kind), status_code=status)


def prompt_ids(engine: LLMEngine, gen: GenerateRequest) -> list[int]:
    if gen.prompt_token_ids is not None:
        return list(gen.prompt_token_ids)
    if gen.messages is not None:
        text = engine.tokenizer.apply_chat_template(gen.messages, add_generation_prompt=True)
        return engine.tokenizer.encode(text)
    return engine.tokenizer.encode(gen.prompt or "")


def _sampling(gen: GenerateRequest, max_tokens: int | None = None) -> Any:
    s = gen.sampling
    return engine_sampling(
        max_tokens or s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop
    )


async def _body(request: Request, decoder: msgspec.json.Decoder[Any]) -> Any:
    size = int(request.headers.get("content-length") or 0)
    if size > wire.MAX_BODY_BYTES:
        raise _Refused(413, f"body of {size} bytes exceeds {wire.MAX_BODY_BYTES}")
    raw = await request.body()
    if len(raw) > wire.MAX_BODY_BYTES:
        raise _Refused(413, f"body of {len(raw)} bytes exceeds {wire.MAX_BODY_BYTES}")
    try:
        obj = decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise _Refused(400, f"malformed request: {exc}") from None
    gen = obj if isinstance(obj, GenerateRequest) else obj.request
    if gen.version != PROTOCOL_VERSION:
        raise _Refused(
            400, f"protocol version={gen.version}; this instance speaks {PROTOCOL_VERSION}"
        )
    return obj


class _Refused(KVBridgeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Instance:
    """The HTTP face of one engine. Owns the `EngineLoop` (and so the engine)."""

    def __init__(
        self,
        loop: EngineLoop,
        role: Role,
        instance_id: str,
        model_name: str,
        kv_load_failure: KVLoadFailure = KVLoadFailure.RECOMPUTE,
    ) -> None:
        self.loop = loop
        self.role = role
        self.instance_id = instance_id
        self.model_name = model_name
        self.kv_load_failure = kv_load_failure
        self.endpoint = ""
        self.metrics = Metrics()
        self.metrics.describe("blocks_in_use", "gauge", "KV blocks allocated on this instance.")
        self.metrics.describe("blocks_total", "gauge", "KV blocks of this instance.")
        self.metrics.describe(
            "kv_pinned_blocks",
            "gauge",
            "Blocks held by the transfer runtime (exposed or being pulled).",
        )
        self.metrics.describe(
            "kv_instance_load_failures_total", "counter", "KV pulls that failed here."
        )
        self.metrics.describe("kv_instance_bytes_total", "counter", "KV bytes pulled here.")
        self._aborted: set[str] = set()

    # -- engine-thread callbacks -----------------------------------------------------------
    def _start_prefill(
        self, engine: LLMEngine, gen: GenerateRequest
    ) -> concurrent.futures.Future[wire.PrefillResult]:
        ids = prompt_ids(engine, gen)
        params = _sampling(gen)
        rid = gen.request_id
        fut: concurrent.futures.Future[wire.PrefillResult] = concurrent.futures.Future()
        started = time.perf_counter()

        def on_prefilled(_: RequestOutput) -> None:
            comp = engine.pop(rid)
            first, text = comp.token_ids[0], comp.text
            finish = None
            hits = [i for i in (text.find(s) for s in params.stop) if i >= 0]
            if first in engine.eos_ids:
                finish, text = "stop", ""
            elif hits:
                finish, text = "stop", text[: min(hits)]
            elif params.max_tokens == 1:
                finish = "length"
            kv = None
            if finish is None and self.loop.has_connector:
                engine.connector_call(Expose(rid, comp.block_ids, len(ids)))
                self.loop.tracker.track(
                    rid,
                    comp.block_ids,
                    self.loop.world_size,
                    on_done=lambda tr: engine.release_blocks(tr.block_ids),
                )
                kv = wire.KVParams(self.instance_id, self.endpoint, comp.block_ids, len(ids))
            else:
                engine.release_blocks(comp.block_ids)
            fut.set_result(
                wire.PrefillResult(
                    rid, ids, first, text, finish, kv, (time.perf_counter() - started) * 1e3
                )
            )

        self.loop.on_prefilled[rid] = on_prefilled
        try:
            engine.add_request(ids, params, request_id=rid, prefill_only=True)
        except Exception:
            self.loop.on_prefilled.pop(rid, None)
            raise
        return fut

    def _start_generate(
        self,
        engine: LLMEngine,
        req: wire.DecodeRequest,
        aloop: asyncio.AbstractEventLoop,
        aq: asyncio.Queue[GenerateEvent],
    ) -> None:
        gen, pf = req.request, req.prefill
        rid = gen.request_id
        if pf is None:  # colocated: the whole request here
            ids = prompt_ids(engine, gen)
            engine.add_request(ids, _sampling(gen), request_id=rid)
            self.loop.streams[rid] = _Stream(aloop, aq, len(ids))
            return
        ids = pf.prompt_token_ids
        # the proxy already sent the first token
        stream = _Stream(
            aloop, aq, len(ids), completion_tokens=1, stages={"prefill_ms": pf.prefill_ms}
        )

        def recompute(reason: str) -> None:
            self.metrics.inc("kv_instance_load_failures_total")
            stream.stages["kv_load_failed"] = 1.0
            if self.kv_load_failure is KVLoadFailure.FAIL:
                stream.put(GenerateEvent(error=f"KV cache load failed: {reason}"))
                return
            engine.add_request(
                [*ids, pf.first_token_id],
                _sampling(gen, gen.sampling.max_tokens - 1),
                request_id=rid,
            )
            self.loop.streams[rid] = stream

        if pf.kv is None or not self.loop.has_connector:
            recompute("no KV to pull" if pf.kv is None else "this instance has no KV connector")
            return
        kv = pf.kv
        blocks = engine.allocate_blocks(len(ids))
        try:
            engine.connector_call(Pull(rid, kv.endpoint, kv.block_ids, blocks, kv.num_tokens))
        except Exception as exc:
            engine.release_blocks(blocks)
            recompute(str(exc))
            return

        def done(tr: TrackedTransfer) -> None:
            stream.stages["transfer_ms"] = (time.perf_counter() - tr.started) * 1e3
            stream.stages["kv_bytes"] = float(tr.nbytes)
            self.metrics.inc("kv_instance_bytes_total", tr.nbytes)
            if rid in self._aborted:
                self._aborted.discard(rid)
                engine.release_blocks(tr.block_ids)
            elif tr.failures:
                engine.release_blocks(tr.block_ids)
                recompute("; ".join(sorted(set(tr.failures))))
            else:
                engine.add_prefilled_request(
                    ids, pf.first_token_id, tr.block_ids, _sampling(gen), request_id=rid
                )
                self.loop.streams[rid] = stream

        self.loop.tracker.track(rid, blocks, self.loop.world_size, on_done=done)

    def _abort(self, engine: LLMEngine, rid: str) -> None:
        if rid in self.loop.tracker.transfers:
            self._aborted.add(rid)
        if self.loop.streams.pop(rid, None) is not None:
            engine.abort(rid)
            engine.pop(rid)

    # -- HTTP ---------------------------------------------------------------------------
    def app(self) -> FastAPI:
        app = FastAPI(title=f"kvbridge {self.role.value} instance")

        @app.get("/health")
        async def health() -> Response:
            if self.loop.fatal:
                return JSONResponse({"status": "failed", "reason": self.loop.fatal}, 503)
            return JSONResponse(
                {"status": "ok", "role": self.role.value, "instance_id": self.instance_id}
            )

        @app.get("/internal/info")
        async def info() -> dict[str, Any]:
            return {
                "role": self.role.value,
                "instance_id": self.instance_id,
                "model": self.model_name,
                "endpoint": self.endpoint,
                "tp": self.loop.world_size,
                "version": PROTOCOL_VERSION,
            }

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            def snapshot(engine: LLMEngine) -> tuple[int, int]:
                bm = engine.block_manager
                return bm.num_blocks - bm.num_free_blocks, bm.num_blocks

            used, total = await self.loop.acall(snapshot)
            labels = {"instance": self.instance_id, "role": self.role.value}
            self.metrics.set("blocks_in_use", used, **labels)
            self.metrics.set("blocks_total", total, **labels)
            self.metrics.set("kv_pinned_blocks", self.loop.tracker.pinned_blocks, **labels)
            return PlainTextResponse(self.metrics.render())

        @app.post("/internal/prefill")
        async def prefill(request: Request) -> Response:
            if self.role is not Role.PREFILL:
                return _error(404, "this is a decode instance; POST /internal/generate")
            try:
                gen = await _body(request, wire.generate_request_decoder)
                started = await self.loop.acall(lambda e: self._start_prefill(e, gen))
                result = await asyncio.wait_for(asyncio.wrap_future(started), REQUEST_TIMEOUT_S)
            except _Refused as exc:
                return _error(exc.status, str(exc))
            except KVBridgeError as exc:
                return _error(400, str(exc))
            except TimeoutError:
                return _error(503, f"prefill did not finish within {REQUEST_TIMEOUT_S:.0f} s")
            return Response(msgspec.json.encode(result), media_type="application/json")

        @app.post("/internal/generate")
        async def generate(request: Request) -> Response:
            try:
                req = await _body(request, wire.decode_request_decoder)
                aq: asyncio.Queue[GenerateEvent] = asyncio.Queue()
                aloop = asyncio.get_running_loop()
                await self.loop.acall(lambda e: self._start_generate(e, req, aloop, aq))
            except _Refused as exc:
                return _error(exc.status, str(exc))
            except KVBridgeError as exc:
                return _error(400, str(exc))
            rid = req.request.request_id
            return StreamingResponse(self._events(rid, aq), media_type="application/x-ndjson")

        return app

    async def _events(self, rid: str, aq: asyncio.Queue[GenerateEvent]) -> AsyncIterator[bytes]:
        finished = False
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(aq.get(), REQUEST_TIMEOUT_S)
                except TimeoutError:
                    ev = GenerateEvent(error=f"no token within {REQUEST_TIMEOUT_S:.0f} s")
                yield msgspec.json.encode(ev) + b"\n"
                if ev.finish_reason or ev.error:
                    finished = True
                    return
        finally:
            if not finished:  # the proxy went away: stop generating, free the blocks
                self.loop.call(lambda e: self._abort(e, rid))
