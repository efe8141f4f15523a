"""The OpenAI-compatible proxy over a test backend: shapes, streaming, errors, metrics,
and the official `openai` client against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from kvbridge.serve.http_server import ServerThread
from kvbridge.serve.proxy import make_app
from tests.serve.fake_backend import FakeBackend


@pytest.fixture
def server():
    backend = FakeBackend()
    srv = ServerThread(make_app(backend)).start()
    yield srv, backend
    srv.stop()


def test_completion_shape_and_usage(server):
    srv, backend = server
    r = httpx.post(
        f"{srv.url}/v1/completions",
        json={"model": "fake-model", "prompt": "The capital of France is", "max_tokens": 3},
        timeout=10,
    )
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == " Paris. It"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert backend.seen[-1].sampling.max_tokens == 3


def test_json_body_without_a_json_content_type(server):
    """`curl URL -d '{...}'` declares a form body; the README's command must still work."""
    srv, _ = server
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 2})
    r = httpx.post(
        f"{srv.url}/v1/completions",
        content=body,
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == " Paris."


def test_stop_string_and_token_prompt(server):
    srv, backend = server
    r = httpx.post(
        f"{srv.url}/v1/completions",
        json={"prompt": [1, 2, 3], "max_tokens": 8, "stop": ["It"]},
        timeout=10,
    )
    body = r.json()
    assert body["choices"][0]["text"] == " Paris." and body["choices"][0]["finish_reason"] == "stop"
    assert backend.seen[-1].prompt_token_ids == [1, 2, 3]


def test_streaming_sse_events(server):
    srv, _ = server
    with httpx.stream(
        "POST",
        f"{srv.url}/v1/completions",
        json={
            "prompt": "hi",
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=10,
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " Paris."
    assert chunks[-1]["usage"]["completion_tokens"] == 2 and chunks[-1]["choices"] == []


@pytest.mark.parametrize(
    "body, status, param, words",
    [
        ({"prompt": "x", "n": 2}, 400, "n", "n=2 is not supported"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "model", "model='gpt-4' is not served here"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
        ({"prompt": "x", "temperature": 9}, 400, "temperature", "temperature"),
        ({"max_tokens": 3}, 400, "prompt", "prompt"),
        ({"prompt": ""}, 400, "prompt", "prompt is empty"),
        ({"prompt": ["a", "b"]}, 400, "prompt", "holds 2 prompts"),
    ],
)
def test_openai_shaped_errors(server, body, status, param, words):
    srv, _ = server
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=10)
    assert r.status_code == status
    err = r.json()["error"]
    assert words in err["message"] and err["param"] == param and err["type"]


def test_failure_mid_stream_reaches_client(server):
    srv, backend = server
    backend.fail_after = 1
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=10)
    assert r.status_code == 500 and "decode instance died" in r.json()["error"]["message"]


def test_models_health_metrics(server):
    srv, _ = server
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"] == "fake-model"
    httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a b", "max_tokens": 3}, timeout=10)
    text = httpx.get(f"{srv.url}/metrics").text
    assert 'kvbridge_requests_total{endpoint="completions",status="200"} 1' in text
    assert "kvbridge_ttft_ms_count 1" in text and "kvbridge_kv_bytes_total 1000" in text
    assert "kvbridge_requests_running 0" in text


def test_openai_client_completions_and_chat(server):
    srv, backend = server
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
    out = client.completions.create(
        model="fake-model", prompt="The capital of France is", max_tokens=2
    )
    assert out.choices[0].text == " Paris." and out.usage.completion_tokens == 2
    chat = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "capital of France?"}],
        max_tokens=3,
    )
    assert chat.choices[0].message.content == " Paris. It"
    assert backend.seen[-1].messages == [{"role": "user", "content": "capital of France?"}]
    stream = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == " Paris. It is"
    pieces = client.completions.create(model="fake-model", prompt="x", max_tokens=3, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == " Paris. It"


def test_client_disconnect_aborts_the_request(server):
    srv, backend = server
    backend.delay = 0.01
    with httpx.stream(
        "POST",
        f"{srv.url}/v1/completions",
        json={"prompt": "x", "max_tokens": 5000, "stream": True},
        timeout=10,
    ) as r:
        next(r.iter_lines())  # the first chunk arrived; now hang up
    deadline = time.monotonic() + 10
    while not backend.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert backend.aborted == [backend.seen[-1].request_id]
    text = httpx.get(f"{srv.url}/metrics").text
    assert "kvbridge_requests_running 0" in text


def test_merged_metrics_keep_one_family_block():
    from kvbridge.serve.metrics import merge_expositions

    a = (
        "# HELP kvbridge_blocks_in_use x\n# TYPE kvbridge_blocks_in_use gauge\n"
        'kvbridge_blocks_in_use{instance="p"} 3\n'
    )
    b = a.replace('"p"} 3', '"d"} 5')
    merged = merge_expositions([a, b]).splitlines()
    assert merged == [
        "# HELP kvbridge_blocks_in_use x",
        "# TYPE kvbridge_blocks_in_use gauge",
        'kvbridge_blocks_in_use{instance="p"} 3',
        'kvbridge_blocks_in_use{instance="d"} 5',
    ]
