"""Authentication of HTTP between the proxy and the instances, and of the public API.

Internal calls (proxy -> instance): with a shared token every request is signed, never
sent with the token itself. The signature covers the headers only, so it is checked
before a byte of the body is read; the body is bound to it by its digest:

    X-KVBridge-Time            Unix seconds, a finite number within MAX_SKEW_S of ours
    X-KVBridge-Nonce           random, fresh for every request
    X-KVBridge-Content-SHA256  hex SHA-256 of the body
    X-KVBridge-Signature       HMAC-SHA256(key, method, path, query, time, nonce, digest)

under a key derived from the token (`auth.derive(token, "kvbridge http v2")`). An
instance answers 401 to an unsigned request and 403 to a wrong, stale or replayed one,
all without reading its body, and 403 when the body that arrives does not match its
digest. Each signature is accepted once (`ReplayGuard`): a sniffed call replayed within
the freshness window is refused; the guard remembers a signature only until its time
leaves the window, and refuses (503) rather than forgets when more than
`MAX_REMEMBERED` signed calls arrive within one window. `/health` and `/metrics` stay
open.

Public API (`--api-key`): `Authorization: Bearer <key>` on every `/v1/...` call, as
vLLM's `--api-key` and the `openai` client do; several keys may be accepted, each its
own prefix-cache namespace (`isolation.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import hmac
import json
import math
import secrets
import time
from collections.abc import Generator
from typing import Any

import httpx

from kvbridge.connector.security import derive, sign

TIME_HEADER = "x-kvbridge-time"
NONCE_HEADER = "x-kvbridge-nonce"
DIGEST_HEADER = "x-kvbridge-content-sha256"
SIGNATURE_HEADER = "x-kvbridge-signature"
#: How far a signed request's time may be from ours (seconds): clocks of other hosts.
MAX_SKEW_S = 60.0
#: Signed calls one instance remembers at once (two windows' worth at ~800 calls/s).
MAX_REMEMBERED = 100_000
#: Paths anyone may read without a signature.
OPEN_PATHS = frozenset({"/health", "/metrics"})

Scope = dict[str, Any]


def http_key(token: bytes) -> bytes:
    return derive(token, "kvbridge http v2")


def signature(
    key: bytes, method: str, path: str, query: str, stamp: str, nonce: str, digest: str
) -> str:
    """The HMAC of a request's signed headers (hex)."""
    text = f"{method.upper()}\n{path}\n{query}\n{stamp}\n{nonce}\n{digest}"
    return sign(key, text.encode("latin-1")).hex()


class SignedRequests(httpx.Auth):
    """httpx auth that signs every request (the proxy's client): a fresh nonce each."""

    requires_request_body = True

    def __init__(self, token: bytes) -> None:
        self._key = http_key(token)

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        stamp = f"{time.time():.3f}"
        nonce = secrets.token_hex(16)
        digest = hashlib.sha256(request.content).hexdigest()
        query = request.url.query.decode("latin-1")
        request.headers[TIME_HEADER] = stamp
        request.headers[NONCE_HEADER] = nonce
        request.headers[DIGEST_HEADER] = digest
        request.headers[SIGNATURE_HEADER] = signature(
            self._key, request.method, request.url.path, query, stamp, nonce, digest
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
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class ReplayGuard:
    """The signatures accepted within the freshness window, each until its time leaves
    the window (then the time check refuses it anyway). Owned by one `RequireSignature`;
    used from its event loop only."""

    def __init__(self, max_remembered: int = MAX_REMEMBERED) -> None:
        self.max_remembered = max_remembered
        self._seen: set[str] = set()
        self._expiry: list[tuple[float, str]] = []  # heap of (forget after, signature)

    def __len__(self) -> int:
        return len(self._seen)

    def first_use(self, sig: str, stamp: float, now: float) -> bool | None:
        """True the first time `sig` is offered (it is remembered), False on a replay,
        None when the guard is full of signatures still in their window."""
        while self._expiry and self._expiry[0][0] < now:
            self._seen.discard(heapq.heappop(self._expiry)[1])
        if sig in self._seen:
            return False
        if len(self._seen) >= self.max_remembered:
            return None
        self._seen.add(sig)
        heapq.heappush(self._expiry, (stamp + MAX_SKEW_S, sig))
        return True


#: A refused request's body is read and dropped when it declares at most this many bytes
#: (and arrives within DRAIN_S), so its keep-alive connection ends cleanly and the caller
#: reads the refusal rather than a reset; a larger one is never read.
DRAIN_LIMIT = 64 << 10
DRAIN_S = 5.0


async def _drain(headers: dict[bytes, bytes], receive: Any) -> None:
    try:
        size = int(headers.get(b"content-length", b"0"))
    except ValueError:
        return
    if not 0 < size <= DRAIN_LIMIT:
        return

    async def read_all() -> None:
        while True:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(read_all(), DRAIN_S)


class RequireSignature:
    """ASGI middleware of an instance: every request but OPEN_PATHS must be signed with
    the shared token's HTTP key, once. The outermost middleware: it refuses from the
    headers alone, before anything reads the body; the body then flows to the app (and
    its body limit) through a digest check that ends it before the app sees a body that
    is not the signed one."""

    def __init__(self, app: Any, token: bytes, max_remembered: int = MAX_REMEMBERED) -> None:
        self.app = app
        self._key = http_key(token)
        self.guard = ReplayGuard(max_remembered)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])

        def header(name: str) -> str:
            return headers.get(name.encode(), b"").decode("latin-1")

        stamp, given = header(TIME_HEADER), header(SIGNATURE_HEADER)
        if not stamp or not given:
            await _drain(headers, receive)
            await _reply(
                send,
                401,
                f"{scope['path']} needs a signed request: this instance has a shared token "
                "(--kv-token-file); give the proxy the same one",
                "unauthenticated",
            )
            return
        refusal = self._check(scope, stamp, header(NONCE_HEADER), header(DIGEST_HEADER), given)
        if refusal is not None:
            status, why = refusal
            await _drain(headers, receive)
            await _reply(send, status, why, "bad_signature" if status == 403 else "overloaded")
            return
        want_digest = header(DIGEST_HEADER)
        digest = hashlib.sha256()
        mismatch = False

        async def checked() -> dict[str, Any]:
            nonlocal mismatch
            message: dict[str, Any] = await receive()
            if message["type"] == "http.request":
                digest.update(message.get("body", b""))
                if not message.get("more_body", False) and not hmac.compare_digest(
                    digest.hexdigest(), want_digest
                ):
                    mismatch = True  # the app sees a caller gone, never this body
                    return {"type": "http.disconnect"}
            return message

        started = False

        async def sending(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, checked, sending)
        if mismatch and not started:
            await _reply(
                send,
                403,
                "the request's body does not match its signed digest: sign the body sent",
                "bad_signature",
            )

    def _check(
        self, scope: Scope, stamp: str, nonce: str, digest: str, given: str
    ) -> tuple[int, str] | None:
        """(status, reason) refusing a request by its signed headers; None to accept it."""
        try:
            when = float(stamp)
        except ValueError:
            when = math.nan
        if not math.isfinite(when):
            return 403, (
                f"{TIME_HEADER}={stamp[:40]!r} is not a finite number of Unix seconds; "
                "sign with the current time"
            )
        now = time.time()
        if abs(now - when) > MAX_SKEW_S:
            return 403, (
                f"the request's signature is stale ({now - when:+.0f} s off): sign with the "
                f"same shared token, with clocks within {MAX_SKEW_S:g} s"
            )
        if not nonce or len(digest) != 64:
            return 403, (
                f"a signed request needs {NONCE_HEADER} and {DIGEST_HEADER} (the body's "
                "SHA-256); sign with kvbridge's SignedRequests"
            )
        query = scope.get("query_string", b"").decode("latin-1")
        want = signature(self._key, scope["method"], scope["path"], query, stamp, nonce, digest)
        if not hmac.compare_digest(want, given):
            return 403, (
                "the request's signature does not match: sign with the same shared token, "
                f"with clocks within {MAX_SKEW_S:g} s"
            )
        first = self.guard.first_use(given, when, now)
        if first is None:
            return 503, (
                f"more than {self.guard.max_remembered} signed calls within "
                f"{MAX_SKEW_S:g} s; retry later"
            )
        if not first:
            return 403, (
                "the request's signature was used before: a signed call is accepted once "
                "(a replay is refused); sign each request afresh"
            )
        return None


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
