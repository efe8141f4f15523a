"""A prefill or decode instance: one `LLMEngine` (with its tp workers and KV connector)
behind an internal HTTP API the proxy calls.

    POST /internal/prefill   GenerateRequest -> PrefillResult      (prefill role)
    POST /internal/generate  DecodeRequest   -> NDJSON GenerateEvents
         with `prefill` set: pull the KV from the prefill instance, then decode;
         without: compute the prompt here (colocated; also the recompute fallback)
    POST /internal/connect   (decode) meet prefill instances before their first request
    POST /internal/reserve   keep a place for a request about to come (the proxy, on the
                             decode instance, before it sends the prompt to prefill)
    POST /internal/cancel    give back a reservation; (prefill) release a request no
                             decode instance took
    POST /internal/lookup    GenerateRequest -> Lookup: how much of its prompt the
         prefix cache holds here, and the load (for routing; nothing is held)
    GET  /health, /metrics, /internal/info

At most `max_queued_requests` requests (and reservations) are held at once; one more is
refused at once with 503 and Retry-After, without touching the engine (`admission.py`).
A caller that goes away stops its request: a prefill still queued or running is
dropped and its blocks freed, a stream is aborted (`disconnect.py`). A prefill's
exposed KV must be taken within `claim_s` (the capability expires then) and is
released once no pull begun by then can still be reading (`exposure_lease_s`).

Bodies are msgspec JSON of at most `max_body_bytes` (413 beyond it, `BodyLimit`). A
malformed body or a request the engine refuses is answered 400; a `request_id` this
instance still holds is refused with 409 and the running request is left alone. An id
is free again once its request has completely finished and freed its blocks (a decode
request: its stream ended; a prefill request: the decode side pulled its KV, or its
lease expired), so ids need not be unique forever, only while in use. If the engine
failed, every call and `/health` answer 503 with the reason. Errors are OpenAI-shaped.
Binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvbridge.engine.errors import OutOfBlocksError
from kvbridge.engine.llm_engine import LLMEngine, RequestOutput
from kvbridge.errors import KVBridgeError, WorkerError
from kvbridge.serve import wire
from kvbridge.serve.admission import Admission, Overloaded, default_max_queued, overloaded_response
from kvbridge.serve.backend import PROTOCOL_VERSION, GenerateEvent, GenerateRequest
from kvbridge.serve.body_limit import DEFAULT_MAX_BODY_MB, BodyLimit, mib_to_bytes
from kvbridge.serve.config import KVLoadFailure, Role
from kvbridge.serve.disconnect import ClientGone, ClosingStreamingResponse, until_disconnected
from kvbridge.serve.engine_loop import (
    EngineFailedError,
    EngineLoop,
    PendingPrefill,
    Stream,
    engine_sampling,
    settle,
)
from kvbridge.serve.http_auth import RequireSignature
from kvbridge.serve.http_errors import error_response, install_error_handlers
from kvbridge.serve.metrics import CONTENT_TYPE_LATEST, InstanceMetrics
from kvbridge.transfer.capability import Capability, issue
from kvbridge.transfer.capability import check as check_capability
from kvbridge.transfer.connector import (
    Cancel,
    Connect,
    Decline,
    Expose,
    Poll,
    Pull,
    TrackedTransfer,
)
from kvbridge.transfer.errors import AuthError

#: Longest a handler waits for the engine before answering 503 (a prefill of a long
#: prompt on 2 cores takes seconds; a stuck engine must not hold clients forever).
REQUEST_TIMEOUT_S = 300.0


class _Refused(KVBridgeError):
    """A request this instance refuses with HTTP `status` (4xx)."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def _failure(exc: Exception) -> JSONResponse:
    """The answer to a request that raised `exc` before its stream began."""
    if isinstance(exc, _Refused):
        return error_response(exc.status, str(exc), code=exc.code)
    if isinstance(exc, EngineFailedError | WorkerError):
        return error_response(503, str(exc), code="engine_failed")
    if isinstance(exc, KVBridgeError):  # the engine refused the request (RequestError, ...)
        return error_response(400, str(exc))
    raise exc  # a bug: the app's handler answers an OpenAI-shaped 500


def prompt_ids(engine: LLMEngine, gen: GenerateRequest) -> list[int]:
    try:
        if gen.prompt_token_ids is not None:
            return list(gen.prompt_token_ids)
        if gen.messages is not None:
            text = engine.tokenizer.apply_chat_template(gen.messages, add_generation_prompt=True)
            return engine.tokenizer.encode(text)
        return engine.tokenizer.encode(gen.prompt or "")
    except KVBridgeError:
        raise
    except Exception as exc:  # a template or tokenizer refusing what it was given
        raise _Refused(400, f"cannot build the prompt: {type(exc).__name__}: {exc}") from None


def _sampling(gen: GenerateRequest, max_tokens: int | None = None) -> Any:
    s = gen.sampling
    return engine_sampling(
        max_tokens or s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop
    )


class _ConnectBody(msgspec.Struct, frozen=True):
    endpoints: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=256)]], msgspec.Meta(max_length=64)
    ]
    # instance_ids[i]: the id of the prefill instance at endpoints[i] (optional)
    instance_ids: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=256)]], msgspec.Meta(max_length=64)
    ] = []


_connect_decoder = msgspec.json.Decoder(_ConnectBody)


class _CancelBody(msgspec.Struct, frozen=True):
    request_id: Annotated[str, msgspec.Meta(max_length=256)]
    reason: Annotated[str, msgspec.Meta(max_length=4000)] = ""


_cancel_decoder = msgspec.json.Decoder(_CancelBody)
#: The status answered to a caller that closed its connection (nobody reads it).
CLIENT_GONE = 499
#: How long an instance polls its connector at the busy cadence after an introduction.
CONNECT_POLL_S = 30.0


async def _body(request: Request, decoder: msgspec.json.Decoder[Any]) -> Any:
    try:
        obj = decoder.decode(await request.body())
    except msgspec.DecodeError as exc:
        raise _Refused(400, f"malformed request: {exc}") from None
    gen = obj if isinstance(obj, GenerateRequest) else obj.request
    if gen.version != PROTOCOL_VERSION:
        raise _Refused(
            400, f"protocol version={gen.version}; this instance speaks {PROTOCOL_VERSION}"
        )
    return obj


class Instance:
    """The HTTP face of one engine. Owns the `EngineLoop` (and so the engine); its
    request callbacks run in the loop thread."""

    def __init__(
        self,
        loop: EngineLoop,
        role: Role,
        instance_id: str,
        model_name: str,
        kv_load_failure: KVLoadFailure = KVLoadFailure.RECOMPUTE,
        max_body_bytes: int = mib_to_bytes(DEFAULT_MAX_BODY_MB),
        token: bytes | None = None,
        claim_s: float = 10.0,
        exposure_lease_s: float | None = None,
        max_queued_requests: int | None = None,
    ) -> None:
        self.loop = loop
        self.role = role
        self.instance_id = instance_id
        self.model_name = model_name
        self.kv_load_failure = kv_load_failure
        self.max_body_bytes = max_body_bytes
        self.token = token  # signs capabilities and requires signed calls (http_auth)
        self.claim_s = claim_s  # a pull capability expires this long after it is issued
        self.exposure_lease_s = exposure_lease_s  # None: the transfer config's lease
        self.endpoint = ""
        self.metrics = InstanceMetrics(instance_id, role.value)
        bm = loop.engine.block_manager
        limit = max_queued_requests or default_max_queued(
            bm.num_blocks, loop.engine.config.max_num_seqs
        )
        self.admission = Admission(limit, f"{role.value} instance {instance_id}")
        self.metrics.max_queued.set(limit)

    # -- engine-thread callbacks -----------------------------------------------------------
    def _claim(self, rid: str) -> None:
        """Refuse an id this instance still holds (see the module docstring)."""
        loop = self.loop
        if rid in loop.streams or rid in loop.prefills or rid in loop.tracker.transfers:
            raise _Refused(
                409,
                f"request_id={rid!r} is in use on this instance (its request is running or "
                "still holds KV blocks); send a fresh id, or reuse it once that request ended",
                code="request_id_in_use",
            )

    def _start_prefill(
        self, engine: LLMEngine, gen: GenerateRequest
    ) -> concurrent.futures.Future[wire.PrefillResult]:
        rid = gen.request_id
        self._claim(rid)
        ids = prompt_ids(engine, gen)
        params = _sampling(gen)
        fut: concurrent.futures.Future[wire.PrefillResult] = concurrent.futures.Future()
        started = time.perf_counter()

        def on_prefilled(_: RequestOutput) -> None:
            comp = engine.pop(rid)
            self._count_hit(comp.num_cached_tokens)
            if fut.cancelled():  # the caller gave up waiting: nobody will pull this KV
                engine.release_blocks(comp.block_ids)
                return
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
                # the reader holds [0, start) already: only the blocks from there are exposed
                start = min(max(gen.kv_start_token, 0), len(ids))
                exposed = comp.block_ids[start // engine.config.block_size :]
                try:
                    engine.connector_call(
                        Expose(
                            rid,
                            exposed,
                            len(ids),
                            reader=gen.kv_reader,
                            start_token=start,
                            lease_s=self.exposure_lease_s,
                        )
                    )
                except Exception:
                    engine.release_blocks(comp.block_ids)
                    raise
                self.loop.tracker.track(
                    rid,
                    comp.block_ids,
                    self.loop.world_size,
                    on_done=lambda tr: engine.release_blocks(tr.block_ids),
                )
                cap = Capability(
                    rid,
                    self.instance_id,
                    self.endpoint,
                    list(exposed),
                    len(ids),
                    gen.kv_reader or "",
                    time.time() + self.claim_s,
                    start,
                    engine.config.block_size,
                )
                kv = wire.KVParams(self.instance_id, issue(cap, self.token))
            else:
                engine.release_blocks(comp.block_ids)
            elapsed_ms = (time.perf_counter() - started) * 1e3
            result = wire.PrefillResult(
                rid,
                ids,
                first,
                text,
                finish,
                kv,
                elapsed_ms,
                comp.num_cached_tokens,
                self.instance_id,
            )
            settle(fut, result)

        engine.add_request(ids, params, request_id=rid, prefill_only=True)
        self.loop.prefills[rid] = PendingPrefill(fut, on_prefilled)
        return fut

    def _start_generate(self, engine: LLMEngine, req: wire.DecodeRequest, stream: Stream) -> None:
        gen, pf = req.request, req.prefill
        rid = gen.request_id
        self._claim(rid)
        stream.route["decode_instance"] = self.instance_id
        if pf is None:  # colocated: the whole request here
            ids = prompt_ids(engine, gen)
            engine.add_request(ids, _sampling(gen), request_id=rid)
            stream.prompt_tokens = len(ids)
            self.loop.streams[rid] = stream
            return
        ids = pf.prompt_token_ids
        cap = self._capability(pf) if pf.kv is not None else None
        stream.prompt_tokens = len(ids)
        stream.completion_tokens = 1  # the proxy already sent the first token
        stream.stages["prefill_ms"] = pf.prefill_ms
        stream.stages["prefill_cached_tokens"] = float(pf.cached_tokens)
        stream.cached_tokens = pf.cached_tokens
        stream.route["prefill_instance"] = pf.instance_id
        self.loop.streams[rid] = stream  # held from here on: its id is refused (409)
        if pf.kv is None or not self.loop.has_connector:
            reason = "no KV to pull" if pf.kv is None else "this instance has no KV connector"
            self._recompute(engine, req, stream, reason)
            return
        assert cap is not None
        try:
            # the prompt's cached prefix stays here: only tokens [cached, end) are pulled
            # (at least the last one: a prompt held whole the proxy sends here alone)
            blocks, cached = engine.allocate_for_prompt(ids, max_cached=len(ids) - 1)
        except OutOfBlocksError as exc:
            self._decline(engine, req, stream, cap, f"no free blocks to receive the KV: {exc}")
            return
        self._count_hit(cached)
        if cached < cap.start_token:  # evicted since the proxy asked: [cached, start) lacks
            engine.release_blocks(blocks)
            self._decline(
                engine,
                req,
                stream,
                cap,
                f"the prefix cache holds {cached} tokens of the prompt, fewer than the "
                f"{cap.start_token} the prefill instance left out",
            )
            return
        bp, bd = cap.block_size, engine.config.block_size
        try:
            engine.connector_call(
                Pull(
                    rid,
                    cap.endpoint,
                    cap.block_ids[cached // bp - cap.start_token // bp :],
                    blocks[cached // bd :],
                    cap.num_tokens,
                    start_token=cached,
                )
            )
        except Exception as exc:
            engine.release_blocks(blocks)
            self._recompute(engine, req, stream, str(exc))
            return
        self.loop.tracker.track(
            rid,
            blocks,
            self.loop.world_size,
            on_done=lambda tr: self._pulled(engine, req, stream, tr, cached),
        )

    def _decline(
        self,
        engine: LLMEngine,
        req: wire.DecodeRequest,
        stream: Stream,
        cap: Capability,
        reason: str,
    ) -> None:
        """Pull nothing: the prefill instance frees its blocks now (not at its lease),
        and the prompt is computed here (or the request fails, by policy)."""
        engine.connector_call(Decline(req.request.request_id, cap.endpoint, reason))
        self.loop.busy_until = time.monotonic() + CONNECT_POLL_S
        self._recompute(engine, req, stream, reason)

    def _count_hit(self, cached_tokens: int) -> None:
        self.metrics.prefix_queries.inc()
        if cached_tokens:
            self.metrics.prefix_hits.inc()
            self.metrics.prefix_hit_tokens.inc(cached_tokens)

    def _capability(self, pf: wire.PrefillResult) -> Capability:
        """The pull capability of a prefill result, checked: signed with our token, issued
        to this instance, unexpired, for this request's prompt. 403 otherwise: this
        instance pulls nothing its caller names on its own."""
        assert pf.kv is not None
        try:
            cap = check_capability(pf.kv.capability, self.token, self.instance_id)
        except AuthError as exc:
            raise _Refused(
                403, f"KV capability refused: {exc}", code="capability_refused"
            ) from None
        if cap.block_size <= 0 or not 0 <= cap.start_token <= cap.num_tokens:
            raise _Refused(
                403,
                f"KV capability refused: block_size={cap.block_size} and start_token="
                f"{cap.start_token} of {cap.num_tokens} tokens do not describe blocks",
                code="capability_refused",
            )
        if cap.request_id != pf.request_id or cap.num_tokens != len(pf.prompt_token_ids):
            raise _Refused(
                403,
                f"KV capability refused: it covers request {cap.request_id!r} with "
                f"{cap.num_tokens} tokens, not {pf.request_id!r} with "
                f"{len(pf.prompt_token_ids)}",
                code="capability_refused",
            )
        return cap

    def _pulled(
        self,
        engine: LLMEngine,
        req: wire.DecodeRequest,
        stream: Stream,
        tr: TrackedTransfer,
        cached: int = 0,
    ) -> None:
        """A pull ended (every worker reported): decode, or handle the failure. Runs in
        the loop thread inside a connector poll, so it never raises."""
        gen, pf = req.request, req.prefill
        assert pf is not None
        rid = gen.request_id
        stream.stages["transfer_ms"] = (time.perf_counter() - tr.started) * 1e3
        stream.stages["kv_bytes"] = float(tr.nbytes)
        self.metrics.kv_bytes.inc(tr.nbytes)
        if self.loop.streams.get(rid) is not stream:  # aborted while pulling
            engine.release_blocks(tr.block_ids)
            return
        if tr.failures:
            engine.release_blocks(tr.block_ids)
            self._recompute(engine, req, stream, "; ".join(sorted(set(tr.failures))))
            return
        spec = engine.model_config.kv_spec(engine.config.kv_dtype)
        self.metrics.kv_bytes_saved.inc(cached * spec.bytes_per_token)
        try:
            engine.add_prefilled_request(
                pf.prompt_token_ids,
                pf.first_token_id,
                tr.block_ids,
                _sampling(gen),
                request_id=rid,
                num_cached_tokens=cached,
            )
        except Exception as exc:
            engine.release_blocks(tr.block_ids)
            self._end(rid, stream, f"decoding could not start: {exc}")
            return
        if engine.is_finished(rid):  # the first token filled the context: no step will come
            reason = engine.completion(rid).finish_reason
            self.loop.deliver(RequestOutput(rid, [], "", True, reason))

    def _recompute(
        self, engine: LLMEngine, req: wire.DecodeRequest, stream: Stream, reason: str
    ) -> None:
        """The KV pull failed: compute the prompt here, or fail the request (policy)."""
        gen, pf = req.request, req.prefill
        assert pf is not None
        self.metrics.load_failures.inc()
        stream.stages["kv_load_failed"] = 1.0
        stream.kv_load_error = reason
        stream.cached_tokens = None  # computed here after all: this engine's hit counts
        if self.kv_load_failure is KVLoadFailure.FAIL:
            self._end(gen.request_id, stream, f"KV cache load failed: {reason}")
            return
        try:
            engine.add_request(
                [*pf.prompt_token_ids, pf.first_token_id],
                _sampling(gen, gen.sampling.max_tokens - 1),
                request_id=gen.request_id,
            )
        except Exception as exc:
            self._end(gen.request_id, stream, f"KV cache load failed ({reason}); recompute: {exc}")

    def _end(self, rid: str, stream: Stream, error: str) -> None:
        """End a request that is not in the engine with `error` (frees its id)."""
        if self.loop.streams.get(rid) is stream:
            del self.loop.streams[rid]
        stream.put(GenerateEvent(error=error, kv_load_error=stream.kv_load_error))

    def _abort(self, engine: LLMEngine, rid: str, stream: Stream) -> None:
        """The reader of `stream` went away: stop its request and free its blocks."""
        if self.loop.streams.get(rid) is not stream:
            return  # it ended already
        del self.loop.streams[rid]
        if rid in self.loop.tracker.transfers:
            return  # pulling: `_pulled` frees the blocks once the pull ends
        engine.abort(rid)
        engine.pop(rid)

    def _drop_prefill(
        self, engine: LLMEngine, rid: str, fut: concurrent.futures.Future[Any]
    ) -> None:
        """The caller of a prefill went away: drop it if it is still queued or running
        (its blocks are freed); once prefilled, its cancelled future frees them."""
        pending = self.loop.prefills.get(rid)
        if pending is None or pending.future is not fut:
            return
        del self.loop.prefills[rid]
        engine.abort(rid)
        engine.pop(rid)

    def _refuse_overloaded(self, exc: Overloaded) -> JSONResponse:
        self.metrics.rejected.inc()
        return overloaded_response(exc)

    # -- HTTP ---------------------------------------------------------------------------
    def app(self) -> FastAPI:
        app = FastAPI(title=f"kvbridge {self.role.value} instance")
        if self.token is not None:  # inside the body limit: the body it buffers is bounded
            app.add_middleware(RequireSignature, token=self.token)
        app.add_middleware(BodyLimit, max_bytes=self.max_body_bytes)
        install_error_handlers(app)

        @app.get("/health")
        async def health() -> Response:
            state = {"role": self.role.value, "instance_id": self.instance_id}
            if self.loop.fatal:
                return JSONResponse({"status": "failed", "reason": self.loop.fatal, **state}, 503)
            return JSONResponse({"status": "ok", **state})

        @app.get("/internal/info")
        async def info() -> dict[str, Any]:
            return {
                "role": self.role.value,
                "instance_id": self.instance_id,
                "model": self.model_name,
                "endpoint": self.endpoint,
                "tp": self.loop.world_size,
                "pid": os.getpid(),
                "version": PROTOCOL_VERSION,
            }

        @app.get("/metrics")
        async def metrics() -> Response:
            def snapshot(engine: LLMEngine) -> tuple[int, int, int]:
                if self.loop.has_connector:  # fresh transfer figures (events are handled)
                    self.loop.tracker.feed(engine.connector_call(Poll()))
                bm = engine.block_manager
                used = bm.num_blocks - bm.num_free_blocks
                return used, bm.num_blocks, bm.num_cached_free_blocks

            try:
                used, total, cached_free = await self.loop.acall(snapshot, timeout=10.0)
                self.metrics.blocks_in_use.set(used)
                self.metrics.blocks_total.set(total)
                self.metrics.blocks_cached_free.set(cached_free)
            except (EngineFailedError, TimeoutError):
                pass  # the figures last seen stay
            self.metrics.pinned_blocks.set(self.loop.tracker.pinned_blocks)
            self.metrics.queued.set(self.admission.num_held)
            self.metrics.replays_refused.set(self.loop.tracker.replays_refused)
            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

        @app.post("/internal/reserve")
        async def reserve(request: Request) -> Response:
            """Keep a place for a request about to come (body {"request_id"}): 200, or
            503 with Retry-After when full. Given back when the request arrives, on
            /internal/cancel, or after `admission.RESERVATION_S`."""
            if self.loop.fatal:
                return error_response(503, self.loop.fatal, code="engine_failed")
            try:
                body = _cancel_decoder.decode(await request.body())
                self.admission.reserve(body.request_id)
            except msgspec.DecodeError as exc:
                return error_response(400, f"malformed request: {exc}")
            except Overloaded as exc:
                return self._refuse_overloaded(exc)
            return JSONResponse({"reserved": True})

        @app.post("/internal/cancel")
        async def cancel(request: Request) -> Response:
            """Give back a request's reservation, and release a prefilled request's KV
            now (prefill instances): body {"request_id", "reason"}. The proxy sends it
            when no decode instance took the request, so nobody will read the blocks."""
            try:
                body = _cancel_decoder.decode(await request.body())
            except msgspec.DecodeError as exc:
                return error_response(400, f"malformed request: {exc}")
            if self.admission.cancel(body.request_id):
                return JSONResponse({"cancelled": True})
            if body.request_id not in self.loop.tracker.transfers or self.role is not Role.PREFILL:
                return JSONResponse({"cancelled": False})

            def run(engine: LLMEngine) -> None:
                engine.connector_call(Cancel(body.request_id, body.reason))
                self.loop.tracker.feed(engine.connector_call(Poll()))  # release the blocks now

            try:
                await self.loop.acall(run, timeout=30.0)
            except Exception as exc:
                return _failure(exc)
            return JSONResponse({"cancelled": True})

        @app.post("/internal/lookup")
        async def lookup(request: Request) -> Response:
            """How much of a request's prompt this instance's prefix cache holds now, and
            how busy it is: what the proxy routes by. Holds nothing."""
            try:
                gen = await _body(request, wire.generate_request_decoder)

                def run(engine: LLMEngine) -> wire.Lookup:
                    ids = prompt_ids(engine, gen)
                    cached = engine.cached_prefix_len(ids)
                    bs = engine.config.block_size
                    held = self.admission.num_held
                    return wire.Lookup(self.instance_id, len(ids), cached, bs, held)

                answer = await self.loop.acall(run, timeout=30.0)
            except Exception as exc:
                return _failure(exc)
            return Response(msgspec.json.encode(answer), media_type="application/json")

        @app.post("/internal/connect")
        async def connect(request: Request) -> Response:
            """Meet prefill instances ahead of their first request (decode instances):
            body {"endpoints": [side channel, ...], "instance_ids": [their ids]
            (optional)}; returns at once with the endpoints every worker has met
            ("connected"): the caller repeats the call until all are."""
            if self.role is not Role.DECODE or not self.loop.has_connector:
                return error_response(404, "only a decode instance with a KV connector connects")
            try:
                body = _connect_decoder.decode(await request.body())
            except msgspec.DecodeError as exc:
                return error_response(400, f"malformed request: {exc}")

            ids = body.instance_ids + [""] * (len(body.endpoints) - len(body.instance_ids))

            def start(engine: LLMEngine) -> list[str]:
                met = [
                    endpoint
                    for endpoint, iid in zip(body.endpoints, ids, strict=False)
                    if all(r.connected for r in engine.connector_call(Connect(endpoint, iid)))
                ]
                if len(met) < len(body.endpoints):  # handshakes to progress (tp 1: here)
                    self.loop.busy_until = time.monotonic() + CONNECT_POLL_S
                return met

            try:
                connected = await self.loop.acall(start, timeout=30.0)
            except Exception as exc:
                return _failure(exc)
            return JSONResponse({"connecting": body.endpoints, "connected": connected})

        @app.post("/internal/prefill")
        async def prefill(request: Request) -> Response:
            if self.role is not Role.PREFILL:
                return error_response(404, "this is a decode instance; POST /internal/generate")
            try:
                gen = await _body(request, wire.generate_request_decoder)
                ticket = self.admission.admit(gen.request_id)
            except Overloaded as exc:
                return self._refuse_overloaded(exc)
            except Exception as exc:
                return _failure(exc)
            started: concurrent.futures.Future[wire.PrefillResult] | None = None
            try:
                started = await self.loop.acall(lambda e: self._start_prefill(e, gen))
                waited = asyncio.wait_for(asyncio.wrap_future(started), REQUEST_TIMEOUT_S)
                result = await until_disconnected(request, waited)
            except (ClientGone, TimeoutError) as exc:  # nobody will read it: stop computing it
                if started is not None:
                    dropped = started
                    self.loop.call(lambda e: self._drop_prefill(e, gen.request_id, dropped))
                if isinstance(exc, ClientGone):
                    return error_response(CLIENT_GONE, "the caller went away")
                return error_response(
                    503, f"the engine did not answer within {REQUEST_TIMEOUT_S:.0f} s"
                )
            except Exception as exc:
                return _failure(exc)
            finally:
                ticket.release()
            return Response(msgspec.json.encode(result), media_type="application/json")

        @app.post("/internal/generate")
        async def generate(request: Request) -> Response:
            try:
                req = await _body(request, wire.decode_request_decoder)
                ticket = self.admission.admit(req.request.request_id)
            except Overloaded as exc:
                return self._refuse_overloaded(exc)
            except Exception as exc:
                return _failure(exc)
            stream = Stream(asyncio.get_running_loop(), asyncio.Queue(), 0)
            try:
                await self.loop.acall(lambda e: self._start_generate(e, req, stream))
            except TimeoutError:
                ticket.release()
                return error_response(
                    503, f"the engine did not answer within {REQUEST_TIMEOUT_S:.0f} s"
                )
            except Exception as exc:
                ticket.release()
                return _failure(exc)
            rid = req.request.request_id

            async def close() -> None:
                """However the stream ended: give back its place; if the proxy went
                away or gave up, stop generating and free the blocks (a no-op for a
                request that ended)."""
                ticket.release()
                self.loop.call(lambda e: self._abort(e, rid, stream))

            return ClosingStreamingResponse(
                self._events(stream), on_close=close, media_type="application/x-ndjson"
            )

        return app

    async def _events(self, stream: Stream) -> AsyncIterator[bytes]:
        """The stream's events as NDJSON, up to its last (finish or error)."""
        while True:
            try:
                ev = await asyncio.wait_for(stream.queue.get(), REQUEST_TIMEOUT_S)
            except TimeoutError:
                message = f"no token within {REQUEST_TIMEOUT_S:.0f} s"
                yield msgspec.json.encode(GenerateEvent(error=message, error_status=503)) + b"\n"
                return
            yield msgspec.json.encode(ev) + b"\n"
            if ev.finish_reason and "transfer_ms" not in ev.stages:  # computed here
                self._count_hit(int(ev.stages.get("cached_tokens", 0)))
            if ev.finish_reason or ev.error:
                return
