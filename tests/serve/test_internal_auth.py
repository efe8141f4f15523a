"""Signed internal calls (issue #21, item 2): each signature is accepted once, only a
finite time is fresh, and an unsigned or wrongly signed request is refused from its
headers before its body is read. Over a real HTTP server on 127.0.0.1 with the
instances' middleware stack, then a replayed call against a real prefill instance."""

from __future__ import annotations

import hashlib
import secrets
import time

import httpx
import msgspec
import pytest
from fastapi import FastAPI, Request

from kvbridge.serve import wire
from kvbridge.serve.backend import GenerateRequest, SamplingParams
from kvbridge.serve.body_limit import BodyLimit
from kvbridge.serve.http_auth import (
    AUDIENCE_HEADER,
    DIGEST_HEADER,
    MAX_SKEW_S,
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIME_HEADER,
    ReplayGuard,
    RequireSignature,
    http_key,
    signature,
)
from kvbridge.serve.http_server import ServerThread
from kvbridge.serve.instance_app import CONTROL_BODY_LIMITS
from tests.serve.helpers import AUTH, TOKEN, instance_id, raw_post

MAX_BODY = 16 << 20
#: The audience of the test server: an instance's is its instance id.
SERVER_ID = "test-instance"


@pytest.fixture(scope="module")
def server():
    """An app behind the instances' middleware (signature outermost, then the body
    limit); it records the bodies it was given."""
    seen: list[bytes] = []
    app = FastAPI()

    @app.post("/internal/{name}")
    async def call(request: Request) -> dict[str, int]:
        seen.append(await request.body())
        return {"calls": len(seen)}

    app.add_middleware(BodyLimit, max_bytes=MAX_BODY, path_limits=CONTROL_BODY_LIMITS)
    app.add_middleware(RequireSignature, token=TOKEN, audience=SERVER_ID)
    srv = ServerThread(app).start()
    yield srv.url, seen
    srv.stop()


def _signed(url: str, body: bytes, audience: str = SERVER_ID) -> httpx.Request:
    """A request signed once for `audience`, as the proxy sends it (and as a sniffer
    would record it)."""
    return AUTH.sign(httpx.Request("POST", url, content=body), audience)


def _headers(stamp: str, body: bytes, key: bytes = http_key(TOKEN), path: str = "") -> dict:
    nonce, digest = secrets.token_hex(16), hashlib.sha256(body).hexdigest()
    sig = signature(key, "POST", path, "", SERVER_ID, stamp, nonce, digest)
    return {
        AUDIENCE_HEADER: SERVER_ID,
        TIME_HEADER: stamp,
        NONCE_HEADER: nonce,
        DIGEST_HEADER: digest,
        SIGNATURE_HEADER: sig,
    }


def test_a_replayed_signed_call_is_refused(server) -> None:
    url, seen = server
    before = len(seen)
    signed = _signed(f"{url}/internal/lookup", b'{"request_id": "r1"}')
    with httpx.Client(timeout=30) as client:
        assert client.send(signed).status_code == 200
        replay = client.send(signed)
    assert replay.status_code == 403 and replay.json()["error"]["code"] == "bad_signature"
    assert "used before" in replay.json()["error"]["message"]
    assert len(seen) == before + 1  # the replay never reached the app
    # a fresh signature of the same call is a new call
    fresh = httpx.post(f"{url}/internal/lookup", content=b'{"request_id": "r1"}', auth=AUTH)
    assert fresh.status_code == 200


@pytest.mark.parametrize("stamp", ["nan", "NaN", "inf", "-inf", "1e999", "soon"])
def test_only_a_finite_time_is_fresh(server, stamp) -> None:
    """A signature made with the real key over the time "nan" once skipped the
    freshness check (and so could be replayed forever)."""
    url, seen = server
    before = len(seen)
    body = b"{}"
    r = httpx.post(
        f"{url}/internal/prefill",
        content=body,
        headers=_headers(stamp, body, path="/internal/prefill"),
    )
    assert r.status_code == 403 and "not a finite number" in r.json()["error"]["message"]
    assert len(seen) == before


def test_unsigned_and_badly_signed_bodies_are_refused_before_they_are_read(server) -> None:
    url, seen = server
    before = len(seen)
    size = MAX_BODY - 1024  # within the body limit: only the signature refuses it
    chunk = b"x" * (1 << 16)
    chunks = [chunk] * (size // len(chunk))
    head = f"Content-Length: {size}\r\nContent-Type: application/json\r\n".encode()
    sent, answer = raw_post(url, "/internal/prefill", head, chunks)
    assert answer.startswith(b"HTTP/1.1 401") and b"unauthenticated" in answer
    assert sent < size // 4, sent  # answered from the headers, the body left unread
    wrong = _headers(f"{time.time():.3f}", b"", key=http_key(b"another deployment"))
    forged = head + "".join(f"{k}: {v}\r\n" for k, v in wrong.items()).encode()
    sent, answer = raw_post(url, "/internal/prefill", forged, chunks)
    assert answer.startswith(b"HTTP/1.1 403") and b"does not match" in answer
    assert sent < size // 4, sent
    assert len(seen) == before


def test_a_body_other_than_the_signed_one_never_reaches_the_app(server) -> None:
    url, seen = server
    before = len(seen)
    signed = _signed(f"{url}/internal/generate", b'{"request_id": "mine"}')
    tampered = httpx.Request(
        "POST", signed.url, headers=dict(signed.headers), content=b'{"request_id": "evil"}'
    )
    r = httpx.Client(timeout=30).send(tampered)
    assert r.status_code == 403 and "signed digest" in r.json()["error"]["message"]
    assert len(seen) == before


def test_control_calls_have_a_small_body_limit(server) -> None:
    url, _ = server
    big = b'{"request_id": "' + b"x" * (100 << 10) + b'"}'
    r = httpx.post(f"{url}/internal/reserve", content=big, auth=AUTH, timeout=30)
    assert r.status_code == 413 and str(64 << 10) in r.json()["error"]["message"]
    assert httpx.post(f"{url}/internal/lookup", content=big, auth=AUTH).status_code == 200


def test_the_replay_guard_forgets_only_what_left_the_window_and_never_overflows() -> None:
    guard = ReplayGuard(max_remembered=2)
    now = 1000.0
    assert guard.first_use("a", now, now) is True
    assert guard.first_use("a", now, now + MAX_SKEW_S - 1) is False  # still fresh: refused
    assert guard.first_use("b", now, now) is True
    assert guard.first_use("c", now, now) is None  # full: refused, nothing forgotten early
    assert guard.first_use("c", now, now + MAX_SKEW_S + 1) is True  # a and b left the window
    assert len(guard) == 1


@pytest.mark.slow
def test_a_replayed_prefill_is_refused_by_a_real_instance(instances) -> None:
    """Issue #21: replaying a sniffed /internal/prefill within 60 s was accepted (the KV
    was exposed and pulled again)."""
    url = instances[("prefill", 1)]
    gen = GenerateRequest("r-replay", SamplingParams(max_tokens=1), prompt="The code is")
    me = instance_id(url)
    signed = _signed(f"{url}/internal/prefill", msgspec.json.encode(gen), me)
    with httpx.Client(timeout=120) as client:
        assert client.send(signed).status_code == 200
        replay = client.send(signed)
    assert replay.status_code == 403 and "used before" in replay.json()["error"]["message"]
    lookup = _signed(f"{url}/internal/lookup", msgspec.json.encode(gen), me)
    with httpx.Client(timeout=120) as client:
        assert client.send(lookup).status_code == 200
        assert client.send(lookup).status_code == 403


@pytest.mark.slow
def test_a_capability_opens_one_pull_of_its_own_prompt(instances) -> None:
    """Issue #21: with a victim's capability and dummy prompt ids of the same length the
    decode instance continued the victim's KV, and a capability could be used twice."""
    prefill, decode = instances[("prefill", 1)], instances[("decode", 1)]
    me = instance_id(decode)
    gen = GenerateRequest(
        "r-cap",
        SamplingParams(max_tokens=3, temperature=0.0),
        prompt="The secret code is 4812. The code is",
        kv_reader=me,
    )
    r = httpx.post(f"{prefill}/internal/prefill", content=msgspec.json.encode(gen), auth=AUTH)
    assert r.status_code == 200, r.text
    victim = wire.prefill_result_decoder.decode(r.content)
    assert victim.kv is not None
    dummy = msgspec.structs.replace(victim, prompt_token_ids=[1] * len(victim.prompt_token_ids))

    def generate(pf: wire.PrefillResult) -> httpx.Response:
        body = msgspec.json.encode(wire.DecodeRequest(gen, pf))
        return httpx.post(f"{decode}/internal/generate", content=body, auth=AUTH, timeout=120)

    r = generate(dummy)
    assert r.status_code == 403 and "covers another prompt" in r.json()["error"]["message"]
    r = generate(victim)  # its own prompt: served, the KV pulled
    assert r.status_code == 200, r.text
    events = [wire.event_decoder.decode(line) for line in r.text.splitlines() if line]
    assert events[-1].finish_reason and (events[-1].stages.kv_bytes or 0) > 0
    again = msgspec.structs.replace(gen, request_id="r-cap")  # its id is free again
    r = httpx.post(
        f"{decode}/internal/generate",
        content=msgspec.json.encode(wire.DecodeRequest(again, victim)),
        auth=AUTH,
        timeout=120,
    )
    assert r.status_code == 403 and "used before" in r.json()["error"]["message"]
