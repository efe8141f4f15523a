"""kvbridge.vllm.proxy makes vLLM's two-step P/D request (real HTTP servers on 127.0.0.1;
the vLLM pair is a stand-in that records what it was sent)."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request

from kvbridge.vllm.launch import free_port
from kvbridge.vllm.proxy import make_app


def serve(app: FastAPI) -> tuple[str, uvicorn.Server]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        if server.started:
            break
        time.sleep(0.05)
    return url, server


def test_prefill_with_one_token_then_decode_with_its_params() -> None:
    seen: list[dict[str, Any]] = []
    pair = FastAPI()

    @pair.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        body = await request.json()
        seen.append(body)
        if body["kv_transfer_params"].get("do_remote_decode"):
            return {"kv_transfer_params": {"kvbridge_capability": "c"}, "choices": [{"text": "P"}]}
        return {"choices": [{"text": " Paris."}]}

    up, up_server = serve(pair)
    proxy, proxy_server = serve(make_app(up, up, reader="decode-1"))
    try:
        r = httpx.post(proxy + "/v1/completions", json={"prompt": "q", "max_tokens": 5})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " Paris."
        first, second = seen
        assert first["max_tokens"] == 1 and first["stream"] is False
        assert first["kv_transfer_params"] == {
            "do_remote_decode": True,
            "kvbridge_reader": "decode-1",
        }
        assert second["max_tokens"] == 5
        assert second["kv_transfer_params"] == {"kvbridge_capability": "c"}
    finally:
        up_server.should_exit = proxy_server.should_exit = True


def test_a_prefill_without_params_is_answered_with_the_reason() -> None:
    pair = FastAPI()

    @pair.post("/v1/completions")
    async def completions() -> dict[str, Any]:
        return {"choices": [{"text": "P"}]}

    up, up_server = serve(pair)
    proxy, proxy_server = serve(make_app(up, up))
    try:
        r = httpx.post(proxy + "/v1/completions", json={"prompt": "q", "max_tokens": 5})
        assert r.status_code == 502
        assert "returned no kv_transfer_params" in r.json()["error"]["message"]
    finally:
        up_server.should_exit = proxy_server.should_exit = True
