"""A proxy started before a decode instance introduces it once it comes up: the decode
workers have met the prefill workers before the first request, and that request's KV
comes over and its answer equals colocated generation. The prefill instance is the
package's (its start is the slow part); the ordering cases (either side first, restarts,
outages) are tests/serve/test_introducer.py's."""

from __future__ import annotations

import time

import httpx
import pytest

from kvbridge.serve.launcher import Deployment
from tests.serve.helpers import colocated, complete, proxy_for, small_instance

pytestmark = pytest.mark.slow


def test_a_proxy_started_first_introduces_a_decode_instance_once_it_is_up(instances):
    dep = Deployment()
    proxy = None
    prefill = instances[("prefill", 1)]
    try:
        decode = dep.start_instance("decode", small_instance("decode", 3))
        # the port is known before the model loads: the proxy comes up first
        proxy = proxy_for([prefill], [decode.url])
        early = httpx.get(f"{proxy.url}/health", timeout=30).json()["introductions"]
        assert early[decode.url][prefill] != "connected"
        dep.wait_healthy(900, say=None)
        deadline = time.monotonic() + 120
        state = ""
        while time.monotonic() < deadline:
            intro = httpx.get(f"{proxy.url}/health", timeout=30).json()["introductions"]
            state = intro[decode.url][prefill]
            if state == "connected":
                break
            time.sleep(0.2)
        assert state == "connected"  # every decode worker met the prefill instance
        prompt = "The three primary colors are red, yellow and"
        out = complete(proxy.url, prompt, 8)
        assert out["kvbridge_stages"]["kv_bytes"] > 0  # the KV came over
        assert out["choices"][0]["text"] == colocated(decode.url, prompt, 8)
    finally:
        if proxy is not None:
            proxy.stop()
        dep.stop()
