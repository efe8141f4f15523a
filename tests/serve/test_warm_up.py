"""A server's first streamed response loads nothing: the apps stream one response to
nowhere at start-up (`disconnect.warm_up_streaming`), so the modules sending it needs
(anyio's asyncio backend, which Starlette's first task group imports) are loaded before
the first request, not beside its pull; and their start-up ends by freezing what it made
out of later garbage collections (`kvbridge.heap`).

Each check runs in a fresh interpreter (this one has those modules loaded already) and
compares `sys.modules` before and after the first response it streams."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

#: Streams one ClosingStreamingResponse the way uvicorn's HTTP protocols serve it (ASGI
#: spec 2.3, the caller's disconnect listened for) after `prepare()`, and prints the
#: modules that response loaded, and those prepare() loaded.
_FIRST_RESPONSE = """
import asyncio, gc, json, sys

from kvbridge.serve.disconnect import ClosingStreamingResponse

{setup}

async def first_response():
    async def body():
        yield b"one"
        yield b"two"
    async def receive():
        await asyncio.Event().wait()
    sent = []
    async def send(message):
        sent.append(message)
    async def closed():
        sent.append({{"type": "closed"}})
    scope = {{"type": "http", "asgi": {{"version": "3.0", "spec_version": "2.3"}}}}
    await ClosingStreamingResponse(body(), on_close=closed)(scope, receive, send)
    return sent

async def main():
    before = set(sys.modules)
    await prepare()
    prepared = set(sys.modules) - before
    before = set(sys.modules)
    sent = await first_response()
    loaded = set(sys.modules) - before
    print(json.dumps({{
        "prepared": sorted(prepared),
        "loaded": sorted(loaded),
        "bodies": [m.get("body", b"").decode() for m in sent if m["type"] == "http.response.body"],
        "closed": sent[-1]["type"] == "closed",
        "frozen": gc.get_freeze_count(),
    }}))

asyncio.run(main())
"""


def _first_response(setup: str) -> dict[str, Any]:
    """What a fresh interpreter's first streamed response loaded after `setup` (which
    defines `async def prepare()`), and what `prepare` loaded."""
    code = _FIRST_RESPONSE.format(setup=textwrap.dedent(setup))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    assert result["bodies"] == ["one", "two", ""] and result["closed"], result
    return result


def test_without_the_warm_up_the_first_streamed_response_loads_modules() -> None:
    """The cost the warm-up moves exists: a first response with nothing before it loads
    anyio's asyncio backend (and what it imports)."""
    got = _first_response("async def prepare():\n    pass\n")
    assert "anyio._backends._asyncio" in got["loaded"], got
    assert got["frozen"] == 0, got


def test_after_the_warm_up_the_first_streamed_response_loads_nothing() -> None:
    got = _first_response(
        """
        from kvbridge.serve.disconnect import warm_up_streaming

        async def prepare():
            await warm_up_streaming()
        """
    )
    assert "anyio._backends._asyncio" in got["prepared"], got
    assert got["loaded"] == [], got


def test_the_proxy_warms_up_at_start_up() -> None:
    """The proxy app's start-up (its lifespan, which uvicorn runs before it serves)
    leaves its first streamed answer nothing to load."""
    got = _first_response(
        """
        from kvbridge.serve.proxy import make_app
        from tests.serve.fake_backend import FakeBackend

        async def prepare():
            app = make_app(FakeBackend())
            async with app.router.lifespan_context(app):
                pass
        """
    )
    assert "anyio._backends._asyncio" in got["prepared"], got
    assert got["loaded"] == [], got
    assert got["frozen"] > 10_000, got  # and froze what start-up made (`kvbridge.heap`)


def test_an_instance_warms_up_at_start_up() -> None:
    """The same for an instance's internal API (a real engine at tp 1, no connector,
    made before): its start-up loads what its first /internal/generate stream needs."""
    got = _first_response(
        """
        import atexit

        from kvbridge.engine.config import EngineConfig
        from kvbridge.engine.llm_engine import LLMEngine
        from kvbridge.serve.config import Role
        from kvbridge.serve.engine_loop import EngineLoop
        from kvbridge.serve.instance import Instance
        from kvbridge.serve.instance_app import build_app

        engine = LLMEngine("smollm2-135m", EngineConfig(tp_size=1, kv_cache_mb=16))
        loop = EngineLoop(engine, world_size=1).start()
        atexit.register(engine.shutdown)
        atexit.register(loop.stop)
        app = build_app(Instance(loop, Role.DECODE, "warm", "smollm2-135m"))

        async def prepare():
            async with app.router.lifespan_context(app):
                pass
        """
    )
    assert "anyio._backends._asyncio" in got["prepared"], got
    assert got["loaded"] == [], got
    assert got["frozen"] > 100_000, got  # the engine's objects too (`kvbridge.heap`)
