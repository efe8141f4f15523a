"""The OpenAI-compatible proxy over a test backend: shapes, streaming, errors, metrics,
and the official `openai` client against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from kvbridge.serve.http_server import ServerThread
from kvbridge.serve.metrics import merge_expositions, metric_value
from kvbridge.serve.proxy import make_app
from tests.serve.fake_backend import FakeBackend
from tests.serve.helpers import raw_post


@pytest.fixture
def server():
    backend = FakeBackend()
    srv = ServerThread(make_app(backend)).start()
    yield srv, backend
    srv.stop()


@pytest.fixture(scope="module")
def refusing():
    """One proxy for the tests of refused requests (they leave nothing behind); they
    check that nothing reached the backend."""
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
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
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
def test_openai_shaped_errors(refusing, body, status, param, words):
    srv, _ = refusing
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=10)
    assert r.status_code == status
    err = r.json()["error"]
    assert words in err["message"] and err["param"] == param and err["type"]


UNIMPLEMENTED = [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "auto"),
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("response_format", {"type": "json_object"}),
    ("logit_bias", {"50256": -100}),
    ("n", 2),
    ("best_of", 2),
    ("echo", True),
    ("logprobs", True),
    ("top_logprobs", 3),
    ("presence_penalty", 0.5),
    ("frequency_penalty", 1),
    ("suffix", "!"),
]


@pytest.mark.parametrize("param, value", UNIMPLEMENTED, ids=[p for p, _ in UNIMPLEMENTED])
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_unimplemented_parameters_are_refused(refusing, endpoint, param, value):
    """A parameter kvbridge does not implement is refused naming it, not ignored."""
    srv, backend = refusing
    seen = len(backend.seen)
    base = {"prompt": "x"} if endpoint == "completions" else _CHAT
    r = httpx.post(f"{srv.url}/v1/{endpoint}", json={**base, param: value}, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"].startswith(f"{param}=") and "is not supported" in err["message"]
    assert len(backend.seen) == seen


_CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_neutral_values_of_unimplemented_parameters_are_accepted(server):
    """What clients send by default (n=1, echo=false, tools=[], nulls) changes nothing."""
    srv, _ = server
    neutral = {"n": 1, "echo": False, "logprobs": None, "best_of": 1, "suffix": None}
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", **neutral}, timeout=10)
    assert r.status_code == 200, r.text
    neutral = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}}
    neutral |= {"presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": False}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={**_CHAT, **neutral}, timeout=10)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "raw, param, words",
    [
        (b'{"prompt": "x", "temprature": 0.5}', "temprature", "unrecognized parameter"),
        (b'{"prompt": "x", "seed": 1180591620717411303424}', "seed", "seed: Input should be"),
        (b'{"prompt": "\\ud800x"}', "prompt", "lone surrogate \\ud800 at character 0"),
        (b'{"prompt": "x", "stop": ["\\udfff"]}', "stop", "stop.0: lone surrogate"),
        (b'{"prompt": "x", "temperature": NaN}', "temperature", "finite number"),
        (b'{"prompt": "x", "max_tokens": 1e400}', "max_tokens", "valid integer"),
        (b'{"prompt": "x", "max_tokens": -5}', "max_tokens", "greater than or equal to 1"),
        (b'{"prompt": "x", "max_tokens": true}', "max_tokens", "valid integer"),
        (b'{"prompt": [1, -2]}', "prompt", "token ids"),
        (b'{"prompt": "x", "stream": "yes"}', "stream", "valid boolean"),
        (b'{"prompt": "caf\xe9"}', None, "not valid JSON"),
        (b"[" * 100000 + b"]" * 100000, None, "nested too deeply"),
        (b'["prompt"]', None, "must be a JSON object, not an array"),
        (b"", None, "not valid JSON"),
    ],
)
def test_bad_input_is_a_4xx_naming_it(refusing, raw, param, words):
    srv, backend = refusing
    seen = len(backend.seen)
    r = httpx.post(f"{srv.url}/v1/completions", content=raw, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["param"] == param, err
    assert len(backend.seen) == seen


def test_chat_content_parts_must_be_text(server):
    srv, _ = server
    parts = [{"type": "text", "text": "hi "}, {"type": "image_url", "image_url": {"url": "x"}}]
    body = {"messages": [{"role": "user", "content": parts}]}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages" and "part 1 must be" in err["message"]


def test_unknown_paths_and_methods_are_openai_shaped(server):
    srv, _ = server
    r = httpx.get(f"{srv.url}/v1/nothing")
    assert (
        r.status_code == 404 and "no such endpoint: GET /v1/nothing" in r.json()["error"]["message"]
    )
    r = httpx.get(f"{srv.url}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.fixture
def small_server():
    """A proxy that takes request bodies of at most 64 KiB."""
    srv = ServerThread(make_app(FakeBackend(), max_body_bytes=64 * 1024)).start()
    yield srv
    srv.stop()


def test_body_over_the_limit_is_refused_before_it_is_read(small_server):
    """A declared length over the limit is refused before any byte of the body; a
    chunked body is refused once the bytes that came exceed the limit, while the client
    is still sending (so it was never held whole); the server keeps serving."""
    srv = small_server
    sent, answer = raw_post(srv.url, "/v1/completions", b"Content-Length: 1000000000\r\n", [])
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower()
    err = json.loads(body)["error"]
    assert err["code"] == "request_too_large" and "1000000000 bytes exceeds" in err["message"]

    chunk = b"4000\r\n" + b" " * 0x4000 + b"\r\n"  # 16 KiB per chunk, never a last one
    sent, answer = raw_post(
        srv.url, "/v1/completions", b"Transfer-Encoding: chunked\r\n", [chunk] * 1000
    )
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < 1000 * len(chunk) // 4  # refused long before the client was done
    assert b"exceeds the limit of 65536 bytes" in answer

    r = httpx.post(f"{srv.url}/v1/completions", content=b" " * 100_000, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x" * 60_000}, timeout=10)
    assert r.status_code == 200
    text = httpx.get(f"{srv.url}/metrics").text
    assert metric_value(text, "requests_total", endpoint="invalid", status="413") == 3


def test_a_stalled_body_is_refused_after_the_body_timeout():
    srv = ServerThread(make_app(FakeBackend(), body_timeout_s=0.5)).start()
    try:
        _, answer = raw_post(srv.url, "/v1/completions", b"Content-Length: 100\r\n", [b"{"])
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"request body not complete within 0.5 s (1 bytes arrived)" in answer
        assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"}).status_code == 200
    finally:
        srv.stop()


def test_kv_load_error_reaches_the_body(server):
    srv, backend = server
    backend.kv_load_error = "handshake with tcp://h:5555 refused"
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    body = r.json()
    assert body["kvbridge_stages"]["kv_load_failed"] is True
    assert body["kvbridge_kv_load_error"] == "handshake with tcp://h:5555 refused"


def test_demo_fails_when_the_kv_pull_failed(server, capsys):
    """`kvbridge demo` exits 1 with the reason when the decode instance had to recompute
    (the colocated check is never reached: its URL here answers nothing)."""
    from kvbridge.serve.demo import ask

    srv, backend = server
    backend.kv_load_error = "lease expired before the pull"
    assert ask(srv.url, "http://127.0.0.1:9", "fake-model", "The capital", 3) == 1
    out = capsys.readouterr().out
    assert "FAILED: the KV pull failed (lease expired before the pull)" in out


def test_failure_mid_stream_reaches_client(server):
    srv, backend = server
    backend.fail_after = 1
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=10)
    assert r.status_code == 500 and "decode instance died" in r.json()["error"]["message"]


def test_models_health_metrics(server):
    srv, _ = server
    health = httpx.get(f"{srv.url}/health").json()
    assert health["status"] == "ok"  # and the isolation in force (test_tenants.py)
    assert health["prefix_cache_isolation"]["policy"] == "none"
    assert httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"] == "fake-model"
    httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a b", "max_tokens": 3}, timeout=10)
    text = httpx.get(f"{srv.url}/metrics").text
    assert metric_value(text, "requests_total", endpoint="completions", status="200") == 1
    assert metric_value(text, "ttft_ms_count") == 1 and metric_value(text, "kv_bytes_total") == 1000
    assert "kvbridge_requests_running 0.0" in text
    assert "# TYPE kvbridge_ttft_ms histogram" in text


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
    assert "kvbridge_requests_running 0.0" in text


def test_client_gone_before_the_first_token_stops_the_request(server):
    """A client that gives up while its request waits for its first token (a queued
    prefill) stops it at once: the backend's generator is closed, nothing keeps running."""
    srv, backend = server
    backend.first_delay = 60.0
    for stream in (True, False):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{srv.url}/v1/completions",
                json={"prompt": "x", "max_tokens": 5, "stream": stream},
                timeout=httpx.Timeout(10, read=0.5),
            )
        deadline = time.monotonic() + 10
        while backend.seen[-1].request_id not in backend.aborted:
            assert time.monotonic() < deadline, "the request was not stopped"
            time.sleep(0.02)
    text = httpx.get(f"{srv.url}/metrics").text
    assert metric_value(text, "requests_running") == 0
    assert metric_value(text, "failures_total", reason="client_gone") == 2


def test_full_backend_is_a_fast_503_with_retry_after(server):
    """Every instance full: 503 at once, OpenAI-shaped with the code "overloaded", the
    backend's Retry-After, and counted as rejected (not as a failure)."""
    srv, backend = server
    backend.full_retry_after = 2.0
    for body in ({"prompt": "x", "stream": True}, {"messages": [{"role": "user", "content": "x"}]}):
        path = "chat/completions" if "messages" in body else "completions"
        r = httpx.post(f"{srv.url}/v1/{path}", json=body, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
        err = r.json()["error"]
        assert err["code"] == "overloaded" and err["type"] == "server_error"
        assert "--max-queued-requests 4" in err["message"]
    text = httpx.get(f"{srv.url}/metrics").text
    assert metric_value(text, "requests_rejected_total", reason="overloaded") == 2
    assert metric_value(text, "failures_total") == 0
    backend.full_retry_after = None
    assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"}).status_code == 200


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


def test_instance_release_counter_follows_the_connectors_totals_by_cause():
    from kvbridge.serve.metrics import InstanceMetrics

    m = InstanceMetrics("p1", "prefill")
    m.count_releases({"completed": 3})
    m.count_releases({"completed": 3, "aborted": 1})  # counted once, whatever the scrapes
    text = m.render()
    assert metric_value(text, "kv_releases_total", cause="completed", instance="p1") == 3
    assert metric_value(text, "kv_releases_total", cause="aborted") == 1
    assert metric_value(text, "kv_releases_total", cause="lease_expired") == 0


def test_stale_pulls_reach_the_proxys_metrics_once_each():
    """A decode instance's stale pulls (the connector's running total) are counted once
    whatever the scrapes, and the proxy's merged exposition carries them."""
    from kvbridge.serve.metrics import InstanceMetrics

    d1, d2 = InstanceMetrics("d1", "decode"), InstanceMetrics("d2", "decode")
    d1.count_pull_failures({"stale": 2})
    d1.count_pull_failures({"stale": 2})
    d2.count_pull_failures({"stale": 1, "integrity": 4, "some-later-cause": 5})
    merged = merge_expositions([d1.render(), d2.render()])
    assert metric_value(merged, "kv_stale_pulls_total", instance="d1") == 2
    assert metric_value(merged, "kv_stale_pulls_total") == 3
    assert merged.count("# TYPE kvbridge_kv_stale_pulls_total counter") == 1
    assert metric_value(merged, "kv_integrity_failures_total") == 4


def test_api_key_guards_the_openai_api_but_not_health():
    srv = ServerThread(make_app(FakeBackend(), api_key="sk-local-123")).start()
    try:
        r = httpx.get(f"{srv.url}/v1/models", timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        bad = {"authorization": "Bearer wrong"}
        assert httpx.get(f"{srv.url}/v1/models", headers=bad, timeout=10).status_code == 401
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sk-local-123")
        out = client.completions.create(model="fake-model", prompt="hi", max_tokens=2)
        assert out.choices[0].text
    finally:
        srv.stop()
