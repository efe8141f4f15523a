"""Overload degrades, never collapses: real instances with a tiny KV cache (11 blocks,
so at most 5 requests each by default), a real proxy, and more concurrent streams than
they can hold. Every request completes with the right tokens or is refused at once
with 503 and Retry-After; afterwards the service answers normally and holds nothing."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import msgspec
import pytest

from kvbridge.serve import wire
from kvbridge.serve.backend import GenerateRequest, SamplingParams
from kvbridge.serve.launcher import Deployment
from kvbridge.serve.metrics import metric_value
from tests.serve.helpers import AUTH, colocated, instance_id, proxy_for, small_instance

pytestmark = pytest.mark.slow

#: The client's timeout: a request neither answered nor refused by then hung.
CLIENT_TIMEOUT_S = 120.0
#: The prefill instance's claim deadline, transfer timeout and lease: its unclaimed
#: blocks are freed 5 + 1 + 5 s after they were exposed, long before the lease (the
#: transfer timeout bounds a prefill instance's pulls by others, none of its own).
CLAIM_S, TRANSFER_TIMEOUT_S, LEASE_S = 5.0, 1.0, 600.0


@pytest.fixture(scope="module")
def small():
    """A prefill and a decode instance at tp 1 with 8 MiB of KV cache (11 blocks)."""
    dep = Deployment()
    try:
        urls = {
            "prefill": dep.start_instance(
                "prefill-small",
                small_instance(
                    "prefill",
                    1,
                    kv_cache_mb=8,
                    claim_s=CLAIM_S,
                    transfer_timeout_s=TRANSFER_TIMEOUT_S,
                    lease_s=LEASE_S,
                ),
            ).url,
            "decode": dep.start_instance(
                "decode-small", small_instance("decode", 1, kv_cache_mb=8)
            ).url,
        }
        dep.wait_healthy(600, say=None)
        yield urls
    finally:
        dep.stop()


def _stream(url: str, prompt: str) -> dict:
    """One streaming completion: ("ok", text) or ("refused", status, headers, error)."""
    started = time.monotonic()
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S) as r:
        if r.status_code != 200:
            r.read()
            return {
                "kind": "refused",
                "status": r.status_code,
                "retry_after": r.headers.get("retry-after"),
                "error": r.json()["error"],
                "s": time.monotonic() - started,
            }
        parts, errors = [], []
        for line in r.iter_lines():
            if line.startswith("data: {"):
                obj = json.loads(line[6:])
                if "error" in obj:
                    errors.append(obj["error"]["message"])
                else:
                    parts.append(obj["choices"][0]["text"])
    kind = "error" if errors else "ok"
    return {"kind": kind, "text": "".join(parts), "errors": errors}


def _settled(url: str, timeout_s: float = 30.0) -> str:
    """The proxy's /metrics once no instance holds a block or a request (or the last
    seen after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        busy = metric_value(text, "blocks_in_use") + metric_value(text, "requests_queued")
        if busy == 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def test_burst_completes_or_is_refused_fast_and_recovers(small):
    proxy = proxy_for([small["prefill"]], [small["decode"]])
    prompts = [f"Once upon a time, number {i} said" for i in range(40)]
    try:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: _stream(proxy.url, p), prompts))
        done = [(p, r) for p, r in zip(prompts, results, strict=True) if r["kind"] == "ok"]
        refused = [r for r in results if r["kind"] == "refused"]
        assert len(done) + len(refused) == len(prompts), [
            r for r in results if r["kind"] not in ("ok", "refused")
        ]
        assert done and refused  # 40 at once cannot all fit in 5 places
        for prompt, r in done:
            assert r["text"] == colocated(small["decode"], prompt, 8), prompt
        for r in refused:
            assert r["status"] == 503 and int(r["retry_after"]) >= 1, r
            assert r["error"]["code"] == "overloaded", r
            assert "(--max-queued-requests 5); retry after 1 s" in r["error"]["message"], r
            assert r["s"] < CLIENT_TIMEOUT_S / 2  # refused, not left to hang
        # after the burst: a normal request is answered, and nothing is held
        text = _settled(proxy.url)
        assert metric_value(text, "blocks_in_use") == 0, text
        assert metric_value(text, "requests_queued") == 0, text
        assert metric_value(text, "requests_rejected_total", reason="overloaded") == len(refused)
        assert metric_value(text, "instance_rejected_total") >= len(refused)
        r = httpx.post(
            f"{proxy.url}/v1/completions",
            json={"prompt": prompts[0], "max_tokens": 8, "temperature": 0},
            timeout=CLIENT_TIMEOUT_S,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == colocated(small["decode"], prompts[0], 8)
    finally:
        proxy.stop()


def test_reservations_bound_the_decode_instance(small):
    """The proxy's reservations count against the limit; a reserved request is admitted
    even when the instance is full, and a cancelled reservation frees its place."""
    decode = small["decode"]

    def reserve(rid: str) -> httpx.Response:
        return httpx.post(
            f"{decode}/internal/reserve", json={"request_id": rid}, timeout=30, auth=AUTH
        )

    for i in range(5):
        assert reserve(f"r-res-{i}").status_code == 200
    full = reserve("r-res-5")
    assert full.status_code == 503 and full.headers["retry-after"] == "1"
    assert full.json()["error"]["code"] == "overloaded"
    assert "holds 5 requests (--max-queued-requests 5)" in full.json()["error"]["message"]
    gen = GenerateRequest("r-res-0", SamplingParams(max_tokens=4, temperature=0.0), prompt="Hi")
    body = msgspec.json.encode(wire.DecodeRequest(gen))
    r = httpx.post(f"{decode}/internal/generate", content=body, timeout=CLIENT_TIMEOUT_S, auth=AUTH)
    assert r.status_code == 200, r.text  # it had a place
    for i in range(1, 5):
        cancel = {"request_id": f"r-res-{i}", "reason": "test"}
        r = httpx.post(f"{decode}/internal/cancel", json=cancel, timeout=30, auth=AUTH)
        assert r.json() == {"cancelled": True}
    assert metric_value(_settled(decode), "requests_queued") == 0


def test_unclaimed_kv_is_freed_at_the_claim_deadline(small):
    """A prefilled request no decode instance takes (and nobody cancels: the proxy
    died) is freed once its capability expired and no pull begun by then can still be
    reading (claim 5 s + transfer timeout 1 s + 5 s), not at the 600 s lease; a request
    the decode instance takes after the claim deadline pulls nothing: it computes the
    prompt itself, the load failed for the reason that the capability expired."""
    prefill, decode = small["prefill"], small["decode"]
    gen = GenerateRequest(
        "r-unclaimed",
        SamplingParams(max_tokens=8, temperature=0.0),
        prompt="The capital of France is",
        kv_reader=instance_id(decode),
    )
    started = time.monotonic()
    r = httpx.post(
        f"{prefill}/internal/prefill",
        content=msgspec.json.encode(gen),
        timeout=CLIENT_TIMEOUT_S,
        auth=AUTH,
    )
    assert r.status_code == 200, r.text
    pf = wire.prefill_result_decoder.decode(r.content)
    assert pf.kv is not None
    assert metric_value(httpx.get(f"{prefill}/metrics").text, "blocks_in_use") > 0
    time.sleep(max(0.0, started + CLAIM_S + 1 - time.monotonic()))
    late = httpx.post(
        f"{decode}/internal/generate",
        content=msgspec.json.encode(wire.DecodeRequest(gen, pf)),
        timeout=30,
        auth=AUTH,
    )
    assert late.status_code == 200, late.text  # computed here: nothing pulled so late
    last = [wire.event_decoder.decode(line) for line in late.text.splitlines() if line][-1]
    assert last.stages.kv_load_failed and last.stages.kv_bytes is None, last
    assert last.kv_load_error is not None and "expired" in last.kv_load_error
    text = _settled(prefill, timeout_s=LEASE_S / 4)  # the lease would not free them by then
    assert metric_value(text, "blocks_in_use") == 0, text


def test_a_prefill_whose_caller_left_is_dropped(small):
    """The caller of a prefill hangs up before the answer: the instance drops the
    request (its id is free again at once, nothing stays pinned until a lease)."""
    prefill = small["prefill"]
    # ~120 tokens: a prefill of tenths of a second, which the caller does not wait out
    # (four tokens were prefilled within its 10 ms on an idle machine)
    gen = GenerateRequest(
        "r-left", SamplingParams(max_tokens=8, temperature=0.0), prompt="Tell me a story. " * 24
    )
    body = msgspec.json.encode(gen)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{prefill}/internal/prefill",
            content=body,
            timeout=httpx.Timeout(30, read=0.01),
            auth=AUTH,
        )
    deadline = time.monotonic() + CLAIM_S  # well before its exposure could lapse
    while (
        r := httpx.post(f"{prefill}/internal/prefill", content=body, timeout=60, auth=AUTH)
    ).status_code == 409:
        assert time.monotonic() < deadline, "the dropped request still holds its id"
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    cancel = {"request_id": "r-left", "reason": "test over"}
    assert httpx.post(f"{prefill}/internal/cancel", json=cancel, auth=AUTH).json() == {
        "cancelled": True
    }
    assert metric_value(_settled(prefill), "blocks_in_use") == 0
