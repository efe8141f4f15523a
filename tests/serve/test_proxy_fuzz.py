"""Whatever a client sends, the proxy answers 200 or a 4xx with an OpenAI-shaped error,
never a 5xx, and keeps serving: hypothesis over the completions and chat request
schemas (every field given random types and values, extreme numbers, NaN, odd Unicode
with lone surrogates, wrong nesting, unknown and unimplemented parameters, raw bytes),
against a real HTTP server over a test backend."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvbridge.serve.http_server import ServerThread
from kvbridge.serve.openai_protocol import UNSUPPORTED
from kvbridge.serve.proxy import make_app
from tests.serve.fake_backend import FakeBackend

SCHEMA = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "user",
]

EXTREME_INTS = [0, -1, 1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -(2**63) - 1]
ints = st.integers(-3, 40) | st.sampled_from(EXTREME_INTS) | st.integers()
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0, 2.0, 1e308])
# any code point, lone surrogates (category Cs) included; JSON carries them as \ud800 escapes
chars = st.characters(codec=None, categories=None)
text = st.text(chars, max_size=12) | st.sampled_from(["", "x", "\ud800", "a\udfffb", "\x00", "ﬀ"])
scalars = st.none() | st.booleans() | ints | floats | text
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "robot"]) | values},
        optional={
            "content": text
            | values
            | st.lists(st.fixed_dictionaries({"type": text, "text": text})),
            "name": values,
        },
    ),
    max_size=3,
)
field_values = st.one_of(
    values,
    messages,
    st.lists(ints, max_size=5),
    st.lists(text, max_size=3),
    st.fixed_dictionaries({"include_usage": values}),
)

# values a client means: mostly valid, some at the edges of the valid ranges
plausible: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["fake-model", "gpt-4", None]),
    "prompt": text | st.lists(st.integers(0, 50_000), max_size=5) | st.lists(text, max_size=2),
    "messages": messages,
    "max_tokens": st.integers(1, 2**63 - 1) | st.none(),
    "max_completion_tokens": st.integers(1, 100) | st.none(),
    "temperature": st.floats(0, 2) | st.none(),
    "top_p": st.floats(0, 1) | st.none(),
    "top_k": st.integers(-1, 100) | st.none(),
    "seed": st.integers(-(2**63), 2**64 - 1) | st.none(),
    "stop": text | st.lists(text, max_size=3) | st.none(),
    "stream": st.booleans() | st.none(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "user": text | st.none(),
}

COMPLETION = {"prompt": "The capital of France is", "max_tokens": 3}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """(endpoint, body): a valid request with fields changed, added or removed, or bytes."""
    endpoint = draw(st.sampled_from(["completions", "chat/completions"]))
    if draw(st.integers(0, 9)) == 0:  # not JSON, or not an object
        raw = draw(st.binary(max_size=40) | values.map(lambda v: json.dumps(v).encode()))
        return endpoint, raw
    body: dict[str, Any] = dict(COMPLETION if endpoint == "completions" else CHAT)
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.integers(0, 9))  # 6 in 10 a schema field, 3 unimplemented, 1 unknown
        names = SCHEMA if kind < 6 else sorted(UNSUPPORTED) if kind < 9 else None
        name = draw(st.sampled_from(names) if names else text)
        meant = name in plausible and draw(st.integers(0, 9)) < 7
        body[name] = draw(plausible[name] if meant else field_values)
    for name in draw(st.lists(st.sampled_from(sorted(body)), max_size=1)):
        del body[name]
    return endpoint, json.dumps(body, allow_nan=True).encode()


@pytest.fixture(scope="module")
def proxy():
    backend = FakeBackend()
    backend.max_output = 4  # max_tokens can be 2**63 - 1
    srv = ServerThread(make_app(backend)).start()
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        yield client
    srv.stop()


def _check_answer(r: httpx.Response) -> None:
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text)
    if r.status_code == 200:
        return
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=bodies())
def test_any_request_gets_200_or_an_openai_shaped_4xx(proxy, case):
    endpoint, raw = case
    with proxy.stream("POST", f"/v1/{endpoint}", content=raw) as r:
        r.read()
    event(f"HTTP {r.status_code}")
    _check_answer(r)
    good = proxy.post("/v1/completions", json=COMPLETION)
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == " Paris. It"
