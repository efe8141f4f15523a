"""One generation relayed from the backend to the proxy's client.

`GenerationRelay.respond` starts a request on the backend and answers the client with
a JSON body, or with an SSE stream (`data: {...}` chunks, then `data: [DONE]`). A
failure before the first event is an OpenAI-shaped error (503 with the code
"overloaded" and `Retry-After` when every instance is full); one after it ends the
stream with an error chunk. A client that goes away stops its request at once
(`disconnect.py`). Each request is counted once in the proxy's metrics, with its
TTFT, TPOT and KV figures (`_Tracker`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvbridge.serve import openai_protocol as oai
from kvbridge.serve import openai_responses as resp
from kvbridge.serve.admission import OVERLOADED, retry_after_header
from kvbridge.serve.backend import Backend, BackendError, GenerateEvent, GenerateRequest
from kvbridge.serve.disconnect import ClientGone, ClosingStreamingResponse, until_disconnected
from kvbridge.serve.http_errors import error_response
from kvbridge.serve.metrics import ProxyMetrics

log = logging.getLogger("kvbridge.serve")


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class GenerationRelay:
    """Relays generations from `backend` to the proxy's clients; made by `make_app` and
    called from its event loop, once per request. Every request it starts is stopped on
    the backend however its response ends, and counted once in `metrics`; with
    `hide_cached_tokens` its responses leave out the figures that show cache hits."""

    def __init__(
        self, backend: Backend, metrics: ProxyMetrics, *, hide_cached_tokens: bool
    ) -> None:
        self.backend, self.m = backend, metrics
        self.hide_cached_tokens = hide_cached_tokens

    def _cached(self, ev: GenerateEvent) -> int | None:
        return None if self.hide_cached_tokens else ev.cached_tokens

    async def respond(
        self,
        request: Request,
        gen: GenerateRequest,
        stream: bool,
        options: oai.StreamOptions | None,
        *,
        chat: bool,
        endpoint: str,
    ) -> Response:
        """Run `gen` on the backend and answer `request` with its outcome (`endpoint`
        labels the metrics; `chat` picks the response shape)."""
        m = self.m
        start = time.perf_counter()
        events = self.backend.generate(gen)
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
                collect = self._collect(first, events, tracker, gen, chat, endpoint)
                return await until_disconnected(request, collect)
            except ClientGone:
                tracker.finish(endpoint, "499", failed=True)
                return error_response(499, "the client went away")
            finally:
                m.running.dec()
        include_usage = bool(options and options.include_usage)
        body = self._stream(first, events, tracker, gen, chat, endpoint, include_usage)

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
        self,
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
        use = resp.usage(last.prompt_tokens, last.completion_tokens, self._cached(last))
        text = "".join(parts)
        model = self.backend.model_name
        if chat:
            body = resp.chat_body(gen.request_id, model, text, last.finish_reason, use)
        else:
            body = resp.completion_body(gen.request_id, model, text, last.finish_reason, use)
        if (tracker.stages or last.route) and not self.hide_cached_tokens:
            body["kvbridge_stages"] = {**tracker.stages, **last.route}  # OpenAI clients ignore it
        if last.kv_load_error:  # and why the KV pull failed, when it did
            body["kvbridge_kv_load_error"] = last.kv_load_error
        return JSONResponse(body)

    async def _stream(
        self,
        first: GenerateEvent,
        events: AsyncGenerator[GenerateEvent, None],
        tracker: _Tracker,
        gen: GenerateRequest,
        chat: bool,
        endpoint: str,
        include_usage: bool,
    ) -> AsyncGenerator[str, None]:
        rid, model = gen.request_id, self.backend.model_name
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
                    use = resp.usage(ev.prompt_tokens, ev.completion_tokens, self._cached(ev))
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
            self.m.running.dec()


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
