"""The internal HTTP API of one instance (`Instance`), as small named handlers:

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
         prefix cache holds here, where a pull would start, and the load (for routing)
    GET  /health, /metrics, /internal/info

Bodies are msgspec JSON of at most `max_body_bytes` (413 beyond it, `BodyLimit`). A
malformed body or a request the engine refuses is answered 400; a capability not valid
here 403; an id in use 409. If the engine failed, every call and `/health` answer 503
with the reason. Errors are OpenAI-shaped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvbridge.errors import KVBridgeError, WorkerError
from kvbridge.heap import freeze_start_up
from kvbridge.serve import wire
from kvbridge.serve.admission import Overloaded, overloaded_response
from kvbridge.serve.backend import PROTOCOL_VERSION, GenerateEvent, GenerateRequest
from kvbridge.serve.body_limit import BodyLimit
from kvbridge.serve.config import Role
from kvbridge.serve.disconnect import (
    ClientGone,
    ClosingStreamingResponse,
    until_disconnected,
    warm_up_streaming,
)
from kvbridge.serve.engine_loop import EngineFailedError
from kvbridge.serve.http_auth import RequireSignature
from kvbridge.serve.http_errors import error_response, install_error_handlers
from kvbridge.serve.instance import Instance, Refused
from kvbridge.serve.metrics import CONTENT_TYPE_LATEST
from kvbridge.serve.streams import Stream

#: Longest a handler waits for the engine before answering 503 (a prefill of a long
#: prompt on 2 cores takes seconds; a stuck engine must not hold clients forever).
REQUEST_TIMEOUT_S = 300.0
#: The status answered to a caller that closed its connection (nobody reads it).
CLIENT_GONE = 499
_Name = Annotated[str, msgspec.Meta(max_length=256)]


class _ConnectBody(msgspec.Struct, frozen=True):
    endpoints: Annotated[list[_Name], msgspec.Meta(max_length=64)]
    #: instance_ids[i]: the id of the prefill instance at endpoints[i] (optional)
    instance_ids: Annotated[list[_Name], msgspec.Meta(max_length=64)] = []


class _CancelBody(msgspec.Struct, frozen=True):
    request_id: _Name
    reason: Annotated[str, msgspec.Meta(max_length=4000)] = ""


#: Bodies of the small control calls: far less than a prompt (`max_body_bytes`).
CONTROL_BODY_LIMITS = {
    path: 64 << 10 for path in ("/internal/reserve", "/internal/cancel", "/internal/connect")
}
_connect_decoder = msgspec.json.Decoder(_ConnectBody)
_cancel_decoder = msgspec.json.Decoder(_CancelBody)


@contextlib.asynccontextmanager
async def _lifespan(_: FastAPI) -> AsyncIterator[None]:
    await warm_up_streaming()  # the first /internal/generate loads nothing beside its pull
    freeze_start_up()  # later full collections skip what start-up made
    yield


def build_app(inst: Instance) -> FastAPI:
    app = FastAPI(title=f"kvbridge {inst.role.value} instance", lifespan=_lifespan)
    app.state.instance = inst
    app.add_middleware(BodyLimit, max_bytes=inst.max_body_bytes, path_limits=CONTROL_BODY_LIMITS)
    if inst.token is not None:  # outermost: refuses from the headers, before any read
        app.add_middleware(RequireSignature, token=inst.token, audience=inst.instance_id)
    install_error_handlers(app)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/internal/info", info, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    for path, handler in [
        ("/internal/reserve", reserve),
        ("/internal/cancel", cancel),
        ("/internal/lookup", lookup),
        ("/internal/connect", connect),
        ("/internal/prefill", prefill),
        ("/internal/generate", generate),
    ]:
        app.add_api_route(path, handler, methods=["POST"], response_model=None)
    return app


def _inst(request: Request) -> Instance:
    inst: Instance = request.app.state.instance
    return inst


def _failure(exc: Exception) -> JSONResponse:
    """The answer to a request that raised `exc` before its stream began."""
    if isinstance(exc, Refused):
        return error_response(exc.status, str(exc), code=exc.code)
    if isinstance(exc, EngineFailedError | WorkerError):
        return error_response(503, str(exc), code="engine_failed")
    if isinstance(exc, TimeoutError):
        return error_response(503, f"the engine did not answer within {REQUEST_TIMEOUT_S:.0f} s")
    if isinstance(exc, KVBridgeError):  # the engine refused the request (RequestError, ...)
        return error_response(400, str(exc))
    raise exc  # a bug: the app's handler answers an OpenAI-shaped 500


async def _body(request: Request, decoder: msgspec.json.Decoder[Any]) -> Any:
    try:
        obj = decoder.decode(await request.body())
    except msgspec.DecodeError as exc:
        raise Refused(400, f"malformed request: {exc}") from None
    gen = obj if isinstance(obj, GenerateRequest) else getattr(obj, "request", None)
    if isinstance(gen, GenerateRequest) and gen.version != PROTOCOL_VERSION:
        raise Refused(
            400, f"protocol version={gen.version}; this instance speaks {PROTOCOL_VERSION}"
        )
    return obj


def _json(obj: Any) -> Response:
    return Response(msgspec.json.encode(obj), media_type="application/json")


async def health(request: Request) -> Response:
    inst = _inst(request)
    state = {"role": inst.role.value, "instance_id": inst.instance_id}
    if inst.loop.fatal:
        return JSONResponse({"status": "failed", "reason": inst.loop.fatal, **state}, 503)
    return JSONResponse({"status": "ok", **state})


async def info(request: Request) -> dict[str, Any]:
    inst = _inst(request)
    return {
        "role": inst.role.value,
        "instance_id": inst.instance_id,
        "model": inst.model_name,
        "endpoint": inst.endpoint,
        "tp": inst.loop.world_size,
        "pid": os.getpid(),
        "version": PROTOCOL_VERSION,
    }


async def metrics(request: Request) -> Response:
    inst = _inst(request)
    with contextlib.suppress(EngineFailedError, TimeoutError):  # else the last figures stay
        await inst.loop.acall(inst.snapshot, timeout=10.0)
    inst.metrics.queued.set(inst.admission.num_held)
    return Response(inst.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def reserve(request: Request) -> Response:
    """Keep a place for a request about to come (body {"request_id"}): 200, or 503 with
    Retry-After when full. Given back when the request arrives, on /internal/cancel, or
    after `admission.RESERVATION_S`."""
    inst = _inst(request)
    if inst.loop.fatal:
        return error_response(503, inst.loop.fatal, code="engine_failed")
    try:
        inst.admission.reserve(_cancel_decoder.decode(await request.body()).request_id)
    except msgspec.DecodeError as exc:
        return error_response(400, f"malformed request: {exc}")
    except Overloaded as exc:
        inst.metrics.rejected.inc()
        return overloaded_response(exc)
    return JSONResponse({"reserved": True})


async def cancel(request: Request) -> Response:
    """Give back a request's reservation, and release a prefilled request's KV now
    (prefill instances): body {"request_id", "reason"}. The proxy sends it when no
    decode instance took the request, so nobody will read the blocks."""
    inst = _inst(request)
    try:
        body = _cancel_decoder.decode(await request.body())
    except msgspec.DecodeError as exc:
        return error_response(400, f"malformed request: {exc}")
    if inst.admission.cancel(body.request_id):
        return JSONResponse({"cancelled": True})
    if inst.role is not Role.PREFILL:
        return JSONResponse({"cancelled": False})
    try:
        done = await inst.loop.acall(lambda e: inst.cancel(e, body.request_id, body.reason), 30.0)
    except Exception as exc:
        return _failure(exc)
    return JSONResponse({"cancelled": done})


async def lookup(request: Request) -> Response:
    """How much of a request's prompt this instance's prefix cache holds now, where its
    pull would start, and how busy it is: what the proxy routes by. Holds nothing."""
    inst = _inst(request)
    try:
        gen = await _body(request, wire.generate_request_decoder)
        return _json(await inst.loop.acall(lambda e: inst.lookup(e, gen), timeout=30.0))
    except Exception as exc:
        return _failure(exc)


async def connect(request: Request) -> Response:
    """Meet prefill instances ahead of their first request (decode instances): body
    {"endpoints": [side channel, ...], "instance_ids": [their ids] (optional)}; returns
    at once with the endpoints every worker has met ("connected"): the caller repeats
    the call until all are."""
    inst = _inst(request)
    if inst.role is not Role.DECODE or inst.loop.engine.kv is None:
        return error_response(404, "only a decode instance with a KV connector connects")
    try:
        body = _connect_decoder.decode(await request.body())
        connected = await inst.loop.acall(
            lambda e: e.connect_kv(body.endpoints, body.instance_ids), timeout=30.0
        )
    except msgspec.DecodeError as exc:
        return error_response(400, f"malformed request: {exc}")
    except Exception as exc:
        return _failure(exc)
    return JSONResponse({"connecting": body.endpoints, "connected": connected})


async def prefill(request: Request) -> Response:
    inst = _inst(request)
    if inst.role is not Role.PREFILL:
        return error_response(404, "this is a decode instance; POST /internal/generate")
    try:
        gen = await _body(request, wire.generate_request_decoder)
        ticket = inst.admission.admit(gen.request_id)
    except Overloaded as exc:
        inst.metrics.rejected.inc()
        return overloaded_response(exc)
    except Exception as exc:
        return _failure(exc)
    started: concurrent.futures.Future[wire.PrefillResult] | None = None
    try:
        started = await inst.loop.acall(lambda e: inst.start_prefill(e, gen))
        waited = asyncio.wait_for(asyncio.wrap_future(started), REQUEST_TIMEOUT_S)
        return _json(await until_disconnected(request, waited))
    except (ClientGone, TimeoutError) as exc:  # nobody will read it: stop computing it
        if started is not None:
            dropped = started
            inst.loop.call(lambda e: inst.abort(e, gen.request_id, dropped))
        if isinstance(exc, ClientGone):
            return error_response(CLIENT_GONE, "the caller went away")
        return _failure(exc)
    except Exception as exc:
        return _failure(exc)
    finally:
        ticket.release()


async def generate(request: Request) -> Response:
    inst = _inst(request)
    try:
        req = await _body(request, wire.decode_request_decoder)
        ticket = inst.admission.admit(req.request.request_id)
    except Overloaded as exc:
        inst.metrics.rejected.inc()
        return overloaded_response(exc)
    except Exception as exc:
        return _failure(exc)
    stream = inst.new_stream(req.prefill)
    try:
        await inst.loop.acall(lambda e: inst.start_generate(e, req, stream))
    except Exception as exc:
        ticket.release()
        return _failure(exc)
    rid = req.request.request_id

    async def close() -> None:
        """However the stream ended: give back its place; if the proxy went away or
        gave up, stop generating and free the blocks (a no-op for one that ended)."""
        ticket.release()
        inst.loop.call(lambda e: inst.abort(e, rid, stream))

    return ClosingStreamingResponse(
        _events(stream), on_close=close, media_type="application/x-ndjson"
    )


async def _events(stream: Stream) -> AsyncIterator[bytes]:
    """The stream's events as NDJSON, up to its last (finish or error)."""
    while True:
        try:
            ev = await asyncio.wait_for(stream.queue.get(), REQUEST_TIMEOUT_S)
        except TimeoutError:
            message = f"no token within {REQUEST_TIMEOUT_S:.0f} s"
            yield msgspec.json.encode(GenerateEvent(error=message, error_status=503)) + b"\n"
            return
        yield msgspec.json.encode(ev) + b"\n"
        if ev.finish_reason or ev.error:
            return
