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

A server's first streamed response loads the modules that sending it uses (Starlette
starts a task group in anyio, which imports its asyncio backend then): 10-20 ms of CPU in
the serving thread. On a decode instance that response starts as its request's pull
does, and that thread, at the process's priority, takes the cores from the tp workers'
threads that carry the pull's orders (at compute priority, `cpu_share.py`): the first
pull waits for it. `warm_up_streaming`, run by the apps' lifespans at start-up, sends
one response to nowhere, so that work is done before the first request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

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


async def warm_up_streaming() -> None:
    """Send one `ClosingStreamingResponse` to nowhere, as an HTTP server would send it
    (ASGI spec 2.3, uvicorn's HTTP protocols': the response listens for the caller's
    disconnect meanwhile), so a server's first real one loads nothing."""

    async def body() -> AsyncIterator[bytes]:
        yield b"{}"

    async def receive() -> Message:
        await asyncio.Event().wait()  # the caller never leaves; the stream ends first
        return {"type": "http.disconnect"}

    async def send(_: Message) -> None:
        pass

    async def closed() -> None:
        pass

    scope: Scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
    await ClosingStreamingResponse(body(), on_close=closed)(scope, receive, send)
