"""Authentication of HTTP between the proxy and the instances, and of the public API.

Internal calls (proxy -> instance): with a shared token every request is signed, never
sent with the token itself. The signature covers the headers only, so it is checked
before a byte of the body is read; the body is bound to it by its digest, and the call
to the instance it is made for by that instance's id (its *audience*):

    X-KVBridge-Audience        the instance id of the instance the call is for
    X-KVBridge-Time            Unix seconds, a finite number within MAX_SKEW_S of ours
    X-KVBridge-Nonce           random, fresh for every request
    X-KVBridge-Content-SHA256  hex SHA-256 of the body
    X-KVBridge-Signature       HMAC-SHA256(key, method, path, query, audience, time,
                               nonce, digest)

under a key derived from the token (`derive(token, HTTP_AUTH_VERSION)`: the label names
the version of the signed text, so a caller and an instance of different versions never
agree on a signature; an instance tells a caller that names no audience that it is
older). An instance answers 401 to an unsigned request and 403 to a wrong, stale or
replayed one, or one signed for another instance, all without reading its body, and 403
when the body that arrives does not match its digest. Each signature is accepted once
(`ReplayGuard`): a sniffed call replayed within the freshness window is refused; the
guard remembers a signature only until its time leaves the window, and refuses (503)
rather than forgets when more than `MAX_REMEMBERED` signed calls arrive within one
window. Every other instance refuses it for its audience, so headers taken from a call
to one instance open no other. `/health` and `/metrics` stay open; every answer of an
instance names its audience in X-KVBridge-Audience, which is how a caller learns it
(`SignedRequests`).

Public API (`--api-key`, `--api-key-file`): `Authorization: Bearer <key>` on every
`/v1/...` call, as vLLM's `--api-key` and the `openai` client do; several keys may be
accepted, each of a tenant (`api_keys.py`), each its own prefix-cache namespace or, per
user, its tenant's (`isolation.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import hmac
import json
import logging
import math
import secrets
import time
from collections.abc import Generator
from typing import Any

import httpx

from kvbridge.connector.security import derive, sign
from kvbridge.serve.api_keys import ApiKeys

log = logging.getLogger("kvbridge.serve")

TIME_HEADER = "x-kvbridge-time"
NONCE_HEADER = "x-kvbridge-nonce"
DIGEST_HEADER = "x-kvbridge-content-sha256"
SIGNATURE_HEADER = "x-kvbridge-signature"
#: The instance a call is signed for (requests), and the instance that answers (responses).
AUDIENCE_HEADER = "x-kvbridge-audience"
#: The derivation label of the HTTP key: the version of the signed text. v3 signs the
#: audience; v2 (before it) did not.
HTTP_AUTH_VERSION = "kvbridge http v3"
#: The longest audience accepted (instance ids are far shorter).
MAX_AUDIENCE_LEN = 256
#: How far a signed request's time may be from ours (seconds): clocks of other hosts.
MAX_SKEW_S = 60.0
#: Signed calls one instance remembers at once (two windows' worth at ~800 calls/s).
MAX_REMEMBERED = 100_000
#: Paths anyone may read without a signature.
OPEN_PATHS = frozenset({"/health", "/metrics"})

Scope = dict[str, Any]


def http_key(token: bytes) -> bytes:
    return derive(token, HTTP_AUTH_VERSION)


def signature(
    key: bytes,
    method: str,
    path: str,
    query: str,
    audience: str,
    stamp: str,
    nonce: str,
    digest: str,
) -> str:
    """The HMAC of a request's signed headers (hex). No field holds a newline (HTTP
    header values and request targets cannot), so the text is unambiguous."""
    text = f"{method.upper()}\n{path}\n{query}\n{audience}\n{stamp}\n{nonce}\n{digest}"
    return sign(key, text.encode("latin-1")).hex()


class SignedRequests(httpx.Auth):
    """httpx auth that signs every request for the instance it goes to (the proxy's
    client): a fresh nonce each, and the instance's id as the audience.

    With `audience` given, every request is signed for it. Otherwise the audience of
    each origin (scheme, host, port) is what the instance there tells: asked once, from
    the X-KVBridge-Audience header of its open `/health`, before the first call; learned
    again when it refuses a call signed for another audience (a restarted instance has a
    new id), and that call signed afresh and sent once more. Only whoever answers at
    the URL can make a caller sign for another instance's id, and that is (over the
    deployment's HTTPS, or on loopback) a holder of the shared token, who can sign for
    any instance anyway. One object may serve several clients and threads."""

    requires_request_body = True

    def __init__(self, token: bytes, audience: str | None = None) -> None:
        self._key = http_key(token)
        self._fixed = audience
        self._audiences: dict[str, str] = {}  # origin -> the audience its instance told

    def sign(self, request: httpx.Request, audience: str) -> httpx.Request:
        """`request` with its signed headers for `audience`, a fresh time and nonce."""
        stamp = f"{time.time():.3f}"
        nonce = secrets.token_hex(16)
        digest = hashlib.sha256(request.content).hexdigest()
        query = request.url.query.decode("latin-1")
        request.headers[AUDIENCE_HEADER] = audience
        request.headers[TIME_HEADER] = stamp
        request.headers[NONCE_HEADER] = nonce
        request.headers[DIGEST_HEADER] = digest
        request.headers[SIGNATURE_HEADER] = signature(
            self._key, request.method, request.url.path, query, audience, stamp, nonce, digest
        )
        return request

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        origin = _origin(request.url)
        audience = self._fixed or self._audiences.get(origin)
        if audience is None:
            timeout = request.extensions.get("timeout")
            probe = httpx.Request(
                "GET",
                request.url.join("/health"),
                extensions={"timeout": timeout} if timeout is not None else {},
            )
            audience = self._learn(origin, (yield probe))
        response = yield self.sign(request, audience)
        told = response.headers.get(AUDIENCE_HEADER)
        if response.status_code == 403 and self._fixed is None and told and told != audience:
            self._audiences[origin] = told  # it restarted under a new id: sign for that
            yield self.sign(request, told)

    def _learn(self, origin: str, answer: httpx.Response) -> str:
        told = answer.headers.get(AUDIENCE_HEADER, "")
        if not told:
            log.warning(
                "the instance at %s names no audience (%s) on /health (HTTP %d): it runs a "
                "kvbridge older than '%s', which refuses these signatures; run the same "
                "kvbridge version on the proxy and the instances",
                origin,
                AUDIENCE_HEADER,
                answer.status_code,
                HTTP_AUTH_VERSION,
            )
        self._audiences[origin] = told
        return told


def _origin(url: httpx.URL) -> str:
    return f"{url.scheme}://{url.netloc.decode('ascii')}"


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
    the shared token's HTTP key for this instance (`audience`: its instance id), once.
    The outermost middleware: it refuses from the headers alone, before anything reads
    the body; the body then flows to the app (and its body limit) through a digest check
    that ends it before the app sees a body that is not the signed one. Every answer
    names `audience` in AUDIENCE_HEADER."""

    def __init__(
        self, app: Any, token: bytes, audience: str, max_remembered: int = MAX_REMEMBERED
    ) -> None:
        if not 0 < len(audience) <= MAX_AUDIENCE_LEN or "\n" in audience:
            raise ValueError(f"audience={audience[:80]!r} must be one line of 1 to 256 characters")
        self.app = app
        self.audience = audience
        self._key = http_key(token)
        self._named = (AUDIENCE_HEADER.encode(), audience.encode("latin-1"))
        self.guard = ReplayGuard(max_remembered)

    async def __call__(self, scope: Scope, receive: Any, raw_send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, raw_send)
            return

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self._named]}
            await raw_send(message)

        if scope["path"] in OPEN_PATHS:
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
        refusal = self._check(
            scope,
            header(AUDIENCE_HEADER),
            stamp,
            header(NONCE_HEADER),
            header(DIGEST_HEADER),
            given,
        )
        if refusal is not None:
            status, code, why = refusal
            await _drain(headers, receive)
            await _reply(send, status, why, code)
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
        self, scope: Scope, audience: str, stamp: str, nonce: str, digest: str, given: str
    ) -> tuple[int, str, str] | None:
        """(status, code, reason) refusing a request by its signed headers; None to
        accept it."""
        try:
            when = float(stamp)
        except ValueError:
            when = math.nan
        if not math.isfinite(when):
            return (
                403,
                "bad_signature",
                (
                    f"{TIME_HEADER}={stamp[:40]!r} is not a finite number of Unix seconds; "
                    "sign with the current time"
                ),
            )
        now = time.time()
        if abs(now - when) > MAX_SKEW_S:
            return (
                403,
                "bad_signature",
                (
                    f"the request's signature is stale ({now - when:+.0f} s off): sign with the "
                    f"same shared token, with clocks within {MAX_SKEW_S:g} s"
                ),
            )
        if not nonce or len(digest) != 64:
            return (
                403,
                "bad_signature",
                (
                    f"a signed request needs {NONCE_HEADER} and {DIGEST_HEADER} (the body's "
                    "SHA-256); sign with kvbridge's SignedRequests"
                ),
            )
        if not audience:
            return (
                403,
                "bad_signature",
                (
                    f"the request's signature names no audience ({AUDIENCE_HEADER}): its caller "
                    f"signs as a kvbridge older than '{HTTP_AUTH_VERSION}' (which signs the "
                    "instance a call is for); run the same kvbridge version on the proxy and "
                    "the instances"
                ),
            )
        if not hmac.compare_digest(audience.encode("latin-1"), self._named[1]):
            return (
                403,
                "wrong_audience",
                (
                    f"the request was signed for instance {audience[:MAX_AUDIENCE_LEN]!r}, and "
                    f"this is instance {self.audience!r}: a signed call opens only the "
                    "instance it was made for; sign it for this one (its /health names it in "
                    f"{AUDIENCE_HEADER})"
                ),
            )
        query = scope.get("query_string", b"").decode("latin-1")
        want = signature(
            self._key, scope["method"], scope["path"], query, audience, stamp, nonce, digest
        )
        if not hmac.compare_digest(want, given):
            return (
                403,
                "bad_signature",
                (
                    "the request's signature does not match: sign with the same shared token "
                    f"and kvbridge version ('{HTTP_AUTH_VERSION}'), with clocks within "
                    f"{MAX_SKEW_S:g} s"
                ),
            )
        first = self.guard.first_use(given, when, now)
        if first is None:
            return (
                503,
                "overloaded",
                (
                    f"more than {self.guard.max_remembered} signed calls within "
                    f"{MAX_SKEW_S:g} s; retry later"
                ),
            )
        if not first:
            return (
                403,
                "bad_signature",
                (
                    "the request's signature was used before: a signed call is accepted once "
                    "(a replay is refused); sign each request afresh"
                ),
            )
        return None


def bearer_key(authorization: str | None) -> str | None:
    """The key of an 'Authorization: Bearer <key>' header; None without one."""
    if not authorization or not authorization.startswith("Bearer "):
        return None
    return authorization.removeprefix("Bearer ")


class RequireApiKey:
    """ASGI middleware of the proxy: `/v1/...` needs `Authorization: Bearer <key>` with
    a key in force in `api_keys` (looked up by digest, `api_keys.py`); the request's
    scope then names the key's tenant (`scope["state"]["tenant"]`, Starlette's
    `request.state.tenant`)."""

    def __init__(self, app: Any, api_keys: ApiKeys) -> None:
        self.app = app
        self.api_keys = api_keys

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            key = given.removeprefix(b"Bearer ") if given.startswith(b"Bearer ") else None
            tenant = self.api_keys.tenant_of(key)
            if tenant is None:
                await _reply(
                    send,
                    401,
                    "Incorrect or missing API key: send 'Authorization: Bearer <key>' "
                    "(the server's --api-key, or a key of its --api-key-file)",
                    "invalid_api_key",
                )
                return
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
