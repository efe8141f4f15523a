"""Disaggregated serving end to end: real instance processes (engine, NIXL, side
channel), a real proxy on 127.0.0.1, and the answers compared with colocated generation."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import httpx
import openai
import pytest

from kvbridge.serve.demo import colocated_text
from kvbridge.serve.launcher import Deployment
from tests.serve.helpers import complete, instance_args, metric, proxy_for

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def instances():
    """One prefill (tp 1, block 16 HND) and two decode instances (tp 1 block 16 HND,
    tp 1 block 32 NHD), loaded once for the module."""
    dep = Deployment()
    try:
        urls = {
            "prefill": dep.start_instance("prefill", instance_args("prefill", 1)).url,
            "decode": dep.start_instance("decode", instance_args("decode", 1)).url,
            "decode32": dep.start_instance("decode32", instance_args("decode", 1, 32, "NHD")).url,
        }
        dep.wait_healthy(600, say=None)
        yield dep, urls
    finally:
        dep.stop()


@pytest.mark.parametrize("decode", ["decode", "decode32"])
def test_greedy_equals_colocated(instances, decode):
    _, urls = instances
    proxy = proxy_for([urls["prefill"]], [urls[decode]])
    try:
        for prompt in PROMPTS:
            out = complete(proxy.url, prompt)
            assert out["choices"][0]["text"] == colocated_text(urls[decode], prompt, 12)
            stages = out["kvbridge_stages"]
            assert stages["kv_bytes"] > 0 and "kv_load_failed" not in stages
        first = complete(proxy.url, "The capital of France is", 10)["choices"][0]["text"]
        assert first.startswith(" Paris")
    finally:
        proxy.stop()


def test_concurrent_streams_complete_and_free_blocks(instances):
    _, urls = instances
    proxy = proxy_for([urls["prefill"]], [urls["decode"]])
    prompts = [("Once upon a time " * (1 + i % 5)) + f"number {i}" for i in range(16)]
    try:

        def stream(prompt: str) -> str:
            parts = []
            with httpx.stream(
                "POST",
                f"{proxy.url}/v1/completions",
                json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True},
                timeout=600,
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        parts.append(json.loads(line[6:])["choices"][0]["text"])
            return "".join(parts)

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            got = list(pool.map(stream, prompts))
        for prompt, text in zip(prompts, got, strict=True):
            assert text == colocated_text(urls["decode"], prompt, 8)
        deadline = time.monotonic() + 30
        while True:
            text = httpx.get(f"{proxy.url}/metrics").text
            used = metric(text, "blocks_in_use")
            if used == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert used == 0, text
        assert metric(text, "requests_total", status="200") == 16
        assert metric(text, "kv_bytes_total") > 0
    finally:
        proxy.stop()


def test_openai_client_against_disaggregated_serve(instances):
    _, urls = instances
    proxy = proxy_for([urls["prefill"]], [urls["decode"]])
    try:
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none")
        chat = client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
            temperature=0,
        )
        text = chat.choices[0].message.content
        assert text and chat.usage.completion_tokens == 8
        pieces = client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == text
    finally:
        proxy.stop()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_instance_killed(policy):
    """The prefill instance dies: recompute still answers correctly; fail answers an
    OpenAI-shaped error; neither hangs."""
    dep = Deployment()
    proxy = None
    try:
        prefill = dep.start_instance("prefill", instance_args("prefill", 1))
        decode = dep.start_instance(
            "decode", instance_args("decode", 1, 16, "HND", "--kv-load-failure", policy)
        )
        dep.wait_healthy(600, say=None)
        proxy = proxy_for([prefill.url], [decode.url], recompute=policy == "recompute")
        want = colocated_text(decode.url, PROMPTS[0], 6)
        assert complete(proxy.url, PROMPTS[0], 6)["choices"][0]["text"] == want
        prefill.proc.send_signal(signal.SIGKILL)
        prefill.proc.wait(10)
        t0 = time.monotonic()
        r = httpx.post(
            f"{proxy.url}/v1/completions",
            json={"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0},
            timeout=120,
        )
        assert time.monotonic() - t0 < 60
        if policy == "recompute":
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        else:
            assert r.status_code == 503 and "prefill instance" in r.json()["error"]["message"]
    finally:
        if proxy is not None:
            proxy.stop()
        dep.stop()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_dies_between_prefill_and_pull(policy):
    """The KV is exposed, then its producer dies before the decode instance reads it:
    the pull fails with a reason within the transfer timeout, and the decode instance
    recomputes (correct text) or reports the failure; its blocks are freed either way."""
    import msgspec

    from kvbridge.serve import wire
    from kvbridge.serve.backend import GenerateRequest, SamplingParams

    dep = Deployment()
    try:
        prefill = dep.start_instance("prefill", instance_args("prefill", 1))
        decode = dep.start_instance(
            "decode", instance_args("decode", 1, 16, "HND", "--kv-load-failure", policy)
        )
        dep.wait_healthy(600, say=None)
        want = colocated_text(decode.url, PROMPTS[1], 6)
        gen = GenerateRequest(
            request_id="r-kill",
            prompt=PROMPTS[1],
            sampling=SamplingParams(max_tokens=6, temperature=0.0),
        )
        r = httpx.post(
            f"{prefill.url}/internal/prefill", content=msgspec.json.encode(gen), timeout=120
        )
        pf = wire.prefill_result_decoder.decode(r.content)
        assert pf.kv is not None and pf.kv.block_ids
        prefill.proc.send_signal(signal.SIGKILL)
        prefill.proc.wait(10)
        t0 = time.monotonic()
        events = []
        with httpx.stream(
            "POST",
            f"{decode.url}/internal/generate",
            content=msgspec.json.encode(wire.DecodeRequest(gen, pf)),
            timeout=120,
        ) as resp:
            for line in resp.iter_lines():
                if line:
                    events.append(wire.event_decoder.decode(line))
        assert time.monotonic() - t0 < 30  # bounded by the 10 s transfer timeout
        if policy == "recompute":
            assert pf.first_text + "".join(e.text for e in events) == want
            assert events[-1].stages.get("kv_load_failed") == 1.0
        else:
            assert events[-1].error and "KV cache load failed" in events[-1].error
        deadline = time.monotonic() + 10
        while (
            metric(httpx.get(f"{decode.url}/metrics").text, "blocks_in_use")
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        assert metric(httpx.get(f"{decode.url}/metrics").text, "blocks_in_use") == 0
    finally:
        dep.stop()
