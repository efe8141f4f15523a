"""ASGI middleware that bounds request bodies before an app reads them.

A body larger than the limit is refused with 413 and an OpenAI-shaped error, and is
never held whole: a declared Content-Length over the limit is refused before a byte of
the body is read, and a body without one (chunked) is counted as it streams in and
refused as soon as the count passes the limit. A body within the limit is read here
and handed to the app as one message (every handler reads its whole body anyway).
The 413 answer closes the connection (the rest of the body is never read); the server
goes on serving other connections. A body that has not fully arrived `body_timeout_s`
after the request began is refused with 408 the same way (a client that stalls holds no
handler).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from kvbridge.serve.openai_responses import error_body

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

#: Default limit of a request body: ~1.5 million tokens of prompt as JSON ids.
DEFAULT_MAX_BODY_MB = 16.0
#: Longest a request body may take to arrive.
BODY_TIMEOUT_S = 60.0


def mib_to_bytes(mb: float) -> int:
    return int(mb * (1 << 20))


class BodyLimit:
    """Refuses request bodies over `max_bytes` (or over `path_limits[path]` for the
    paths it names) with 413, and bodies slower than `body_timeout_s` with 408 (see the
    module docstring). `on_refused(status)` runs for each refusal (the proxy counts
    them)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        on_refused: Callable[[int], None] | None = None,
        body_timeout_s: float = BODY_TIMEOUT_S,
        path_limits: Mapping[str, int] | None = None,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes={max_bytes} must be positive")
        self.app = app
        self.max_bytes = max_bytes
        self.on_refused = on_refused
        self.body_timeout_s = body_timeout_s
        self.path_limits = dict(path_limits or {})

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope["path"], self.max_bytes)
        declared = _content_length(scope)
        if declared is None:
            await self._refuse(send, 400, "Content-Length is not a non-negative integer", None)
            return
        if declared > limit:
            await self._refuse(
                send, 413, self._too_large(f"{declared} bytes", limit), "request_too_large"
            )
            return
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except TimeoutError:
                what = f"{size} bytes" if size else "no byte"
                message_text = (
                    f"request body not complete within {self.body_timeout_s:g} s "
                    f"({what} arrived); send the whole body at once"
                )
                await self._refuse(send, 408, message_text, "request_timeout")
                return
            if message["type"] == "http.disconnect":
                return  # the client went away before its body ended: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._refuse(
                    send,
                    413,
                    self._too_large(f"more than {limit} bytes", limit),
                    "request_too_large",
                )
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then the server's own messages (http.disconnect)

        await self.app(scope, replay, send)

    def _too_large(self, what: str, limit: int) -> str:
        if limit != self.max_bytes:  # a control call's own limit: no flag raises it
            return f"request body of {what} exceeds the limit of {limit} bytes of this call"
        limit_mb = self.max_bytes / (1 << 20)
        return (
            f"request body of {what} exceeds the limit of {self.max_bytes} bytes "
            f"({limit_mb:g} MiB); send a smaller body or raise --max-body-mb"
        )

    async def _refuse(self, send: Send, status: int, message: str, code: str | None) -> None:
        if self.on_refused is not None:
            self.on_refused(status)
        body = json.dumps(error_body(message, code=code)).encode()
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
        await send({"type": "http.response.body", "body": body, "more_body": False})


def _content_length(scope: MutableMapping[str, Any]) -> int | None:
    """The declared body size (0 when undeclared); None when the header is malformed."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isascii() and text.isdigit() else None
    return 0
