"""Signed calls are bound to their audience (issue #46, item 4): the signature covers the
id of the instance a call is made for, so the headers of a call to one instance open no
other instance of the deployment, and a replay to the same instance is refused. Over
real HTTP servers on 127.0.0.1 with the instances' middleware, then across real
instances of the same role and of different roles."""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import Any

import httpx
import msgspec
import pytest
from fastapi import FastAPI, Request

from kvbridge.connector.security import derive, sign
from kvbridge.serve.backend import GenerateRequest, SamplingParams
from kvbridge.serve.http_auth import (
    AUDIENCE_HEADER,
    DIGEST_HEADER,
    HTTP_AUTH_VERSION,
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIME_HEADER,
    RequireSignature,
    SignedRequests,
    signature,
)
from kvbridge.serve.http_server import ServerThread
from tests.serve.helpers import AUTH, TOKEN, instance_id

BODY = b'{"request_id": "r-aud"}'


class _Restartable:
    """An instance's app behind `RequireSignature` for its id; `restart` gives it a new
    id (as a restarted instance has), on the same URL."""

    def __init__(self, audience: str) -> None:
        self.seen: list[bytes] = []
        inner = FastAPI()

        @inner.post("/internal/{name}")
        async def call(request: Request) -> dict[str, int]:
            self.seen.append(await request.body())
            return {"calls": len(self.seen)}

        @inner.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        self.inner = inner
        self.restart(audience)

    def restart(self, audience: str) -> None:
        self.app = RequireSignature(self.inner, TOKEN, audience)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def two():
    """Two instances of one deployment (the same token), ids "inst-a" and "inst-b"."""
    apps = {name: _Restartable(name) for name in ("inst-a", "inst-b")}
    servers = {name: ServerThread(app).start() for name, app in apps.items()}
    yield {name: (servers[name].url, apps[name]) for name in apps}
    for srv in servers.values():
        srv.stop()


def _send(url: str, signed: httpx.Request) -> httpx.Response:
    """`signed`'s very headers and body, sent to `url` (a sniffer's replay)."""
    request = httpx.Request("POST", url, headers=dict(signed.headers), content=signed.content)
    with httpx.Client(timeout=30) as client:
        return client.send(request)


def test_headers_for_one_instance_open_no_other_and_are_accepted_once(two) -> None:
    (url_a, app_a), (url_b, app_b) = two["inst-a"], two["inst-b"]
    seen_a, seen_b = len(app_a.seen), len(app_b.seen)
    signed = AUTH.sign(httpx.Request("POST", f"{url_a}/internal/lookup", content=BODY), "inst-a")
    other = _send(f"{url_b}/internal/lookup", signed)
    assert other.status_code == 403 and other.json()["error"]["code"] == "wrong_audience"
    message = other.json()["error"]["message"]
    assert "signed for instance 'inst-a'" in message and "this is instance 'inst-b'" in message
    assert other.headers[AUDIENCE_HEADER] == "inst-b"
    assert _send(f"{url_a}/internal/lookup", signed).status_code == 200  # its own: once
    replay = _send(f"{url_a}/internal/lookup", signed)
    assert replay.status_code == 403 and "used before" in replay.json()["error"]["message"]
    assert len(app_a.seen) == seen_a + 1 and len(app_b.seen) == seen_b


def test_a_forged_audience_header_does_not_move_a_signature(two) -> None:
    """Rewriting X-KVBridge-Audience to the other instance's id breaks the signature."""
    (url_a, _), (url_b, app_b) = two["inst-a"], two["inst-b"]
    before = len(app_b.seen)
    signed = AUTH.sign(httpx.Request("POST", f"{url_a}/internal/lookup", content=BODY), "inst-a")
    signed.headers[AUDIENCE_HEADER] = "inst-b"
    r = _send(f"{url_b}/internal/lookup", signed)
    assert r.status_code == 403 and "does not match" in r.json()["error"]["message"]
    assert len(app_b.seen) == before


def test_the_caller_learns_each_instances_audience_and_again_after_a_restart(two) -> None:
    (url_a, app_a), (url_b, _) = two["inst-a"], two["inst-b"]
    auth = SignedRequests(TOKEN)  # one signer for both, as the proxy's client
    with httpx.Client(timeout=30, auth=auth) as client:
        for url in (url_a, url_b, url_a):
            assert client.post(f"{url}/internal/lookup", content=BODY).status_code == 200
        app_a.restart("inst-a2")  # a new id on the same URL: refused once, then learned
        try:
            r = client.post(f"{url_a}/internal/lookup", content=BODY)
            assert r.status_code == 200, r.text
            assert [h.status_code for h in r.history] == [403]
            r = client.post(f"{url_a}/internal/lookup", content=BODY)
            assert r.status_code == 200 and not r.history
        finally:
            app_a.restart("inst-a")
    pinned = SignedRequests(TOKEN, audience="inst-a")  # a fixed audience is never changed
    r = httpx.post(f"{url_b}/internal/lookup", content=BODY, auth=pinned, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "wrong_audience"


def test_a_caller_of_another_version_is_refused_with_the_reason(two) -> None:
    """A signature of the previous version (no audience, key "kvbridge http v2") is
    refused saying so; one of another key derivation does not match."""
    url, app = two["inst-a"]
    before = len(app.seen)
    stamp, nonce = f"{time.time():.3f}", secrets.token_hex(16)
    digest = hashlib.sha256(BODY).hexdigest()
    old_key = derive(TOKEN, "kvbridge http v2")
    text = f"POST\n/internal/lookup\n\n{stamp}\n{nonce}\n{digest}".encode()
    v2 = {TIME_HEADER: stamp, NONCE_HEADER: nonce, DIGEST_HEADER: digest}
    v2[SIGNATURE_HEADER] = sign(old_key, text).hex()
    r = httpx.post(f"{url}/internal/lookup", content=BODY, headers=v2, timeout=30)
    assert r.status_code == 403
    assert "names no audience" in r.json()["error"]["message"]
    assert HTTP_AUTH_VERSION in r.json()["error"]["message"]
    v2[AUDIENCE_HEADER] = "inst-a"
    v2[SIGNATURE_HEADER] = signature(
        old_key, "POST", "/internal/lookup", "", "inst-a", stamp, nonce, digest
    )
    r = httpx.post(f"{url}/internal/lookup", content=BODY, headers=v2, timeout=30)
    assert r.status_code == 403 and "kvbridge version" in r.json()["error"]["message"]
    assert len(app.seen) == before


def test_every_answer_names_the_instance_open_paths_too(two) -> None:
    url, _ = two["inst-b"]
    assert httpx.get(f"{url}/health", timeout=30).headers[AUDIENCE_HEADER] == "inst-b"
    unsigned = httpx.post(f"{url}/internal/lookup", content=BODY, timeout=30)
    assert unsigned.status_code == 401 and unsigned.headers[AUDIENCE_HEADER] == "inst-b"


@pytest.mark.slow
@pytest.mark.parametrize("other", ["prefill32", ("decode", 1)], ids=["same-role", "other-role"])
def test_a_call_signed_for_one_real_instance_opens_no_other(instances, other) -> None:
    """The proxy's call for one prefill instance, sniffed and sent to another prefill
    instance (same role) or to a decode instance (another role) of the deployment: 403
    naming both ids. Sent to its own instance it is served once; a replay is refused."""
    url, elsewhere = instances[("prefill", 1)], instances[other]
    me, them = instance_id(url), instance_id(elsewhere)
    gen = GenerateRequest("r-aud", SamplingParams(max_tokens=1), prompt="The code is")
    body = msgspec.json.encode(gen)
    signed = AUTH.sign(httpx.Request("POST", f"{url}/internal/lookup", content=body), me)
    r = _send(f"{elsewhere}/internal/lookup", signed)
    assert r.status_code == 403 and r.json()["error"]["code"] == "wrong_audience"
    assert f"signed for instance {me!r}" in r.json()["error"]["message"]
    assert f"this is instance {them!r}" in r.json()["error"]["message"]
    assert _send(f"{url}/internal/lookup", signed).status_code == 200
    replay = _send(f"{url}/internal/lookup", signed)
    assert replay.status_code == 403 and "used before" in replay.json()["error"]["message"]
    # the same call made for the other instance is served there: only the audience differs
    own = AUTH.sign(httpx.Request("POST", f"{elsewhere}/internal/lookup", content=body), them)
    assert _send(f"{elsewhere}/internal/lookup", own).status_code == 200
