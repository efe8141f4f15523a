"""The OpenAI-compatible HTTP front: `/v1/completions`, `/v1/chat/completions`
(streaming and not), `/v1/models`, `/health`, `/metrics`.

`make_app(backend)` builds the FastAPI app; the backend decides where tokens come from
(a disaggregated prefill -> decode pair, or a test double). Errors are OpenAI-shaped:
``{"error": {"message", "type", "param", "code"}}``. Whatever a client sends is answered
with 200 or a 4xx naming what is wrong (`openai_protocol.parse_request`; 413 for a body
over the limit, `BodyLimit`); a 5xx means the backend failed (503: no instance can
serve the request now; with the code "overloaded" and a `Retry-After` header when every
instance is full), and the app keeps serving after any of them. A client that goes away
stops its request at once, even before its first token (`disconnect.py`).

Prefix caching is isolated by `isolation` (`isolation.py`): each request's blocks are
shared only within its namespace (the client's `cache_salt`, and by policy its API key
or `user`); with `hide_cached_tokens` responses leave out
`usage.prompt_tokens_details` and the `kvbridge_stages` figures that show cache hits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvbridge.errors import KVBridgeError
from kvbridge.serve import openai_protocol as oai
from kvbridge.serve import openai_responses as resp
from kvbridge.serve.admission import OVERLOADED, retry_after_header
from kvbridge.serve.backend import (
    Backend,
    BackendError,
    GenerateEvent,
    GenerateRequest,
    SamplingParams,
)
from kvbridge.serve.body_limit import (
    BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_MB,
    BodyLimit,
    mib_to_bytes,
)
from kvbridge.serve.disconnect import ClientGone, ClosingStreamingResponse, until_disconnected
from kvbridge.serve.http_auth import RequireApiKey, bearer_key
from kvbridge.serve.http_errors import error_response, install_error_handlers
from kvbridge.serve.isolation import IsolationError, PrefixCacheIsolation, namespace
from kvbridge.serve.metrics import CONTENT_TYPE_LATEST, ProxyMetrics, merge_expositions

log = logging.getLogger("kvbridge.serve")


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def make_app(
    backend: Backend,
    metrics: ProxyMetrics | None = None,
    *,
    max_body_bytes: int = mib_to_bytes(DEFAULT_MAX_BODY_MB),
    body_timeout_s: float = BODY_TIMEOUT_S,
    api_key: str | Sequence[str] | None = None,
    isolation: PrefixCacheIsolation | str | None = None,
    hide_cached_tokens: bool = False,
) -> FastAPI:
    """The proxy's app over `backend`. Request bodies over `max_body_bytes` are refused
    with 413 before they are read whole, and bodies not complete after `body_timeout_s`
    with 408 (`BodyLimit`); a body is JSON whatever Content-Type it declares
    (`curl URL -d '{...}'` declares a form). With `api_key` (one key or several),
    /v1/... answers 401 unless the request carries 'Authorization: Bearer <key>' with
    one of them. `isolation`: the prefix-cache policy (default: per API key when there
    is one, else none); `hide_cached_tokens`: leave cache figures out of responses."""
    api_keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    policy = PrefixCacheIsolation.resolve(isolation, bool(api_keys))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        try:
            yield
        finally:
            await backend.close()

    app = FastAPI(title="kvbridge", version="0.1.0", lifespan=lifespan)
    m = metrics or ProxyMetrics()

    def count_refused(status: int) -> None:
        m.requests.labels("invalid", str(status)).inc()

    if api_keys:
        app.add_middleware(RequireApiKey, api_keys=api_keys)

    app.add_middleware(
        BodyLimit,
        max_bytes=max_body_bytes,
        on_refused=count_refused,
        body_timeout_s=body_timeout_s,
    )
    install_error_handlers(app)
    app.state.metrics = m
    app.state.backend = backend

    @app.get("/health")
    async def health() -> Response:
        state = await backend.health()
        serving = state.get("status") in ("ok", "degraded")
        return JSONResponse(state, status_code=200 if serving else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": backend.model_name, "object": "model", "created": 0, "owned_by": "kvbridge"}
            ],
        }

    @app.get("/metrics")
    async def metrics_text() -> Response:
        texts = []
        for url, text in (await backend.instance_metrics()).items():
            m.instance_up.labels(url).set(0 if text is None else 1)
            texts.append(text or "")
        return Response(merge_expositions([m.render(), *texts]), media_type=CONTENT_TYPE_LATEST)

    def _refuse(exc: oai.ProtocolError) -> JSONResponse:
        count_refused(exc.status)
        return error_response(exc.status, str(exc), exc.param, exc.code)

    def _check_model(req: oai.CompletionRequest | oai.ChatCompletionRequest) -> None:
        if req.model is not None and req.model != backend.model_name:
            raise oai.ProtocolError(
                f"model={req.model!r} is not served here; use "
                f"{backend.model_name!r} (see GET /v1/models)",
                "model",
                status=404,
                code="model_not_found",
            )

    def _namespace(
        request: Request, req: oai.CompletionRequest | oai.ChatCompletionRequest
    ) -> str | None:
        try:
            return namespace(
                policy,
                cache_salt=req.cache_salt,
                api_key=bearer_key(request.headers.get("authorization")),
                user=req.user,
            )
        except IsolationError as exc:
            raise oai.ProtocolError(str(exc), exc.param) from None

    def _sampling(
        req: oai.CompletionRequest | oai.ChatCompletionRequest, max_tokens: int | None
    ) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens or 16,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k is None else req.top_k,
                seed=req.seed,
                stop=tuple(req.stop_list()),
            )
        except KVBridgeError as exc:  # what the OpenAI schema let through, refused here
            raise oai.ProtocolError(str(exc)) from None

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        try:
            req = oai.parse_request(await request.body(), oai.CompletionRequest)
            _check_model(req)
            prompt = req.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                if len(prompt) != 1:
                    raise oai.ProtocolError(
                        f"prompt holds {len(prompt)} prompts; send one per request", "prompt"
                    )
                prompt = prompt[0]
            salt = _namespace(request, req)
        except oai.ProtocolError as exc:
            return _refuse(exc)
        gen = GenerateRequest(
            request_id=resp.new_id("cmpl"),
            sampling=_sampling(req, req.max_tokens),
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=[int(t) for t in prompt] if isinstance(prompt, list) else None,
            cache_salt=salt,
        )
        return await _run(
            request, gen, bool(req.stream), req.stream_options, chat=False, endpoint="completions"
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        try:
            req = oai.parse_request(await request.body(), oai.ChatCompletionRequest)
            _check_model(req)
            salt = _namespace(request, req)
        except oai.ProtocolError as exc:
            return _refuse(exc)
        gen = GenerateRequest(
            request_id=resp.new_id("chatcmpl"),
            sampling=_sampling(req, req.max_completion_tokens or req.max_tokens),
            messages=[{"role": msg.role, "content": msg.text()} for msg in req.messages],
            cache_salt=salt,
        )
        return await _run(
            request, gen, bool(req.stream), req.stream_options, chat=True, endpoint="chat"
        )

    def _cached(ev: GenerateEvent) -> int | None:
        return None if hide_cached_tokens else ev.cached_tokens

    async def _run(
        request: Request,
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
            first = await until_disconnected(request, anext(events))
        except ClientGone:  # its request stopped with `anext` (the backend gave back its places)
            m.requests.labels(endpoint, "499").inc()
            m.failures.labels("client_gone").inc()
            await events.aclose()
            return error_response(499, "the client went away")
        except BackendError as exc:
            m.requests.labels(endpoint, str(exc.status)).inc()
            await events.aclose()
            if exc.retry_after_s is not None:  # every instance full: refused, not failed
                m.rejected.labels(OVERLOADED).inc()
                refusal = error_response(exc.status, str(exc), exc.param, OVERLOADED)
                refusal.headers.update(retry_after_header(exc.retry_after_s))
                return refusal
            m.failures.labels("refused" if exc.status < 500 else "backend").inc()
            return error_response(exc.status, str(exc), exc.param)
        except StopAsyncIteration:
            m.requests.labels(endpoint, "500").inc()
            m.failures.labels("empty").inc()
            return error_response(500, "the backend produced no output")
        except Exception as exc:  # a bug, not the client's doing: say so, keep serving
            log.exception("request %s failed", gen.request_id)
            m.requests.labels(endpoint, "500").inc()
            m.failures.labels("backend").inc()
            await events.aclose()
            return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
        m.running.inc()
        tracker = _Tracker(m, start)
        if not stream:
            try:
                collect = _collect(first, events, tracker, gen, chat, endpoint)
                return await until_disconnected(request, collect)
            except ClientGone:
                tracker.finish(endpoint, "499", failed=True)
                return error_response(499, "the client went away")
            finally:
                m.running.dec()
        include_usage = bool(options and options.include_usage)
        body = _stream(first, events, tracker, gen, chat, endpoint, include_usage)

        async def close() -> None:
            """However the response ended (even before its first chunk: then `body`
            never ran), the request is stopped and counted once."""
            await body.aclose()  # a body left at a chunk: its `finally` does both
            if not tracker.done:
                await events.aclose()
                tracker.finish(endpoint, "499", failed=True)
                m.running.dec()

        return ClosingStreamingResponse(body, on_close=close, media_type="text/event-stream")

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
        try:
            async for ev in _chain(first, events):
                tracker.see(ev)
                parts.append(ev.text)
                last = ev
        except Exception as exc:
            log.exception("request %s failed", gen.request_id)
            last = GenerateEvent(error=f"internal error: {type(exc).__name__}: {exc}")
        finally:
            await events.aclose()
        if last.error:
            tracker.finish(endpoint, str(last.error_status), failed=True)
            return error_response(last.error_status, last.error)
        tracker.finish(endpoint, "200")
        use = resp.usage(last.prompt_tokens, last.completion_tokens, _cached(last))
        text = "".join(parts)
        if chat:
            body = resp.chat_body(gen.request_id, backend.model_name, text, last.finish_reason, use)
        else:
            body = resp.completion_body(
                gen.request_id, backend.model_name, text, last.finish_reason, use
            )
        if (tracker.stages or last.route) and not hide_cached_tokens:  # OpenAI clients ignore it
            body["kvbridge_stages"] = {**tracker.stages, **last.route}
        if last.kv_load_error:  # and why the KV pull failed, when it did
            body["kvbridge_kv_load_error"] = last.kv_load_error
        return JSONResponse(body)

    async def _stream(
        first: GenerateEvent,
        events: AsyncGenerator[GenerateEvent, None],
        tracker: _Tracker,
        gen: GenerateRequest,
        chat: bool,
        endpoint: str,
        include_usage: bool,
    ) -> AsyncGenerator[str, None]:
        rid, model = gen.request_id, backend.model_name
        status = "200"
        try:
            if chat:
                yield _sse(resp.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None))
            async for ev in _chain(first, events):
                tracker.see(ev)
                if ev.error:
                    status = str(ev.error_status)
                    yield _sse(resp.error_body(ev.error, type_="server_error"))
                    break
                if ev.text or ev.finish_reason:
                    if chat:
                        delta = {"content": ev.text} if ev.text else {}
                        yield _sse(resp.chat_chunk(rid, model, delta, ev.finish_reason))
                    else:
                        yield _sse(
                            resp.completion_body(
                                rid, model, ev.text, ev.finish_reason, None, chunk=True
                            )
                        )
                if ev.finish_reason and include_usage:
                    use = resp.usage(ev.prompt_tokens, ev.completion_tokens, _cached(ev))
                    body = (
                        resp.chat_chunk(rid, model, {}, None, use)
                        if chat
                        else {
                            **resp.completion_body(rid, model, "", None, use, chunk=True),
                            "choices": [],
                        }
                    )
                    yield _sse(body)
            yield "data: [DONE]\n\n"
        except Exception as exc:  # the stream already began: the error goes in it
            log.exception("request %s failed", rid)
            status = "500"
            message = f"internal error: {type(exc).__name__}: {exc}"
            yield _sse(resp.error_body(message, type_="server_error"))
        finally:
            await events.aclose()  # aborts the request if the client went away
            tracker.finish(endpoint, status, failed=status != "200")
            m.running.dec()

    return app


async def _chain(
    first: GenerateEvent, rest: AsyncGenerator[GenerateEvent, None]
) -> AsyncGenerator[GenerateEvent, None]:
    yield first
    async for ev in rest:
        yield ev


class _Tracker:
    """TTFT / TPOT / KV figures of one request, recorded once it ends."""

    def __init__(self, metrics: ProxyMetrics, start: float) -> None:
        self.m = metrics
        self.start = start
        self.first_token: float | None = None
        self.last_token = start
        self.tokens = 0
        self.stages: dict[str, float | int | bool] = {}
        self.done = False

    def see(self, ev: GenerateEvent) -> None:
        now = time.perf_counter()
        if ev.token_ids:
            if self.first_token is None:
                self.first_token = now
            self.last_token = now
            self.tokens += len(ev.token_ids)
        stages = ev.stages.as_dict()
        if stages:
            self.stages = stages

    def finish(self, endpoint: str, status: str, failed: bool = False) -> None:
        if self.done:
            return
        self.done = True
        self.m.requests.labels(endpoint, status).inc()
        if failed:
            self.m.failures.labels("generation").inc()
        if self.first_token is not None:
            self.m.ttft_ms.observe((self.first_token - self.start) * 1e3)
            if self.tokens > 1:
                tpot = (self.last_token - self.first_token) * 1e3 / (self.tokens - 1)
                self.m.tpot_ms.observe(tpot)
        if "kv_bytes" in self.stages:
            self.m.kv_bytes.inc(self.stages["kv_bytes"])
        if "kv_local_bytes" in self.stages:
            self.m.kv_local_bytes.inc(self.stages["kv_local_bytes"])
        if "transfer_ms" in self.stages:
            self.m.kv_transfer_ms.observe(self.stages["transfer_ms"])
        if self.stages.get("kv_load_failed"):
            self.m.kv_load_failures.inc()
