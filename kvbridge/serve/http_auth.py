"""Authentication of HTTP between the proxy and the instances, and of the public API.

Internal calls (proxy -> instance): with a shared token every request is signed, never
sent with the token itself: headers `X-KVBridge-Time` (Unix seconds) and
`X-KVBridge-Signature` = HMAC-SHA256 over method, path, time and body, under a key
derived from the token (`auth.derive(token, "kvbridge http v1")`). An instance answers
401 to an unsigned request and 403 to a wrong or stale one (more than `MAX_SKEW_S` off);
`/health` and `/metrics` stay open. Replaying a signed request within the window sends
the same request id again, which the instance refuses (409).

Public API (`--api-key`): `Authorization: Bearer <key>` on every `/v1/...` call, as
vLLM's `--api-key` and the `openai` client do.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Generator
from typing import Any

import httpx

from kvbridge.transfer.auth import derive, sign

TIME_HEADER = "x-kvbridge-time"
SIGNATURE_HEADER = "x-kvbridge-signature"
#: How far a signed request's time may be from ours (seconds).
MAX_SKEW_S = 60.0
#: Paths anyone may read without a signature.
OPEN_PATHS = frozenset({"/health", "/metrics"})

Scope = dict[str, Any]


def http_key(token: bytes) -> bytes:
    return derive(token, "kvbridge http v1")


def signature(key: bytes, method: str, path: str, stamp: str, body: bytes) -> str:
    return sign(key, f"{method.upper()}\n{path}\n{stamp}\n".encode() + body).hex()


class SignedRequests(httpx.Auth):
    """httpx auth that signs every request (the proxy's client)."""

    requires_request_body = True

    def __init__(self, token: bytes) -> None:
        self._key = http_key(token)

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        stamp = f"{time.time():.3f}"
        request.headers[TIME_HEADER] = stamp
        request.headers[SIGNATURE_HEADER] = signature(
            self._key, request.method, request.url.path, stamp, request.content
        )
        yield request


async def _reply(send: Any, status: int, message: str, code: str) -> None:
    body = json.dumps(
        {"error": {"message": message, "type": "authentication_error", "param": None, "code": code}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
        }
    )
    await send({"type": "http.response.body", "body": body})


class RequireSignature:
    """ASGI middleware of an instance: every request but OPEN_PATHS must be signed with
    the shared token's HTTP key. Sits inside the body limit, so the body it buffers to
    check the signature is bounded."""

    def __init__(self, app: Any, token: bytes) -> None:
        self.app = app
        self._key = http_key(token)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        stamp = headers.get(TIME_HEADER.encode(), b"").decode("latin-1")
        given = headers.get(SIGNATURE_HEADER.encode(), b"").decode("latin-1")
        if not stamp or not given:
            await _reply(
                send,
                401,
                f"{scope['path']} needs a signed request: this instance has a shared token "
                "(--kv-token-file); give the proxy the same one",
                "unauthenticated",
            )
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            skew = abs(time.time() - float(stamp))
        except ValueError:
            skew = float("inf")
        want = signature(self._key, scope["method"], scope["path"], stamp, body)
        if skew > MAX_SKEW_S or not hmac.compare_digest(want, given):
            why = "is stale" if skew > MAX_SKEW_S else "does not match"
            await _reply(
                send,
                403,
                f"the request's signature {why}: sign with the same shared token, with "
                f"clocks within {MAX_SKEW_S:g} s",
                "bad_signature",
            )
            return
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def bearer_key(authorization: str | None) -> str | None:
    """The key of an 'Authorization: Bearer <key>' header; None without one."""
    if not authorization or not authorization.startswith("Bearer "):
        return None
    return authorization.removeprefix("Bearer ")


class RequireApiKey:
    """ASGI middleware of the proxy: `/v1/...` needs `Authorization: Bearer <key>`
    with one of `api_keys` (each key compared in constant time)."""

    def __init__(self, app: Any, api_keys: list[str]) -> None:
        self.app = app
        self._want = [f"Bearer {key}".encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            matches = [hmac.compare_digest(given, want) for want in self._want]
            if not any(matches):
                await _reply(
                    send,
                    401,
                    "Incorrect or missing API key: send 'Authorization: Bearer <key>' "
                    "(the server's --api-key)",
                    "invalid_api_key",
                )
                return
        await self.app(scope, receive, send)
