"""When an instance's engine fails, nobody waits for a timeout: pending prefills, queued
calls and running streams fail at once with the cause, later calls are refused with it
(503), /health says 503 with it, and the proxy routes around the instance or answers an
OpenAI-shaped 503 naming it.

The engine is real (SmolLM2 at tp 1, in this process, behind a real HTTP server) and
its step is made to fail; killing a tp worker of a real tp-3 instance is tested in
test_disagg.py."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from kvbridge.engine.config import EngineConfig
from kvbridge.engine.llm_engine import LLMEngine
from kvbridge.errors import WorkerError
from kvbridge.serve import wire
from kvbridge.serve.backend import GenerateRequest, SamplingParams
from kvbridge.serve.config import Role
from kvbridge.serve.engine_loop import EngineLoop
from kvbridge.serve.http_server import ServerThread
from kvbridge.serve.instance import Instance
from kvbridge.serve.instance_app import build_app
from tests.serve.helpers import proxy_for

CAUSE = "tp step failed: worker rank 1 (pid 4242) exited with code -9"


class _Served:
    def __init__(self, name: str) -> None:
        self.engine = LLMEngine("smollm2-135m", EngineConfig(tp_size=1, kv_cache_mb=16))
        self.loop = EngineLoop(self.engine, world_size=1).start()
        inst = Instance(self.loop, Role.PREFILL, name, "smollm2-135m")
        self.server = ServerThread(build_app(inst)).start()
        self.url = self.server.url

    def close(self) -> None:
        self.server.stop()
        self.loop.stop()
        self.engine.shutdown()


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[_Served, _Served]]:
    """Two instances without KV connectors (both answer /internal/prefill and colocated
    /internal/generate): `doomed`, whose engine the test breaks, and `healthy`."""
    doomed, healthy = _Served("doomed"), _Served("healthy")
    try:
        yield doomed, healthy
    finally:
        doomed.close()
        healthy.close()


def _gen(rid: str, max_tokens: int = 4) -> GenerateRequest:
    return GenerateRequest(
        rid, SamplingParams(max_tokens=max_tokens, temperature=0.0), prompt="1, 2, 3, 4,"
    )


def _prefill(url: str, rid: str) -> httpx.Response:
    return httpx.post(f"{url}/internal/prefill", content=msgspec.json.encode(_gen(rid)), timeout=20)


def _stream(url: str, rid: str) -> list[wire.GenerateEvent]:
    body = msgspec.json.encode(wire.DecodeRequest(_gen(rid, 200)))
    with httpx.stream("POST", f"{url}/internal/generate", content=body, timeout=20) as r:
        assert r.status_code == 200, r.read()
        return [wire.event_decoder.decode(line) for line in r.iter_lines() if line]


def test_engine_failure_fails_every_waiter_at_once(pair):
    doomed, _ = pair
    loop = doomed.loop
    hold, fail = threading.Event(), threading.Event()

    def broken_step() -> list:
        fail.wait(30)
        raise WorkerError(CAUSE, rank=1)

    def wait_until(condition) -> None:
        for _ in range(1000):
            if condition():
                return
            threading.Event().wait(0.01)
        raise AssertionError("condition not reached")

    holding = threading.Event()

    def hold_the_loop(engine: LLMEngine) -> None:
        holding.set()
        hold.wait(30)

    loop.call(hold_the_loop)
    holding.wait(30)
    doomed.engine.step = broken_step
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        # both start together once the loop goes on: a prefill waiting for its first
        # token and a stream waiting for tokens; then the step hangs until `fail`
        prefill = pool.submit(_prefill, doomed.url, "p-1")
        stream = pool.submit(_stream, doomed.url, "s-1")
        wait_until(lambda: loop.queued_calls == 2)
        hold.set()
        wait_until(lambda: {"p-1", "s-1"} <= loop.waiters.keys())
        queued = pool.submit(_prefill, doomed.url, "q-1")  # waits behind the hung step
        wait_until(lambda: loop.queued_calls == 1)
        fail.set()
        # every waiter hears the cause now (httpx's 20 s timeout would fail the test)
        for answer in (prefill.result(), queued.result()):
            assert answer.status_code == 503, answer.text
            err = answer.json()["error"]
            assert CAUSE in err["message"] and err["code"] == "engine_failed"
        events = stream.result()
        assert events[-1].error and CAUSE in events[-1].error
    assert loop.fatal and CAUSE in loop.fatal

    later = _prefill(doomed.url, "p-2")
    assert later.status_code == 503 and CAUSE in later.json()["error"]["message"]
    body = msgspec.json.encode(wire.DecodeRequest(_gen("s-2")))
    later = httpx.post(f"{doomed.url}/internal/generate", content=body, timeout=20)
    assert later.status_code == 503 and CAUSE in later.json()["error"]["message"]
    health = httpx.get(f"{doomed.url}/health", timeout=20)
    assert health.status_code == 503
    assert health.json()["status"] == "failed" and CAUSE in health.json()["reason"]
    assert httpx.get(f"{doomed.url}/metrics", timeout=20).status_code == 200


def _break(served: _Served) -> None:
    """Make `served`'s engine fail on its next step (if the test above did not)."""
    if served.loop.fatal is not None:
        return

    def broken_step() -> list:
        raise WorkerError(CAUSE, rank=1)

    served.engine.step = broken_step
    assert _prefill(served.url, "breaker").status_code == 503
    assert served.loop.fatal and CAUSE in served.loop.fatal


def test_proxy_routes_around_a_failed_instance(pair):
    doomed, healthy = pair
    _break(doomed)  # runs alone too
    request = {"prompt": "1, 2, 3, 4,", "max_tokens": 4, "temperature": 0}
    # two decode instances, the first one failed: every request is served
    proxy = proxy_for([], [doomed.url, healthy.url])
    try:
        for _ in range(3):
            r = httpx.post(f"{proxy.url}/v1/completions", json=request, timeout=60)
            assert r.status_code == 200, r.text
        health = httpx.get(f"{proxy.url}/health", timeout=20)
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert CAUSE in json.dumps(health.json()["instances"][doomed.url])
    finally:
        proxy.stop()
    # the failed instance alone, as decode or as prefill without recompute: a 503 naming it
    for prefill, decode, recompute in (
        ([], [doomed.url], True),
        ([doomed.url], [healthy.url], False),
    ):
        proxy = proxy_for(prefill, decode, recompute=recompute)
        try:
            r = httpx.post(f"{proxy.url}/v1/completions", json=request, timeout=60)
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert CAUSE in err["message"] and err["type"] == "server_error"
            assert doomed.url in err["message"]
        finally:
            proxy.stop()
    # as prefill with recompute: the decode instance computes the prompt
    proxy = proxy_for([doomed.url], [healthy.url])
    try:
        r = httpx.post(f"{proxy.url}/v1/completions", json=request, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        proxy.stop()
