"""The OpenAI-compatible HTTP front: `/v1/completions`, `/v1/chat/completions`
(streaming and not), `/v1/models`, `/health`, `/metrics`.

`make_app(backend)` builds the FastAPI app; the backend decides where tokens come from
(a disaggregated prefill -> decode pair, or a test double). Errors are OpenAI-shaped:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvbridge.serve import openai_protocol as oai
from kvbridge.serve.backend import (
    Backend,
    BackendError,
    GenerateEvent,
    GenerateRequest,
    SamplingParams,
)
from kvbridge.serve.metrics import Metrics, merge_expositions


def proxy_metrics() -> Metrics:
    m = Metrics()
    m.describe("requests_total", "counter", "Requests by endpoint and HTTP status.")
    m.describe("requests_running", "gauge", "Requests being generated now.")
    m.describe("ttft_ms", "histogram", "Time to first token, milliseconds.")
    m.describe("tpot_ms", "histogram", "Time per output token after the first, milliseconds.")
    m.describe("kv_bytes_total", "counter", "KV-cache bytes moved from prefill to decode.")
    m.describe("kv_transfer_ms", "histogram", "KV transfer time per request, milliseconds.")
    m.describe("failures_total", "counter", "Requests that failed, by reason.")
    m.describe(
        "kv_load_failures_total", "counter", "KV pulls that failed (then recomputed or refused)."
    )
    return m


def _error(
    status: int,
    message: str,
    param: str | None = None,
    type_: str = "invalid_request_error",
    code: str | None = None,
) -> JSONResponse:
    return JSONResponse(
        oai.error_body(message, type_=type_, param=param, code=code), status_code=status
    )


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class JSONBodies:
    """ASGI middleware: every POST body is JSON, whatever Content-Type it declares.

    `curl URL -d '{"prompt": ...}'` sends application/x-www-form-urlencoded, and FastAPI
    would then refuse the body as not a JSON object; the OpenAI endpoints take nothing but
    JSON, so the declared type is replaced rather than trusted.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = dict(scope, headers=[*headers, (b"content-type", b"application/json")])
        await self.app(scope, receive, send)


def make_app(backend: Backend, metrics: Metrics | None = None) -> FastAPI:
    app = FastAPI(title="kvbridge", version="0.1.0")
    app.add_middleware(JSONBodies)
    m = metrics or proxy_metrics()
    app.state.metrics = m
    app.state.backend = backend

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        m.inc("requests_total", endpoint="invalid", status="400")
        return _error(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param)

    @app.get("/health")
    async def health() -> Response:
        state = await backend.health()
        return JSONResponse(state, status_code=200 if state.get("status") == "ok" else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": backend.model_name, "object": "model", "created": 0, "owned_by": "kvbridge"}
            ],
        }

    @app.get("/metrics")
    async def metrics_text() -> PlainTextResponse:
        text = merge_expositions([m.render(), await backend.instance_metrics()])
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def _check(req: oai.CompletionRequest | oai.ChatCompletionRequest) -> JSONResponse | None:
        if req.model is not None and req.model != backend.model_name:
            return _error(
                404,
                f"model={req.model!r} is not served here; use "
                f"{backend.model_name!r} (see GET /v1/models)",
                "model",
                code="model_not_found",
            )
        if req.n != 1:
            return _error(400, f"n={req.n} is not supported; use n=1", "n")
        if req.logprobs:
            return _error(400, "logprobs are not supported; leave logprobs unset", "logprobs")
        return None

    def _sampling(
        req: oai.CompletionRequest | oai.ChatCompletionRequest, max_tokens: int | None
    ) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens or 16,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            stop=req.stop_list(),
        )

    @app.post("/v1/completions", response_model=None)
    async def completions(req: oai.CompletionRequest) -> Response:
        if (bad := _check(req)) is not None:
            return bad
        if req.echo:
            return _error(400, "echo=true is not supported; leave echo unset", "echo")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                return _error(
                    400, f"prompt holds {len(prompt)} prompts; send one per request", "prompt"
                )
            prompt = prompt[0]
        gen = GenerateRequest(
            request_id=oai.new_id("cmpl"),
            sampling=_sampling(req, req.max_tokens),
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=[int(t) for t in prompt] if isinstance(prompt, list) else None,
        )
        return await _run(gen, req.stream, req.stream_options, chat=False, endpoint="completions")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: oai.ChatCompletionRequest) -> Response:
        if (bad := _check(req)) is not None:
            return bad
        gen = GenerateRequest(
            request_id=oai.new_id("chatcmpl"),
            sampling=_sampling(req, req.max_completion_tokens or req.max_tokens),
            messages=[{"role": msg.role, "content": msg.text()} for msg in req.messages],
        )
        return await _run(gen, req.stream, req.stream_options, chat=True, endpoint="chat")

    async def _run(
        gen: GenerateRequest,
        stream: bool,
        options: oai.StreamOptions | None,
        *,
        chat: bool,
        endpoint: str,
    ) -> Response:
        start = time.perf_counter()
        events = backend.generate(gen)
        try:
            first = await anext(events)
        except BackendError as exc:
            m.inc("requests_total", endpoint=endpoint, status=str(exc.status))
            m.inc("failures_total", reason="refused" if exc.status < 500 else "backend")
            await events.aclose()
            return _error(
                exc.status,
                str(exc),
                exc.param,
                "invalid_request_error" if exc.status < 500 else "server_error",
            )
        except StopAsyncIteration:
            m.inc("failures_total", reason="empty")
            return _error(500, "the backend produced no output", type_="server_error")
        m.inc("requests_running", 1)
        tracker = _Tracker(m, start)
        if not stream:
            try:
                return await _collect(first, events, tracker, gen, chat, endpoint)
            finally:
                m.inc("requests_running", -1)
        include_usage = bool(options and options.include_usage)
        return StreamingResponse(
            _stream(first, events, tracker, gen, chat, endpoint, include_usage),
            media_type="text/event-stream",
        )

    async def _collect(
        first: GenerateEvent,
        events: AsyncGenerator[GenerateEvent, None],
        tracker: _Tracker,
        gen: GenerateRequest,
        chat: bool,
        endpoint: str,
    ) -> Response:
        parts = []
        last = first
        async for ev in _chain(first, events):
            tracker.see(ev)
            parts.append(ev.text)
            last = ev
        if last.error:
            tracker.finish(endpoint, "500", failed=True)
            return _error(500, last.error, type_="server_error")
        tracker.finish(endpoint, "200")
        use = oai.usage(last.prompt_tokens, last.completion_tokens)
        text = "".join(parts)
        if chat:
            body = oai.chat_body(gen.request_id, backend.model_name, text, last.finish_reason, use)
        else:
            body = oai.completion_body(
                gen.request_id, backend.model_name, text, last.finish_reason, use
            )
        if tracker.stages:  # an extra field (OpenAI clients ignore it): where time went
            body["kvbridge_stages"] = tracker.stages
        return JSONResponse(body)

    async def _stream(
        first: GenerateEvent,
        events: AsyncGenerator[GenerateEvent, None],
        tracker: _Tracker,
        gen: GenerateRequest,
        chat: bool,
        endpoint: str,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        rid, model = gen.request_id, backend.model_name
        status = "200"
        try:
            if chat:
                yield _sse(oai.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None))
            async for ev in _chain(first, events):
                tracker.see(ev)
                if ev.error:
                    status = "500"
                    yield _sse(oai.error_body(ev.error, type_="server_error"))
                    break
                if ev.text or ev.finish_reason:
                    if chat:
                        delta = {"content": ev.text} if ev.text else {}
                        yield _sse(oai.chat_chunk(rid, model, delta, ev.finish_reason))
                    else:
                        yield _sse(
                            oai.completion_body(
                                rid, model, ev.text, ev.finish_reason, None, chunk=True
                            )
                        )
                if ev.finish_reason and include_usage:
                    use = oai.usage(ev.prompt_tokens, ev.completion_tokens)
                    body = (
                        oai.chat_chunk(rid, model, {}, None, use)
                        if chat
                        else {
                            **oai.completion_body(rid, model, "", None, use, chunk=True),
                            "choices": [],
                        }
                    )
                    yield _sse(body)
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()  # aborts the request if the client went away
            tracker.finish(endpoint, status, failed=status != "200")
            m.inc("requests_running", -1)

    return app


async def _chain(
    first: GenerateEvent, rest: AsyncGenerator[GenerateEvent, None]
) -> AsyncGenerator[GenerateEvent, None]:
    yield first
    async for ev in rest:
        yield ev


class _Tracker:
    """TTFT / TPOT / KV figures of one request, recorded once it ends."""

    def __init__(self, metrics: Metrics, start: float) -> None:
        self.m = metrics
        self.start = start
        self.first_token: float | None = None
        self.last_token = start
        self.tokens = 0
        self.stages: dict[str, float] = {}
        self.done = False

    def see(self, ev: GenerateEvent) -> None:
        now = time.perf_counter()
        if ev.token_ids:
            if self.first_token is None:
                self.first_token = now
            self.last_token = now
            self.tokens += len(ev.token_ids)
        if ev.stages:
            self.stages = ev.stages

    def finish(self, endpoint: str, status: str, failed: bool = False) -> None:
        if self.done:
            return
        self.done = True
        self.m.inc("requests_total", endpoint=endpoint, status=status)
        if failed:
            self.m.inc("failures_total", reason="generation")
        if self.first_token is not None:
            self.m.observe("ttft_ms", (self.first_token - self.start) * 1e3)
            if self.tokens > 1:
                self.m.observe(
                    "tpot_ms", (self.last_token - self.first_token) * 1e3 / (self.tokens - 1)
                )
        if "kv_bytes" in self.stages:
            self.m.inc("kv_bytes_total", self.stages["kv_bytes"])
        if "transfer_ms" in self.stages:
            self.m.observe("kv_transfer_ms", self.stages["transfer_ms"])
        if self.stages.get("kv_load_failed"):
            self.m.inc("kv_load_failures_total")
