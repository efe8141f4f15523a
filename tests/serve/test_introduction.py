"""A proxy started before a prefill instance introduces it once it comes up: the decode
workers have met the prefill workers before the first request, and that request's KV
comes over and its answer equals colocated generation. The decode instance is the
package's (its start is the slow part); the ordering cases (either side first, restarts,
outages) are tests/serve/test_introducer.py's."""

from __future__ import annotations

import time

import httpx
import pytest

from kvbridge.serve.launcher import Deployment
from tests.serve.helpers import colocated, complete, proxy_for, small_instance

pytestmark = pytest.mark.slow


def test_a_proxy_started_first_introduces_a_prefill_instance_once_it_is_up(instances):
    """The prefill instance has served nothing when it is introduced: its tp workers
    answer the handshakes all the same (they learn their instance's endpoints when the
    engine is made; before, they refused every handshake until its first request)."""
    dep = Deployment()
    proxy = None
    decode = instances[("decode", 3)]
    try:
        prefill = dep.start_instance("prefill", small_instance("prefill", 3))
        # the port is known before the model loads: the proxy comes up first
        proxy = proxy_for([prefill.url], [decode])
        early = httpx.get(f"{proxy.url}/health", timeout=30).json()["introductions"]
        assert early[decode][prefill.url] != "connected"
        dep.wait_healthy(900, say=None)
        deadline = time.monotonic() + 120
        state = ""
        while time.monotonic() < deadline:
            intro = httpx.get(f"{proxy.url}/health", timeout=30).json()["introductions"]
            state = intro[decode][prefill.url]
            if state == "connected":
                break
            time.sleep(0.2)
        assert state == "connected"  # every decode worker met every prefill worker
        prompt = "The three primary colors are red, yellow and"
        out = complete(proxy.url, prompt, 8)
        stages = out["kvbridge_stages"]
        assert stages["kv_bytes"] > 0  # the KV came over
        # ... without a handshake, over paths the warm-up READs had set up
        assert (stages["kv_handshakes"], stages["kv_cold_peers"]) == (0, 0), stages
        assert out["choices"][0]["text"] == colocated(decode, prompt, 8)
    finally:
        if proxy is not None:
            proxy.stop()
        dep.stop()
