"""Disaggregated serving end to end: real instance processes (engine, NIXL, side
channel), a real proxy on 127.0.0.1, and the answers compared with colocated generation."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import secrets
import signal
import time
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from kvbridge.engine.cpu_share import COMPUTE_NICE
from kvbridge.serve import wire
from kvbridge.serve.backend import GenerateRequest, SamplingParams
from kvbridge.serve.config import KVLoadFailure
from kvbridge.serve.http_auth import (
    AUDIENCE_HEADER,
    DIGEST_HEADER,
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIME_HEADER,
    http_key,
    signature,
)
from kvbridge.serve.launcher import Deployment
from kvbridge.serve.metrics import metric_value
from tests.serve.helpers import (
    AUTH,
    TOKEN,
    colocated,
    complete,
    instance_id,
    proxy_for,
    raw_post,
    small_instance,
)

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Water boils at a temperature of",
]


def test_greedy_equals_colocated(instances):
    """Prefill block 16 BHLNC -> decode block 16 BHLNC. Block 16 BHLNC <-> block 32
    LBNHC, both ways, are test_prefix_serve.py's (a full pull, then partial ones)."""
    decode = ("decode", 1)
    proxy = proxy_for([instances[("prefill", 1)]], [instances[decode]])
    try:
        for prompt in PROMPTS:
            out = complete(proxy.url, prompt)
            assert out["choices"][0]["text"] == colocated(instances[decode], prompt, 12)
            stages = out["kvbridge_stages"]
            assert stages["kv_bytes"] > 0 and "kv_load_failed" not in stages
        first = complete(proxy.url, "The capital of France is", 10)["choices"][0]["text"]
        assert first.startswith(" Paris")
    finally:
        proxy.stop()


def test_concurrent_streams_complete_and_free_blocks(instances):
    urls = {"prefill": instances[("prefill", 1)], "decode": instances[("decode", 1)]}
    proxy = proxy_for([urls["prefill"]], [urls["decode"]])
    # 16 streams at once of 4 prompts (4 colocated references to compute, not 16)
    distinct = [("Once upon a time " * (1 + i)) + f"number {i}" for i in range(4)]
    prompts = [distinct[i % 4] for i in range(16)]
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
        want = {prompt: colocated(urls["decode"], prompt, 8) for prompt in distinct}
        assert got == [want[prompt] for prompt in prompts]
        deadline = time.monotonic() + 30
        while True:
            text = httpx.get(f"{proxy.url}/metrics").text
            used = metric_value(text, "blocks_in_use")
            if used == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert used == 0, text
        assert metric_value(text, "requests_total", status="200") == 16
        assert metric_value(text, "kv_bytes_total") > 0
    finally:
        proxy.stop()


def test_openai_client_against_disaggregated_serve(instances):
    proxy = proxy_for([instances[("prefill", 1)]], [instances[("decode", 1)]])
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


def test_bad_input_is_refused_by_real_instances(instances):
    """The seed and surrogate cases end to end: the proxy refuses them naming the
    parameter, and so do the instances when called directly (400, never 500); an
    oversized body is refused with 413; everything keeps serving."""
    prefill, decode = instances[("prefill", 1)], instances[("decode", 1)]
    proxy = proxy_for([prefill], [decode])
    try:
        url = f"{proxy.url}/v1/completions"
        r = httpx.post(url, json={"prompt": "x", "seed": 2**70}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
        r = httpx.post(url, content=b'{"prompt": "\\ud800x"}', timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "lone surrogate" in r.json()["error"]["message"]
        body = {"prompt": "x", "seed": 2**64 - 1, "temperature": 0.7, "max_tokens": 3}
        assert httpx.post(url, json=body, timeout=60).status_code == 200
        body = {"prompt": "x", "temperature": 1e-300, "max_tokens": 3}  # greedy, not NaN
        assert httpx.post(url, json=body, timeout=60).status_code == 200
    finally:
        proxy.stop()
    # sampling parameters are checked where they are decoded, whoever sent them
    gen = (
        b'{"request_id": "r-big-seed", "sampling": {"max_tokens": 3, "seed": %d}, "prompt": "x"'
        % 2**70
    )
    r = httpx.post(f"{prefill}/internal/prefill", content=gen + b"}", timeout=60, auth=AUTH)
    assert r.status_code == 400 and "seed=1180591620717411303424 is outside" in r.text
    body = b'{"request": ' + gen + b"}}"
    r = httpx.post(f"{decode}/internal/generate", content=body, timeout=60, auth=AUTH)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    raw = b'{"request_id": "r-sur", "sampling": {}, "prompt": "\\ud800x"}'
    r = httpx.post(f"{prefill}/internal/prefill", content=raw, timeout=60, auth=AUTH)
    assert r.status_code == 400 and "malformed request" in r.json()["error"]["message"]
    big = b"Content-Length: 17000000\r\n"
    for instance in (prefill, decode):
        # unsigned: refused from its headers (401); signed: over the limit (413)
        _, answer = raw_post(instance, "/internal/generate", big, [])
        assert answer.startswith(b"HTTP/1.1 401") and b"unauthenticated" in answer
        signed = _signed_headers(
            "/internal/generate", hashlib.sha256(b"").hexdigest(), instance_id(instance)
        )
        _, answer = raw_post(instance, "/internal/generate", big + signed, [])
        assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer
        assert httpx.get(f"{instance}/health", timeout=10).status_code == 200


def _signed_headers(path: str, digest: str, audience: str) -> bytes:
    """Header lines of a POST to `path` signed with the test token for the instance
    `audience` (for a body whose SHA-256 is `digest`), as `SignedRequests` writes them."""
    stamp, nonce = f"{time.time():.3f}", secrets.token_hex(16)
    sig = signature(http_key(TOKEN), "POST", path, "", audience, stamp, nonce, digest)
    fields = {AUDIENCE_HEADER: audience, TIME_HEADER: stamp, NONCE_HEADER: nonce}
    fields[DIGEST_HEADER] = digest
    fields[SIGNATURE_HEADER] = sig
    return "".join(f"{k}: {v}\r\n" for k, v in fields.items()).encode()


def test_duplicate_request_ids_are_refused_while_in_use(instances):
    """A request id an instance still holds is refused with 409 and the request that
    holds it is left alone; once it has finished and freed its blocks the id is free."""
    prefill, decode = instances[("prefill", 1)], instances[("decode", 1)]
    gen = GenerateRequest(
        "r-dup",
        SamplingParams(max_tokens=48, temperature=0.0),
        prompt=PROMPTS[2],
        kv_reader=instance_id(decode),
    )

    def prefill_it() -> httpx.Response:
        return httpx.post(
            f"{prefill}/internal/prefill", content=msgspec.json.encode(gen), timeout=120, auth=AUTH
        )

    def decode_it(pf: wire.PrefillResult | None) -> list[wire.GenerateEvent]:
        body = msgspec.json.encode(wire.DecodeRequest(gen, pf))
        with httpx.stream(
            "POST", f"{decode}/internal/generate", content=body, timeout=120, auth=AUTH
        ) as r:
            return [wire.event_decoder.decode(line) for line in r.iter_lines() if line]

    r = prefill_it()
    assert r.status_code == 200, r.text
    pf = wire.prefill_result_decoder.decode(r.content)
    assert pf.kv is not None  # its blocks stay exposed until the decode instance pulls them
    again = prefill_it()
    assert again.status_code == 409 and again.json()["error"]["code"] == "request_id_in_use"
    body = msgspec.json.encode(wire.DecodeRequest(gen, pf))
    with httpx.stream(
        "POST", f"{decode}/internal/generate", content=body, timeout=120, auth=AUTH
    ) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)  # decoding runs
        colocated = msgspec.json.encode(wire.DecodeRequest(gen))
        dup = httpx.post(f"{decode}/internal/generate", content=colocated, timeout=60, auth=AUTH)
        assert dup.status_code == 409, dup.text
        events = [wire.event_decoder.decode(first)]
        events += [wire.event_decoder.decode(line) for line in lines if line]
    assert events[-1].finish_reason and not events[-1].error
    assert events[-1].completion_tokens == 48
    text = pf.first_text + "".join(e.text for e in events)
    # the pull notified the prefill instance, which frees the blocks and the id
    deadline = time.monotonic() + 30
    while (r := prefill_it()).status_code == 409 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.status_code == 200, r.text
    pf = wire.prefill_result_decoder.decode(r.content)
    events = decode_it(pf)  # the same id again, end to end
    assert pf.first_text + "".join(e.text for e in events) == text
    for instance in (prefill, decode):
        assert httpx.get(f"{instance}/health", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def fault_setup():
    """A prefill instance to kill and two decode instances, one per failure policy,
    with a short transfer timeout (all tp 1 but `fail`, tp 3: its tp workers are
    killed last). The prefill instance dies in the first test that kills it; the tests
    after it meet it dead."""
    dep = Deployment()
    try:
        procs = {
            # a capability is used up to a transfer timeout after it was issued here
            "prefill": dep.start_instance("prefill", small_instance("prefill", 1, claim_s=60)),
            "recompute": dep.start_instance(
                "recompute",
                small_instance(
                    "decode",
                    1,
                    16,
                    "HND",
                    kv_load_failure=KVLoadFailure.RECOMPUTE,
                    transfer_timeout_s=10,
                ),
            ),
            "fail": dep.start_instance(
                "fail",
                small_instance(
                    "decode",
                    3,
                    16,
                    "HND",
                    kv_load_failure=KVLoadFailure.FAIL,
                    transfer_timeout_s=10,
                ),
            ),
        }
        dep.wait_healthy(600, say=None)
        yield procs
    finally:
        dep.stop()


def _kill(child) -> None:
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait(10)


def test_prefill_dies_between_prefill_and_pull(fault_setup):
    """The KV is exposed, then its producer dies before the decode instances read it:
    each pull fails with a reason within the transfer timeout; the recompute instance
    still answers the colocated text, the fail instance reports the failure; blocks are
    freed either way."""
    procs = fault_setup
    prefill, prompt = procs["prefill"], PROMPTS[1]
    want = colocated(procs["recompute"].url, prompt, 6)
    results = {}
    for policy in ("recompute", "fail"):
        gen = GenerateRequest(
            request_id=f"r-kill-{policy}",
            prompt=prompt,
            sampling=SamplingParams(max_tokens=6, temperature=0.0),
            kv_reader=instance_id(procs[policy].url),
        )
        r = httpx.post(
            f"{prefill.url}/internal/prefill",
            content=msgspec.json.encode(gen),
            timeout=120,
            auth=AUTH,
        )
        pf = wire.prefill_result_decoder.decode(r.content)
        assert pf.kv is not None and pf.kv.capability
        results[policy] = (gen, pf)
    _kill(prefill)

    def pull(policy: str) -> tuple[float, list]:
        gen, pf = results[policy]
        t0 = time.monotonic()
        with httpx.stream(
            "POST",
            f"{procs[policy].url}/internal/generate",
            content=msgspec.json.encode(wire.DecodeRequest(gen, pf)),
            timeout=120,
            auth=AUTH,
        ) as resp:
            events = [wire.event_decoder.decode(line) for line in resp.iter_lines() if line]
        return time.monotonic() - t0, events

    # both decode instances wait on the dead producer at once (each up to its timeout)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outcomes = dict(zip(results, pool.map(pull, results), strict=True))
    for policy, (took_s, events) in outcomes.items():
        decode, pf = procs[policy], results[policy][1]
        assert took_s < 30  # bounded by the 10 s transfer timeout
        if policy == "recompute":
            assert pf.first_text + "".join(e.text for e in events) == want
            assert events[-1].stages.kv_load_failed is True
        else:
            assert events[-1].error and "KV cache load failed" in events[-1].error
        deadline = time.monotonic() + 10
        while (
            metric_value(httpx.get(f"{decode.url}/metrics").text, "blocks_in_use")
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        assert metric_value(httpx.get(f"{decode.url}/metrics").text, "blocks_in_use") == 0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_instance_killed(fault_setup, policy):
    """The prefill instance is gone when a request comes: recompute still answers
    correctly (the decode instance computes the prompt); fail answers an OpenAI-shaped
    error; neither hangs."""
    procs = fault_setup
    prefill = procs["prefill"]
    proxy = proxy_for([prefill.url], [procs[policy].url], recompute=policy == "recompute")
    try:
        want = colocated(procs[policy].url, PROMPTS[0], 6)
        if prefill.proc.poll() is None:
            assert complete(proxy.url, PROMPTS[0], 6)["choices"][0]["text"] == want
            _kill(prefill)
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
            assert r.status_code == 503
            err = r.json()["error"]
            assert "prefill instance" in err["message"] and err["type"] == "server_error"
    finally:
        proxy.stop()


def test_tp_worker_dies(fault_setup):
    """A tp worker of a decode instance (tp 3) is killed while a request streams: the
    stream ends at once with the cause, later requests are refused with it (503),
    /health answers 503 with it, and a proxy sends requests to the other decode
    instance, or answers an OpenAI-shaped 503 naming the cause when it has no other."""
    dead, other = fault_setup["fail"], fault_setup["recompute"]
    workers = _tp_workers(dead.proc.pid)
    assert len(workers) == 3, workers
    gen = GenerateRequest(
        "r-worker-dies", SamplingParams(max_tokens=400, temperature=0.0), prompt=PROMPTS[2]
    )
    body = msgspec.json.encode(wire.DecodeRequest(gen))
    with httpx.stream(
        "POST", f"{dead.url}/internal/generate", content=body, timeout=60, auth=AUTH
    ) as r:
        lines = r.iter_lines()
        next(line for line in lines if line)  # decoding runs
        os.kill(workers[1], signal.SIGKILL)
        events = [wire.event_decoder.decode(line) for line in lines if line]
    cause = events[-1].error
    assert cause and cause.startswith("engine failed:") and "worker" in cause, events[-1]
    assert len(events) < 300  # it ended at the death, not at max_tokens
    health = httpx.get(f"{dead.url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["reason"] == cause
    r = httpx.post(f"{dead.url}/internal/generate", content=body, timeout=10, auth=AUTH)
    assert r.status_code == 503 and r.json()["error"]["message"] == cause
    request = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    proxy = proxy_for([], [dead.url, other.url])
    try:
        for _ in range(2):
            r = httpx.post(f"{proxy.url}/v1/completions", json=request, timeout=120)
            assert r.status_code == 200, r.text
    finally:
        proxy.stop()
    proxy = proxy_for([], [dead.url])
    try:
        r = httpx.post(f"{proxy.url}/v1/completions", json=request, timeout=120)
        assert r.status_code == 503 and cause in r.json()["error"]["message"], r.text
    finally:
        proxy.stop()


def _tp_workers(pid: int) -> list[int]:
    """The tp worker processes of an instance: the children of its fork server
    (multiprocessing's, a child of the instance)."""
    import subprocess

    def children(parent: int, pattern: str) -> list[int]:
        cmd = ["pgrep", "-P", str(parent), "-f", pattern]
        return [int(p) for p in subprocess.run(cmd, capture_output=True, text=True).stdout.split()]

    pattern = "multiprocessing.forkserver"
    return sorted(w for server in children(pid, pattern) for w in children(server, pattern))


def test_sigterm_to_serve_stops_its_instances(tmp_path):
    """`kvbridge serve` killed with SIGTERM (as by systemd, docker or `timeout`) stops
    the instance processes it started; they live in their own process groups, so nothing
    else would. (Before: both run in serve's session, each instance's compute thread at
    its role's nice value, the decode's above the prefill's, and the threads their KV
    connectors made at the priority they were started with, so on these shared cores
    transfers come first, then prefills, then decodes.)"""
    import subprocess
    import sys

    from kvbridge.transfer.netdev import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "kvbridge.cli.main", "serve", "--prefill-tp", "1"]
    cmd += ["--decode-tp", "1", "--kv-cache-mb", "32", "--port", str(port)]
    serve = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert serve.poll() is None, serve.stderr.read() if serve.stderr else ""
            time.sleep(0.5)
        children = [
            int(pid)
            for pid in subprocess.run(
                ["pgrep", "-P", str(serve.pid), "-f", "kvbridge.serve.instance_main"],
                capture_output=True,
                text=True,
            ).stdout.split()
        ]
        assert children, "no instance processes found"
        roles = {pid: _cmdline(pid).rsplit("/", 1)[-1].split("-")[0] for pid in children}
        assert sorted(roles.values()) == ["decode", "prefill"], roles
        for pid, role in roles.items():
            assert os.getsid(pid) == os.getsid(serve.pid) and os.getpgid(pid) == pid
            # tp 1: the main thread computes; NIXL's, UCX's and the progress thread do not
            nices = {tid: _nice(tid) for tid in _threads(pid)}
            # (nice values as increments over the one serve was started with: this test's)
            base = os.getpriority(os.PRIO_PROCESS, 0)
            want = min(base + COMPUTE_NICE[role], 19)
            assert nices[pid] == want and base in nices.values(), (role, base, nices)
            zmq = [t for t in nices if _comm(pid, t).startswith("ZMQbg")]  # its I/O, reaper
            assert zmq and all(nices[t] == base for t in zmq), (role, base, nices)
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)
        alive = [pid for pid in children if _alive(pid)]
        assert alive == [], f"instances still running after SIGTERM: {alive}"
    finally:  # a check that failed before the SIGTERM: serve still stops its instances
        if serve.poll() is None:
            serve.terminate()
            try:
                serve.wait(60)
            except subprocess.TimeoutExpired:
                serve.kill()


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def _nice(tid: int) -> int:
    """A thread's nice value (/proc/TID/stat, the 19th field)."""
    return int(Path(f"/proc/{tid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def _comm(pid: int, tid: int) -> str:
    return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()


def _threads(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_a_terminal_hangup_stops_a_deployments_instances(sig: int) -> None:
    """What `kvbridge serve` does around its proxy, with a stand-in instance (a process
    group of its own, which a terminal's SIGHUP does not reach): either signal ends
    the process through its `finally`, which stops the instance."""
    import subprocess
    import sys

    code = (
        "import signal, subprocess, time\n"
        "from pathlib import Path\n"
        "from kvbridge.serve.launcher import Child, Deployment\n"
        # as started from a terminal (the suite itself may run under nohup, and an ignored
        # signal stays ignored: Deployment installs its handler over the default only)
        f"signal.signal({int(sig)}, signal.SIG_DFL)\n"
        "dep = Deployment()\n"
        "proc = subprocess.Popen(['sleep', '300'], process_group=0)\n"
        "dep.children.append(Child('stand-in', '127.0.0.1', Path('unused'), proc))\n"
        "try:\n"  # (the pid is printed inside: a signal before `try` would skip `finally`)
        "    print(proc.pid, flush=True)\n"
        "    time.sleep(300)\n"
        "finally:\n"
        "    dep.stop()\n"
    )
    serve = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert serve.stdout is not None
        child = int(serve.stdout.readline())
        serve.send_signal(sig)
        assert serve.wait(60) == 128 + sig
        assert not _alive(child), "the stand-in instance outlived the signal"
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(10)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
