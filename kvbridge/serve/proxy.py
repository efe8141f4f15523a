"""The OpenAI-compatible HTTP front: `/v1/completions`, `/v1/chat/completions`
(streaming and not), `/v1/models`, `/health`, `/metrics`.

`make_app(backend)` builds the FastAPI app; the backend decides where tokens come from
(a disaggregated prefill -> decode pair, or a test double). Its handlers check each
request here, and `relay.GenerationRelay` answers it from the backend. Errors are OpenAI-shaped:
``{"error": {"message", "type", "param", "code"}}``. Whatever a client sends is answered
with 200 or a 4xx naming what is wrong (`openai_protocol.parse_request`; 413 for a body
over the limit, `BodyLimit`); a 5xx means the backend failed (503: no instance can
serve the request now; with the code "overloaded" and a `Retry-After` header when every
instance is full), and the app keeps serving after any of them. A client that goes away
stops its request at once, even before its first token (`disconnect.py`).

Prefix caching is isolated by `isolation` (`isolation.py`): each request's blocks are
shared only within its namespace (the client's `cache_salt`, and by policy its API key,
or its key's tenant and its `user`); `/health` says which policy is in force. With
`hide_cached_tokens` responses leave out `usage.prompt_tokens_details` and the
`kvbridge_stages` figures that show cache hits.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvbridge.errors import KVBridgeError
from kvbridge.heap import freeze_start_up
from kvbridge.serve import openai_protocol as oai
from kvbridge.serve import openai_responses as resp
from kvbridge.serve.api_keys import ApiKeys
from kvbridge.serve.backend import Backend, GenerateRequest, SamplingParams
from kvbridge.serve.body_limit import (
    BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_MB,
    BodyLimit,
    mib_to_bytes,
)
from kvbridge.serve.disconnect import warm_up_streaming
from kvbridge.serve.http_auth import RequireApiKey, bearer_key
from kvbridge.serve.http_errors import error_response, install_error_handlers
from kvbridge.serve.isolation import IsolationError, PrefixCacheIsolation, namespace
from kvbridge.serve.metrics import CONTENT_TYPE_LATEST, ProxyMetrics, merge_expositions
from kvbridge.serve.relay import GenerationRelay


def make_app(
    backend: Backend,
    metrics: ProxyMetrics | None = None,
    *,
    max_body_bytes: int = mib_to_bytes(DEFAULT_MAX_BODY_MB),
    body_timeout_s: float = BODY_TIMEOUT_S,
    api_key: ApiKeys | str | Sequence[str] | None = None,
    isolation: PrefixCacheIsolation | str | None = None,
    hide_cached_tokens: bool = False,
) -> FastAPI:
    """The proxy's app over `backend`. Request bodies over `max_body_bytes` are refused
    with 413 before they are read whole, and bodies not complete after `body_timeout_s`
    with 408 (`BodyLimit`); a body is JSON whatever Content-Type it declares
    (`curl URL -d '{...}'` declares a form). With `api_key` (`ApiKeys`: tenants' keys;
    or one key or several, of tenant "default"), /v1/... answers 401 unless the request
    carries 'Authorization: Bearer <key>' with one of them. `isolation`: the prefix-cache
    policy (default: per API key when there is one, else none); `hide_cached_tokens`:
    leave cache figures out of responses."""
    api_keys = ApiKeys.of(api_key)
    policy = PrefixCacheIsolation.resolve(isolation, bool(api_keys))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await warm_up_streaming()  # the first streamed answer loads nothing
        await backend.start()
        freeze_start_up()  # later full collections skip what start-up made
        try:
            yield
        finally:
            await backend.close()

    app = FastAPI(title="kvbridge", version="0.1.0", lifespan=lifespan)
    m = metrics or ProxyMetrics()
    relay = GenerationRelay(backend, m, hide_cached_tokens=hide_cached_tokens)
    routes = _Routes(backend, m, policy, relay, authenticated=bool(api_keys))

    if api_keys:
        app.add_middleware(RequireApiKey, api_keys=api_keys)

    app.add_middleware(
        BodyLimit,
        max_bytes=max_body_bytes,
        on_refused=routes.count_refused,
        body_timeout_s=body_timeout_s,
    )
    install_error_handlers(app)
    app.state.metrics = m
    app.state.backend = backend
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics_text, methods=["GET"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"], response_model=None)
    app.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"], response_model=None)
    return app


class _Routes:
    """The proxy's handlers over one backend, registered by `make_app` as bound methods:
    each request is parsed and checked here (a refusal is a 4xx naming the parameter,
    counted as invalid), then handed to the `GenerationRelay`."""

    def __init__(
        self,
        backend: Backend,
        metrics: ProxyMetrics,
        policy: PrefixCacheIsolation,
        relay: GenerationRelay,
        *,
        authenticated: bool,
    ) -> None:
        self.backend, self.m, self.policy, self.relay = backend, metrics, policy, relay
        self.authenticated = authenticated  # every /v1 request names its key's tenant

    def count_refused(self, status: int) -> None:
        self.m.requests.labels("invalid", str(status)).inc()

    async def health(self) -> Response:
        isolation = {
            "policy": self.policy.value,
            "shared_by": self.policy.namespace_text(self.authenticated),
            "authenticated": self.authenticated,
        }
        state = {**await self.backend.health(), "prefix_cache_isolation": isolation}
        serving = state.get("status") in ("ok", "degraded")
        return JSONResponse(state, status_code=200 if serving else 503)

    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.backend.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "kvbridge",
                }
            ],
        }

    async def metrics_text(self) -> Response:
        texts = []
        for url, text in (await self.backend.instance_metrics()).items():
            self.m.instance_up.labels(url).set(0 if text is None else 1)
            texts.append(text or "")
        exposition = merge_expositions([self.m.render(), *texts])
        return Response(exposition, media_type=CONTENT_TYPE_LATEST)

    def _refuse(self, exc: oai.ProtocolError) -> JSONResponse:
        self.count_refused(exc.status)
        return error_response(exc.status, str(exc), exc.param, exc.code)

    def _check_model(self, req: oai.CompletionRequest | oai.ChatCompletionRequest) -> None:
        if req.model is not None and req.model != self.backend.model_name:
            raise oai.ProtocolError(
                f"model={req.model!r} is not served here; use "
                f"{self.backend.model_name!r} (see GET /v1/models)",
                "model",
                status=404,
                code="model_not_found",
            )

    def _namespace(
        self, request: Request, req: oai.CompletionRequest | oai.ChatCompletionRequest
    ) -> str | None:
        tenant: str | None = getattr(request.state, "tenant", None)
        assert tenant is not None or not self.authenticated  # RequireApiKey let it in
        try:
            return namespace(
                self.policy,
                cache_salt=req.cache_salt,
                api_key=bearer_key(request.headers.get("authorization")),
                user=req.user,
                tenant=tenant,
            )
        except IsolationError as exc:
            raise oai.ProtocolError(str(exc), exc.param) from None

    @staticmethod
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

    async def completions(self, request: Request) -> Response:
        try:
            req = oai.parse_request(await request.body(), oai.CompletionRequest)
            self._check_model(req)
            prompt = req.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                if len(prompt) != 1:
                    raise oai.ProtocolError(
                        f"prompt holds {len(prompt)} prompts; send one per request", "prompt"
                    )
                prompt = prompt[0]
            salt = self._namespace(request, req)
        except oai.ProtocolError as exc:
            return self._refuse(exc)
        gen = GenerateRequest(
            request_id=resp.new_id("cmpl"),
            sampling=self._sampling(req, req.max_tokens),
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=[int(t) for t in prompt] if isinstance(prompt, list) else None,
            cache_salt=salt,
        )
        return await self.relay.respond(
            request, gen, bool(req.stream), req.stream_options, chat=False, endpoint="completions"
        )

    async def chat(self, request: Request) -> Response:
        try:
            req = oai.parse_request(await request.body(), oai.ChatCompletionRequest)
            self._check_model(req)
            salt = self._namespace(request, req)
        except oai.ProtocolError as exc:
            return self._refuse(exc)
        gen = GenerateRequest(
            request_id=resp.new_id("chatcmpl"),
            sampling=self._sampling(req, req.max_completion_tokens or req.max_tokens),
            messages=[{"role": msg.role, "content": msg.text()} for msg in req.messages],
            cache_salt=salt,
        )
        return await self.relay.respond(
            request, gen, bool(req.stream), req.stream_options, chat=True, endpoint="chat"
        )
