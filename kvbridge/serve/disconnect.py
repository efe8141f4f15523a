"""Noticing that the caller went away, so its request stops at once.

A client that gives up (its timeout, Ctrl-C, a proxy cancelling its call) closes its
connection. Starlette notices that only while a streamed response is being sent; a
handler still waiting for the engine (a prefill queued behind others, a request waiting
for its first token) would go on waiting, and the engine would compute a request nobody
reads. `until_disconnected` races such a wait against the connection: when the caller
goes first, the wait is cancelled and `ClientGone` raised, and the handler drops its
request. `ClosingStreamingResponse` runs a cleanup once its stream ends however it
ends, even when the caller left before the first chunk (then the body's generator never
starts, and its own `finally` would never run).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvbridge.errors import KVBridgeError

T = TypeVar("T")


class ClientGone(KVBridgeError):
    """The caller closed its connection before its answer was ready."""


async def until_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """`await aw`, unless the caller disconnects first: then `aw` is cancelled (and
    awaited, so its cleanup has run) and ClientGone is raised. Call it once the request
    body has been read (the next message the server gives is the disconnect)."""
    work = asyncio.ensure_future(aw)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        gone.cancel()
    if work.done():
        return work.result()
    work.cancel()
    try:
        await work
    except asyncio.CancelledError:
        pass
    except Exception:  # it failed while being cancelled: the caller is gone anyway
        pass
    raise ClientGone("the caller closed its connection")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass  # more body the handler did not read: skip it


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that awaits `on_close()` once it has ended, whether it was
    sent whole, the caller left in the middle, or before it began."""

    def __init__(self, content: Any, on_close: Callable[[], Awaitable[None]], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()
