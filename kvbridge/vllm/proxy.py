"""A proxy for a vLLM prefill/decode pair using KVBridgeConnector (or any connector
speaking vLLM's kv_transfer_params).

Each OpenAI request (/v1/completions, /v1/chat/completions) becomes vLLM's two-step
P/D request: the prefill instance gets it with ``max_tokens`` 1, no streaming and
``kv_transfer_params`` {"do_remote_decode": true} (plus the decode instance's id as
the capability's reader when given); the decode instance gets the original request
with the params the prefill returned, and its answer (streamed or not) goes back
as is. A prefill that fails or returns no params is answered with its status and
reason. Binds 127.0.0.1 unless told.

    python -m kvbridge.vllm.proxy --prefill http://127.0.0.1:8100 \
        --decode http://127.0.0.1:8200 [--decode-instance-id ID] [--port 8000]
"""

from __future__ import annotations

import argparse
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvbridge.vllm.scheduler import READER_KEY

#: Longest a prefill or a whole non-streamed decode may take (seconds).
TIMEOUT_S = 600.0


def make_app(prefill: str, decode: str, reader: str | None = None) -> FastAPI:
    app = FastAPI(title="kvbridge proxy for vLLM")
    client = httpx.AsyncClient(timeout=TIMEOUT_S)

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": message, "type": "proxy_error", "code": status}}, status
        )

    async def two_step(path: str, request: Request) -> Response:
        body = await request.json()
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        kv: dict[str, Any] = {"do_remote_decode": True}
        if reader:
            kv[READER_KEY] = reader
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": kv}
        first.pop("stream_options", None)
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        try:
            r = await client.post(prefill + path, json=first)
        except httpx.HTTPError as exc:
            return error(502, f"prefill instance {prefill} did not answer: {exc}")
        if r.status_code != 200:
            return Response(r.content, r.status_code, media_type="application/json")
        params = r.json().get("kv_transfer_params")
        if not params:
            return error(
                502,
                f"prefill instance {prefill} returned no kv_transfer_params: is it "
                "started with --kv-transfer-config naming a producer connector?",
            )
        second = {**body, "kv_transfer_params": params}
        if body.get("stream"):
            req = client.build_request("POST", decode + path, json=second)
            try:
                resp = await client.send(req, stream=True)
            except httpx.HTTPError as exc:
                return error(502, f"decode instance {decode} did not answer: {exc}")

            async def relay() -> Any:
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                finally:
                    await resp.aclose()

            return StreamingResponse(
                relay(), resp.status_code, media_type=resp.headers.get("content-type")
            )
        try:
            r = await client.post(decode + path, json=second)
        except httpx.HTTPError as exc:
            return error(502, f"decode instance {decode} did not answer: {exc}")
        return Response(r.content, r.status_code, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await two_step("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await two_step("/v1/chat/completions", request)

    @app.get("/health")
    async def health() -> Response:
        for url in (prefill, decode):
            try:
                r = await client.get(url + "/health", timeout=5)
            except httpx.HTTPError as exc:
                return error(503, f"{url} did not answer: {exc}")
            if r.status_code != 200:
                return error(503, f"{url}/health answered {r.status_code}")
        return Response(status_code=200)

    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", required=True, help="the prefill instance's URL")
    ap.add_argument("--decode", required=True, help="the decode instance's URL")
    ap.add_argument(
        "--decode-instance-id",
        default=None,
        help="the decode instance's kvbridge instance_id: only it may pull (else any "
        "holder of the token)",
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)
    import uvicorn

    app = make_app(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.decode_instance_id)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
