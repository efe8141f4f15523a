"""Greedy completions through the proxy equal colocated generation for every
(prefill tp, decode tp) pair of the issue, with GQA replication on either side
(SmolLM2 has 3 KV heads: tp 9 holds each head on three workers), and the decode workers
read exactly the bytes of the KV heads they hold: the tp-9 decode instance fans out, so
each head crosses from the prefill once and is copied to its other two holders.

The pairs 3 -> 9, 9 -> 3 and 1 -> 3 are proven in tests/serve/test_prefix_serve.py,
whose first turn is this test's full pull (same equality, same byte count) before its
later turns pull only what is new; this module holds the other pairs."""

from __future__ import annotations

import pytest

from tests.serve.helpers import colocated as colocated_on
from tests.serve.helpers import complete, proxy_for

pytestmark = pytest.mark.slow

PAIRS = [(1, 9), (9, 1), (3, 3)]
PROMPTS = ["The capital of France is", "List three colors: red,"]


@pytest.fixture(scope="module")
def colocated(instances):
    """Each prompt's greedy text computed colocated on the tp-1 decode instance."""
    return {p: colocated_on(instances[("decode", 1)], p, 8) for p in PROMPTS}


@pytest.mark.parametrize("prefill_tp, decode_tp", PAIRS, ids=[f"{p}to{d}" for p, d in PAIRS])
def test_disaggregated_equals_colocated(instances, colocated, prefill_tp, decode_tp):
    proxy = proxy_for([instances[("prefill", prefill_tp)]], [instances[("decode", decode_tp)]])
    try:
        for prompt in PROMPTS:
            out = complete(proxy.url, prompt, 8)
            assert out["choices"][0]["text"] == colocated[prompt]
            stages = out["kvbridge_stages"]
            assert "kv_load_failed" not in stages
            # every KV head is read once: bytes = tokens x layers x K,V x head_dim x
            # fp32 x 3 KV heads; at decode tp 9 (fan-out) its other holders copy it
            per_head = out["usage"]["prompt_tokens"] * 30 * 2 * 64 * 4
            assert stages["kv_bytes"] == per_head * 3
            assert stages.get("kv_local_bytes", 0) == per_head * (max(decode_tp, 3) - 3)
        # the colocated answer itself matches the same request at this decode tp
        here = colocated_on(instances[("decode", decode_tp)], PROMPTS[0], 8)
        assert here == colocated[PROMPTS[0]]
    finally:
        proxy.stop()
