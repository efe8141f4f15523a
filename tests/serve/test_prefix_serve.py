"""Prefix caching through `kvbridge serve`: a conversation's later turns compute and pull
only what is new, give the tokens colocated generation without caching gives, for TP
pairs, block sizes and layouts; the proxy keeps a conversation on one decode instance.
A conversation's first turn is a full pull: the decode workers read exactly the bytes of
the KV heads they hold, each head once (the tp-9 decode instance fans out: two of a
head's three holders copy it from the third), so later turns' partial pulls go through
the fan-out too (the TP pairs here are not repeated in test_tp_matrix.py)."""

from __future__ import annotations

import httpx
import pytest

from kvbridge.engine.weights import resolve_model
from kvbridge.plan.geometry import load_model_spec
from kvbridge.serve.metrics import metric_value
from tests.serve.helpers import AUTH, colocated, complete, proxy_for

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a helpful assistant. The user asks about the geography of Europe and wants "
    "short, precise answers. Question: What is the capital of France?"
)
MAX_TOKENS = 8


PAIRS = {
    "tp3-tp9": (("prefill", 3), ("decode", 9)),
    "tp9-tp3": (("prefill", 9), ("decode", 3)),
    "tp1-tp3": (("prefill", 1), ("decode", 3)),
    "b16-BHLNC-b32-LBNHC": (("prefill", 1), "decode32"),
    "b32-LBNHC-b16-BHLNC": ("prefill32", ("decode", 1)),
}


def _decode_tp(decode: object) -> int:
    return decode[1] if isinstance(decode, tuple) else 1


@pytest.mark.parametrize("pair", list(PAIRS), ids=list(PAIRS))
def test_a_conversation_moves_only_its_new_turn_with_the_same_tokens(instances, pair):
    prefill, decode = PAIRS[pair]
    proxy = proxy_for([instances[prefill]], [instances[decode]])
    bytes_per_token = load_model_spec(resolve_model("smollm2-135m")).bytes_per_token
    try:
        conversation, previous = f"[{pair}] {SYSTEM}", 0
        # SmolLM2's 3 KV heads: a decode tp of 9 holds each on three workers, one of
        # which reads it (the fan-out) and two copy it
        copies = max(_decode_tp(decode), 3) // 3 - 1
        for turn in range(3):
            out = complete(proxy.url, conversation, MAX_TOKENS)
            text = out["choices"][0]["text"]
            # colocated, on an instance that caches nothing: the reference tokens
            assert text == colocated(instances["reference"], conversation, MAX_TOKENS), turn
            stages, usage = out["kvbridge_stages"], out["usage"]
            prompt = usage["prompt_tokens"]
            assert "kv_load_failed" not in stages
            if turn:
                assert usage["prompt_tokens_details"]["cached_tokens"] > 0
                assert stages["cached_tokens"] > 0
                # only the new turn moves: its tokens and at most one block of each side
                bound = (prompt - previous + 32) * bytes_per_token
                assert stages["kv_bytes"] <= bound, (turn, stages)  # 0: held it all
                assert stages.get("kv_local_bytes", 0) == stages["kv_bytes"] * copies, stages
            else:  # the whole prompt, each head read once, copied to its other holders
                assert stages["kv_bytes"] == prompt * bytes_per_token, stages
                assert stages.get("kv_local_bytes", 0) == prompt * bytes_per_token * copies
            previous = prompt
            conversation += text + f" Question {turn}: and the capital of Spain?"
    finally:
        proxy.stop()
    for url in (instances[prefill], instances[decode]):
        assert metric_value(httpx.get(f"{url}/metrics").text, "blocks_in_use") == 0


def test_the_proxy_keeps_each_conversation_on_the_decode_instance_holding_it(instances):
    decodes = [instances[("decode", 1)], instances[("decode", 3)]]
    proxy = proxy_for([instances[("prefill", 1)]], decodes)
    try:
        conversations = [f"[routing {c}] {SYSTEM}" for c in range(2)]
        seen: list[set[str]] = [set(), set()]
        for turn in range(3):
            for c in range(2):
                out = complete(proxy.url, conversations[c], MAX_TOKENS)
                seen[c].add(out["kvbridge_stages"]["decode_instance"])
                conversations[c] += out["choices"][0]["text"] + f" Question {turn}: and Spain?"
        assert [len(s) for s in seen] == [1, 1]  # each stayed where it began
        text = httpx.get(f"{proxy.url}/metrics").text
        assert metric_value(text, "prefix_cache_hits_total", role="decode") > 0
        assert metric_value(text, "kv_bytes_saved_total", role="decode") > 0
    finally:
        proxy.stop()


def test_lookup_says_what_the_cache_holds_and_holds_nothing(instances):
    url = instances[("decode", 1)]
    body = {"request_id": "look", "sampling": {}, "prompt": f"[lookup] {SYSTEM}"}
    first = httpx.post(f"{url}/internal/lookup", json=body, auth=AUTH, timeout=60).json()
    assert first["cached_tokens"] == 0 and first["prompt_tokens"] > 16
    colocated(url, body["prompt"], 2)
    second = httpx.post(f"{url}/internal/lookup", json=body, auth=AUTH, timeout=60).json()
    assert second["cached_tokens"] == first["prompt_tokens"] // 16 * 16
    # the decode instance, not the proxy, says what it would pull: nothing once it
    # holds every full block; else from its hit on, leaving the last token to pull
    n = first["prompt_tokens"]
    assert first["kv_start_token"] == 0 and not first["holds_prompt"]
    assert second["holds_prompt"]
    assert second["kv_start_token"] == min(second["cached_tokens"], (n - 1) // 16 * 16)
    assert metric_value(httpx.get(f"{url}/metrics").text, "blocks_in_use") == 0
    unsigned = httpx.post(f"{url}/internal/lookup", json=body, timeout=60)
    assert unsigned.status_code == 401
