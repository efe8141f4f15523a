"""`kvbridge serve --role proxy --engine vllm`: kvbridge's OpenAI proxy makes vLLM's
two-step P/D request. Real HTTP servers on 127.0.0.1: the proxy's app over
`VLLMBackend`, and a stand-in for a vLLM prefill/decode pair that answers as vLLM's
OpenAI server does (kv_transfer_params, SSE chunks with token ids, a usage chunk) and
records what it was sent. Real vLLM runs in tests/vllm (`make test-vllm`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvbridge.cli.main import main as cli_main
from kvbridge.serve.config import Engine, KVLoadFailure, ProxyConfig
from kvbridge.serve.http_server import ServerThread
from kvbridge.serve.proxy_main import proxy_app

SERVED = "/models/smollm2"  # the name vLLM serves the model under
WORDS = [(" Paris", 7042), (".", 30), ("\n", 198)]


class FakeVLLM:
    """One vLLM instance: a prefill answers one token and kv_transfer_params; a
    decode streams WORDS (or answers them at once)."""

    def __init__(self, name: str, *, fail: int | None = None, params: bool = True) -> None:
        self.name, self.fail, self.params = name, fail, params
        self.seen: list[dict[str, Any]] = []
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"data": [{"id": SERVED}]}

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {}

        @app.post("/v1/completions", response_model=None)
        async def completions(request: Request) -> Any:
            return await self.answer(await request.json(), chat=False)

        @app.post("/v1/chat/completions", response_model=None)
        async def chat(request: Request) -> Any:
            return await self.answer(await request.json(), chat=True)

        self.server = ServerThread(app).start()
        self.url = self.server.url

    async def answer(self, body: dict[str, Any], chat: bool) -> Any:
        self.seen.append(body)
        if self.fail is not None:
            return JSONResponse({"error": {"message": f"{self.name} broke"}}, self.fail)
        if body["model"] != SERVED:
            return JSONResponse({"error": {"message": f"model {body['model']!r}"}}, 404)
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode"):
            out = {"choices": [{"text": WORDS[0][0], "token_ids": [WORDS[0][1]]}]}
            return out | ({"kv_transfer_params": {"cap": self.name}} if self.params else {})
        n = min(body["max_tokens"], len(WORDS))

        def chunk(i: int) -> dict[str, Any]:
            text, tid = WORDS[i]
            part = {"delta": {"content": text}} if chat else {"text": text}
            finish = "length" if i == n - 1 else None
            return {"choices": [{**part, "token_ids": [tid], "finish_reason": finish}]}

        def sse() -> Iterator[str]:
            for i in range(n):
                yield f"data: {json.dumps(chunk(i))}\n\n"
            usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")


@pytest.fixture
def pair() -> Iterator[tuple[FakeVLLM, FakeVLLM]]:
    prefill, decode = FakeVLLM("prefill"), FakeVLLM("decode")
    yield prefill, decode
    prefill.server.stop()
    decode.server.stop()


def proxy(prefill: list[str], decode: list[str], **kw: Any) -> ServerThread:
    cfg = ProxyConfig("smollm2-135m", tuple(prefill), tuple(decode), engine=Engine.VLLM, **kw)
    return ServerThread(proxy_app(cfg)).start()


def test_prefill_with_one_token_then_decode_with_its_params(pair) -> None:
    prefill, decode = pair
    srv = proxy([prefill.url], [decode.url])
    try:
        body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json={**body, "cache_salt": "t1"})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["choices"][0]["text"] == " Paris.\n"
        assert got["usage"]["completion_tokens"] == 3 and got["model"] == SERVED
        assert set(got["kvbridge_stages"]) >= {"prefill_ms", "decode_ms"}
        (first,), (second,) = prefill.seen, decode.seen
        assert first["max_tokens"] == 1 and first["stream"] is False
        assert first["kv_transfer_params"] == {"do_remote_decode": True}
        assert first["model"] == SERVED
        # the proxy's prefix-cache namespace for salt "t1" (isolation.py), on both calls
        assert first["cache_salt"] and first["cache_salt"] == second["cache_salt"]
        assert second["max_tokens"] == 3 and second["stream"] is True
        assert second["kv_transfer_params"] == {"cap": "prefill"}
        assert second["prompt"] == body["prompt"]
    finally:
        srv.stop()


def test_streamed_chat_and_token_prompts_reach_the_client_as_openai_chunks(pair) -> None:
    prefill, decode = pair
    srv = proxy([prefill.url], [decode.url])
    try:
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=chat) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
        deltas = [json.loads(ln[6:])["choices"][0]["delta"].get("content", "") for ln in lines]
        assert "".join(deltas) == " Paris."
        assert decode.seen[-1]["messages"] == chat["messages"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " Paris"
        assert prefill.seen[-1]["prompt"] == decode.seen[-1]["prompt"] == [1, 2, 3]
    finally:
        srv.stop()


def test_a_failed_prefill_is_skipped_then_computed_on_the_decode_instance_or_refused(
    pair,
) -> None:
    prefill, decode = pair
    broken = FakeVLLM("broken", fail=500)
    silent = FakeVLLM("silent", params=False)
    body = {"prompt": "q", "max_tokens": 2}
    srv = proxy([broken.url, prefill.url], [decode.url])
    try:  # the next prefill instance serves it
        r = httpx.post(srv.url + "/v1/completions", json=body)
        assert r.status_code == 200 and decode.seen[-1]["kv_transfer_params"] == {"cap": "prefill"}
    finally:
        srv.stop()
    srv = proxy([broken.url, silent.url], [decode.url])
    try:  # none did: the decode instance computes the prompt (recompute, the default)
        r = httpx.post(srv.url + "/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " Paris."
        assert "kv_transfer_params" not in decode.seen[-1]
    finally:
        srv.stop()
    srv = proxy([broken.url, silent.url], [decode.url], kv_load_failure=KVLoadFailure.FAIL)
    try:
        r = httpx.post(srv.url + "/v1/completions", json=body)
        assert r.status_code == 503
        message = r.json()["error"]["message"]
        assert "broke" in message and "returned no kv_transfer_params" in message
    finally:
        srv.stop()
        broken.server.stop()
        silent.server.stop()


def test_a_request_vllm_refuses_is_answered_with_its_status_and_reason(pair) -> None:
    _, decode = pair
    refusing = FakeVLLM("refusing", fail=400)
    srv = proxy([refusing.url], [decode.url])
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "q", "max_tokens": 2})
        assert r.status_code == 400 and "refusing broke" in r.json()["error"]["message"]
        assert decode.seen == []  # never sent on
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "q", "n": 3})
        assert r.status_code == 400 and len(refusing.seen) == 1  # refused by the proxy itself
    finally:
        srv.stop()
        refusing.server.stop()


def test_vllm_instances_are_proxied_only_not_started(capsys) -> None:
    assert cli_main(["serve", "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "--engine vllm with --role all" in err and "--role proxy --engine vllm" in err


def test_the_model_is_named_as_vllm_serves_it_and_health_follows_the_failure_policy(
    pair,
) -> None:
    prefill, decode = pair
    srv = proxy([prefill.url], [decode.url])
    try:
        models = httpx.get(srv.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == [SERVED]
        r = httpx.post(srv.url + "/v1/completions", json={"model": SERVED, "prompt": "q"})
        assert r.status_code == 200 and r.json()["model"] == SERVED
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
    finally:
        srv.stop()
    gone = "http://127.0.0.1:9"  # nothing listens there
    for policy, status in ((KVLoadFailure.RECOMPUTE, 200), (KVLoadFailure.FAIL, 503)):
        srv = proxy([gone], [decode.url], kv_load_failure=policy)
        try:
            assert httpx.get(srv.url + "/health", timeout=30).status_code == status
        finally:
            srv.stop()


def test_a_stream_that_ends_unfinished_is_an_error_not_a_stop() -> None:
    decode = FakeVLLM("decode")
    decode.answer = _unfinished  # type: ignore[method-assign]
    srv = proxy([], [decode.url])
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "q", "max_tokens": 2})
        assert r.status_code == 500 and "ended its stream unfinished" in r.text
    finally:
        srv.stop()
        decode.server.stop()


async def _unfinished(body: dict[str, Any], chat: bool) -> Any:
    chunk = {"choices": [{"text": " Paris", "token_ids": [7042], "finish_reason": None}]}
    return StreamingResponse(
        iter([f"data: {json.dumps(chunk)}\n\n"]), media_type="text/event-stream"
    )


def test_each_vllm_instances_metrics_keep_their_own_series_once_merged() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from kvbridge.serve.metrics import merge_expositions, with_label

    text = (
        "# HELP vllm:tokens_total Tokens.\n# TYPE vllm:tokens_total counter\n"
        'vllm:tokens_total{model_name="m"} 3.0\nvllm:running 2.0\n'
    )
    merged = merge_expositions([with_label(text, "instance", u) for u in ("http://p", "http://d")])
    samples = [
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for family in text_string_to_metric_families(merged)
        for s in family.samples
    ]
    assert len(samples) == len(set(samples)) == 4
    assert ("vllm:running", (("instance", "http://d"),), 2.0) in samples
    assert ("vllm:tokens_total", (("instance", "http://p"), ("model_name", "m")), 3.0) in samples
