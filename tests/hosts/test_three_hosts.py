"""kvbridge serve across three test hosts (prefill, decode, proxy), as a user deploys it
with `kvbridge serve --role ...`: the KV crosses a real link over TCP, and the link is
slowed, cut and healed under it. One deployment serves the whole module, in order: the
first tests start it in each start order and leave it serving the others; a later test
kills the prefill host, and the restart orders start each instance again as the
paused-readers test needs it (the last tests go on with that).

The first pull in every start order (`kvbridge bench first-pull` times them): the proxy
started before the instances, after them, and each instance restarted under a serving
proxy. Started with the instances, the proxy meets each instance either as that instance
comes up (as proxy-first) or as the proxy does (as instances-first): the benchmark times
that order too; it is not started once more here. A request sent as soon as the proxy
answers /health 200 finds its prefill instance met by every decode worker and every path
to a prefill worker warmed by a READ already, as a later request does. Shown by what
each pull reports (`kv_handshakes`: decode workers that waited for a handshake;
`kv_cold_peers`: paths to a prefill worker its READs were the first over, which the
decode worker counts when it posts them, so 0 says a warm-up READ over each path
completed before) and by the bytes that crossed the prefill host's cable; never by how
long anything took."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from kvbridge.bench.first_pull import ORDERS, run_order
from kvbridge.harness.hosts import HostNetwork
from kvbridge.serve.backend import GenerateRequest, SamplingParams
from kvbridge.serve.wire import DecodeRequest
from kvbridge.transfer.identity import bound_fingerprint
from tests.conftest import smollm2_gguf
from tests.hosts.helpers import LONG_PROMPT, MAX_QUEUED, VERIFY, ThreeHosts
from tests.plant_kv import check_refused
from tests.serve.helpers import AUTH, TOKEN_FILE, complete

pytestmark = pytest.mark.slow

#: The instances' liveness timeout (the InstanceConfig default the tests start with).
LIVENESS_S = 5.0
#: The header of a TLS 1.2/1.3 record of application data.
TLS_APPLICATION_DATA = b"\x17\x03\x03"


#: The orders that start the whole deployment (in "with", the proxy meets each instance as
#: in one of these two), and those that restart one instance under the others (after the
#: kill test, as the paused-readers test needs them).
STARTS = ("proxy-first", "instances-first")
RESTARTS = tuple(order for order in ORDERS if order.endswith("-restart"))
#: What each instance starts with for the paused-readers test (and the tests after it):
#: the prefill with a lease shorter than the pause, the decode with a liveness bound
#: longer than it, so the pause reads as what it is, not as a dead prefill; the decode
#: at tp 9 (three workers read over the link, six copy from them: the fan-out).
PAUSABLE: dict[str, dict[str, float]] = {
    "prefill": {"lease_s": 4, "claim_s": 3},
    "decode": {"tp": 9, "liveness_timeout_s": 120},
}


@pytest.mark.parametrize("order", STARTS)
def test_the_first_pull_finds_warm_paths(hosts: ThreeHosts, order: str) -> None:
    """Each order starts the module's deployment afresh; the last leaves it serving as
    the `three_hosts` fixture starts it (the tests below go on with it)."""
    _check_first_pulls(hosts, order)


def _check_first_pulls(hosts: ThreeHosts, order: str) -> None:
    sent = hosts.prefill.bytes_sent()
    series = run_order(hosts, order, requests=3)
    crossed = hosts.prefill.bytes_sent() - sent
    for i, stages in enumerate(series.stages):
        assert stages["kv_bytes"] > 0 and not stages.get("kv_load_failed"), (i, stages)
        # the decode host's 3 workers each read over a path met and warmed before
        assert stages["kv_handshakes"] == 0, (order, i, stages)
        assert stages["kv_cold_peers"] == 0, (order, i, stages)
    # the KV crossed the prefill host's cable (the handshakes and warm-up READs too)
    assert crossed > sum(s["kv_bytes"] for s in series.stages)


def test_three_hosts_answer_as_one_host(three_hosts: ThreeHosts) -> None:
    dep = three_hosts
    prompt = "The capital of France is"
    sent = dep.prefill.bytes_sent()
    got = dep.complete(prompt, 10)
    assert got["choices"][0]["text"] == dep.colocated(prompt, 10)
    kv_bytes = got["kvbridge_stages"]["kv_bytes"]
    assert kv_bytes > 0 and "kvbridge_kv_load_error" not in got
    assert dep.prefill.bytes_sent() - sent > kv_bytes  # the KV crossed the prefill link


def test_a_sniffer_on_the_links_sees_no_prompt(
    three_hosts: ThreeHosts, network: HostNetwork
) -> None:
    """The proxy's calls to instances on other hosts carry prompts and completions over
    TLS (issue #21): captured on the prefill and decode hosts' cables during a request,
    the secret in its prompt is nowhere, while the same capture on a client's cable sees
    it in that client's plain-HTTP request to the proxy (the capture can see a prompt)."""
    dep = three_hosts
    secret = "The vault code is Zanzibar-7319."
    client = network.add("client")
    with dep.prefill.capture() as to_prefill, dep.decode.capture() as to_decode:
        got = dep.complete(f"{secret} Repeat it:", 4)
    with client.capture() as to_client, client.inside():
        complete(dep.url(dep.proxy), f"{secret} Now once more:", 1)
    kv_bytes = got["kvbridge_stages"]["kv_bytes"]
    assert kv_bytes > 0 and "kvbridge_kv_load_error" not in got
    assert secret.encode() in to_client
    assert len(to_prefill.data) > kv_bytes  # the KV crossed the captured cable
    for seen in (to_prefill, to_decode):
        assert seen.dropped == 0  # every frame was looked at
        assert secret.encode() not in seen and b"Zanzibar" not in seen
        assert TLS_APPLICATION_DATA in seen


def test_bad_callers_are_refused_while_good_ones_are_served(three_hosts: ThreeHosts) -> None:
    dep = three_hosts
    prompt = "A short poem about the sea:"
    want = dep.colocated(prompt)
    gen = GenerateRequest("kvbh-unsigned", SamplingParams(max_tokens=4), prompt=prompt)
    huge = b'{"prompt": "' + b"x" * (17 << 20) + b'"}'  # over the 16 MiB default
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        good = pool.submit(dep.stream, prompt)
        with dep.proxy.inside():
            for url, body in (
                (f"{dep.url(dep.prefill)}/internal/prefill", msgspec.json.encode(gen)),
                (
                    f"{dep.url(dep.decode)}/internal/generate",
                    msgspec.json.encode(DecodeRequest(gen, None)),
                ),
            ):
                r = httpx.post(url, content=body, timeout=30, verify=VERIFY)
                assert r.status_code == 401, r.text
                assert r.json()["error"]["code"] == "unauthenticated"
            # over the limit: 413 from the proxy; an instance refuses an unsigned body
            # from its headers before the limit is even looked at (issue #21)
            for url, status in (
                (f"{dep.url(dep.proxy)}/v1/completions", 413),
                (f"{dep.url(dep.decode)}/internal/generate", 401),
            ):
                r = httpx.post(url, content=huge, timeout=60, verify=VERIFY)
                assert r.status_code == status, r.text
        assert good.result(timeout=300) == want


def test_a_token_holder_cannot_claim_the_decode_instances_id(three_hosts: ThreeHosts) -> None:
    """From the proxy host, a token holder sends the prefill instance's side channel a
    Hello in the decode instance's name: refused, since that id names the decode's own
    key (issue #21 item 3); the same Hello under another id gets as far as the model
    check (the control: only the binding refused the first)."""
    dep = three_hosts
    with dep.proxy.inside():
        ids = {}
        for host in (dep.prefill, dep.decode):
            r = httpx.get(f"{dep.url(host)}/internal/info", auth=AUTH, timeout=30, verify=VERIFY)
            assert r.status_code == 200, r.text
            ids[host.name] = r.json()
        decode_id, endpoint = ids["decode"]["instance_id"], ids["prefill"]["endpoint"]
        assert bound_fingerprint(decode_id) is not None, decode_id
    # from a process of its own in the proxy host (ZMQ connects from its I/O thread's
    # namespace, which is this process's first one)
    argv = ["-m", "tests.hosts.claim_hello", endpoint, TOKEN_FILE, decode_id, "mallory"]
    out = dep.proxy.run([sys.executable, *argv], timeout_s=120)
    replies = [json.loads(line) for line in out.splitlines()]
    assert replies[0]["kind"] == "auth" and decode_id in replies[0]["reason"], replies
    assert replies[1]["kind"] == "incompatible", replies  # the control: only the binding
    assert dep.complete("Still served:", 4)["choices"][0]["text"]


def test_the_decode_hosts_files_cannot_plant_a_victims_kv(three_hosts: ThreeHosts) -> None:
    """The prefix-cache poisoning attack (tests/plant_kv.py) made on the decode host
    with only the files that host was given (the token, its credential): each forged
    capability refused, nothing pulled or cached under the attacker's ids."""
    dep = three_hosts
    argv = ["-m", "tests.plant_kv", dep.url(dep.prefill), dep.url(dep.decode), TOKEN_FILE]
    out = dep.decode.run([sys.executable, *argv, dep.credentials["decode"]], timeout_s=300)
    check_refused(json.loads(out.splitlines()[-1]))


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


def _instance_process(host) -> int:
    """The pid (as the test sees it) of the instance process on `host`."""
    for pid in host.pids():
        argv = _cmdline(pid).split(b"\0")
        if b"python" in argv[0] and b"kvbridge.serve.instance_main" in argv:
            return pid
    raise AssertionError(f"no instance process on host {host.name}")


def test_a_token_holder_reads_nothing_of_the_prefill_process_and_cannot_stop_it(
    three_hosts: ThreeHosts,
) -> None:
    """Issue #21 item 4 over the test hosts' network (UCX over TCP): from the proxy host,
    a token holder widens the region bounds in its copy of the prefill worker's NIXL
    metadata and READs the prefill process's libc code at its address there. Before the
    KV export it got those bytes (and a READ of an unmapped address killed the instance);
    now its peer is the export process, which has no such mapping at that address: it
    gets other bytes or none (the export process crashes on it and is replaced), and the
    instance serves on, token-exact."""
    dep = three_hosts
    prompt = "Name a river in Europe."
    want_text = dep.colocated(prompt, 4)
    with dep.proxy.inside():
        r = httpx.get(f"{dep.url(dep.prefill)}/internal/info", auth=AUTH, timeout=30, verify=VERIFY)
        assert r.status_code == 200, r.text
        endpoint = r.json()["endpoint"]
    worker = _instance_process(dep.prefill)
    maps = Path(f"/proc/{worker}/maps").read_text().splitlines()
    libc = next(ln for ln in maps if "libc.so" in ln and ln.split()[1] == "r-xp")
    address = int(libc.split("-")[0], 16)
    with open(f"/proc/{worker}/mem", "rb") as mem:  # what the attacker is after
        mem.seek(address)
        secret = mem.read(64)
    argv = ["-m", "tests.hosts.read_peer", endpoint, TOKEN_FILE, str(smollm2_gguf())]
    out = json.loads(dep.proxy.run([sys.executable, *argv, hex(address), "64"], timeout_s=120))
    assert bytes.fromhex(out["data"]) != secret, f"read the prefill process ({out['state']})"
    assert _instance_process(dep.prefill) == worker  # the instance lives on
    assert dep.complete(prompt, 4)["choices"][0]["text"] == want_text
    if out["state"] != "DONE":  # the export process died of it: another one serves
        replaced = f'"agent_name":"{out["agent"]}.1"'.encode()
        assert any(replaced in _cmdline(pid) for pid in dep.prefill.pids()), out


def test_64_concurrent_streams_across_hosts_complete_and_leak_nothing(
    three_hosts: ThreeHosts,
) -> None:
    dep = three_hosts
    prompts = [f"Write a sentence about the number {i}." for i in range(4)]
    want = {p: dep.colocated(p) for p in prompts}
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        got = list(pool.map(dep.stream, [prompts[i % 4] for i in range(64)], timeout=900))
    assert got == [want[prompts[i % 4]] for i in range(64)]
    for host in (dep.prefill, dep.decode):
        dep.wait_released(host, 60)


def test_an_overload_burst_is_refused_quickly_and_recovered_from(
    three_hosts: ThreeHosts,
) -> None:
    """Three times what the instances hold, at once: each request completes with the
    right text or is refused with 503 and Retry-After well before a client would give
    up; right after, a request is served and every block comes back."""
    dep = three_hosts
    prompts = [f"Name a colour that starts with the letter {c}." for c in "BGRY"]
    want = {p: dep.colocated(p, 4) for p in prompts}

    def attempt(prompt: str) -> tuple[int, str | None, str, float]:
        started = time.monotonic()
        with dep.proxy.inside():
            r = httpx.post(
                f"{dep.url(dep.proxy)}/v1/completions",
                json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True},
                timeout=300,
            )
        text = "".join(
            json.loads(line[6:])["choices"][0]["text"]
            for line in r.text.splitlines()
            if line.startswith("data: {") and r.status_code == 200
        )
        return r.status_code, r.headers.get("retry-after"), text, time.monotonic() - started

    burst = [prompts[i % 4] for i in range(3 * MAX_QUEUED)]
    with concurrent.futures.ThreadPoolExecutor(len(burst)) as pool:
        answers = list(pool.map(attempt, burst, timeout=900))
    refused = [a for a in answers if a[0] == 503]
    for prompt, (status, retry_after, text, _) in zip(burst, answers, strict=True):
        assert status in (200, 503), status
        assert text == want[prompt] if status == 200 else retry_after is not None
    assert refused and len(refused) < len(burst)
    assert max(a[3] for a in refused) < 60  # refused, not left to time out
    assert dep.stream(prompts[0], 4) == want[prompts[0]]
    for host in (dep.prefill, dep.decode):
        dep.wait_released(host, 60)


def test_a_slow_link_still_moving_bytes_is_not_failed(three_hosts: ThreeHosts) -> None:
    dep = three_hosts
    # ~42 MB of KV at 28 Mbit/s: at least 12 s (tbf lets nothing faster through), past
    # twice the liveness timeout
    dep.prefill.slow("28mbit")
    try:
        got = dep.complete("Slowly. " + LONG_PROMPT, 2)
    finally:
        dep.prefill.unslow()
    assert "kvbridge_kv_load_error" not in got
    stages = got["kvbridge_stages"]
    assert stages["kv_bytes"] > 0
    assert stages["transfer_ms"] > 2 * LIVENESS_S * 1000  # what makes this test mean it


def test_a_link_cut_mid_pull_fails_fast_and_heals(three_hosts: ThreeHosts) -> None:
    """Cut the prefill host's link while its KV is being pulled: the pull fails within
    the liveness bound, not at the transfer timeout (60 s here), the decode host
    recomputes the prompt and answers right, and its blocks are freed; another request
    served while the link is down (in other blocks: the cut pull's stay out of the free
    pool until NIXL released its READs) answers right too. After the link
    returns, pulls work again, and the prefill's stranded blocks are freed once the
    decode workers met it again and told it they gave up (released as aborted), not at
    its 40 s lease (lease_expired)."""
    dep = three_hosts
    before = {
        cause: dep.metric(dep.prefill, "kv_releases_total", cause=cause)
        for cause in ("aborted", "lease_expired")
    }
    # (each long prompt starts its own way: a decode host holding its blocks already
    # would pull only the rest, or nothing; the reference is computed last for that)
    prompt = "Cut. " + LONG_PROMPT
    dep.prefill.slow("100mbit")  # the pull takes ~4 s
    answer: dict = {}

    def ask() -> None:
        answer["start"] = time.monotonic()
        answer["json"] = dep.complete(prompt, 2)

    asking = threading.Thread(target=ask)
    sent = dep.prefill.bytes_sent()
    asking.start()
    try:
        deadline = time.monotonic() + 300
        while dep.prefill.bytes_sent() - sent < 10e6:  # a quarter of the KV is across
            assert time.monotonic() < deadline and asking.is_alive(), answer
            time.sleep(0.01)
        cut_at = time.monotonic()
        dep.prefill.cut()
        asking.join(300)
        # another request while the cut pull's READs may still land when the link
        # returns: computed on the decode host in blocks other than the cut pull's
        during = dep.colocated("During the cut. " + LONG_PROMPT, 2)
    finally:
        dep.prefill.heal()
    got = answer["json"]
    assert got["choices"][0]["text"] == dep.colocated(prompt, 2)  # recomputed
    assert "lost contact with prefill worker" in got["kvbridge_kv_load_error"]
    stages = got["kvbridge_stages"]
    pull_start = answer["start"] + stages["prefill_ms"] / 1000
    failed_after_cut = pull_start + stages["transfer_ms"] / 1000 - cut_at
    assert failed_after_cut < 20  # the rule says 10 s; the timeout would say 60
    dep.wait_released(dep.decode, 60)
    assert during == dep.colocated("During the cut. " + LONG_PROMPT, 2)  # the same again
    for i in range(2):
        again = dep.complete(f"Healed {i}. {LONG_PROMPT}", 2)
        assert "kvbridge_kv_load_error" not in again and again["kvbridge_stages"]["kv_bytes"]
    dep.wait_released(dep.prefill, 90)  # the cut request's blocks, told after the heal
    after = {cause: dep.metric(dep.prefill, "kv_releases_total", cause=cause) for cause in before}
    assert after == {"aborted": before["aborted"] + 1, "lease_expired": before["lease_expired"]}


def test_a_killed_prefill_host_leaves_decode_and_proxy_answering(
    three_hosts: ThreeHosts,
) -> None:
    dep = three_hosts
    prompt = "The three primary colours are"
    want = dep.colocated(prompt)
    dep.prefill.kill()
    got = dep.complete(prompt)
    assert got["choices"][0]["text"] == want  # the decode host computed the prompt
    with dep.proxy.inside():
        health = httpx.get(f"{dep.url(dep.proxy)}/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    dep.wait_released(dep.decode, 60)


@pytest.mark.parametrize("order", RESTARTS)
def test_the_first_pull_after_an_instance_restart_finds_warm_paths(
    three_hosts: ThreeHosts, order: str
) -> None:
    """After the kill test (the prefill host lies dead: its restart is its start again),
    each instance restarts under the serving others with the `PAUSABLE` settings, which
    the paused-readers test below goes on with (the decode-restart's first pulls fan out
    over its tp 9 workers)."""
    role = order.removesuffix("-restart")
    three_hosts.settings[role] = PAUSABLE[role]
    _check_first_pulls(three_hosts, order)
    assert three_hosts.started_with[role].items() >= PAUSABLE[role].items()


def test_decode_workers_paused_past_the_lease_use_no_stale_byte(three_hosts: ThreeHosts) -> None:
    """Issue #22's fence through `kvbridge serve` across hosts: the decode host's workers
    are paused (SIGSTOP) in the middle of a pull until the prefill's lease freed the
    blocks, and another request is prefilled into the freed cache meanwhile. On resume
    the paused READs finish, but the prefill answers that it no longer held what they
    read: the pull is failed as stale, recomputed, counted on the proxy's /metrics, and
    both answers equal colocated generation. The instances run with the `PAUSABLE`
    settings (the restart orders started them so; run without them, this test restarts
    them so). The decode instance runs at tp 9, so it fans out: the workers that copy
    from a stale reader fail with it and copy nothing."""
    dep = three_hosts
    for role, settings in PAUSABLE.items():
        if not dep.started_with[role].items() >= settings.items():
            dep.settings[role] = settings
            getattr(dep, role).kill()
            dep.start_role(role)
    dep.wait_introduced(900)
    stale_before = dep.metric(dep.proxy, "kv_stale_pulls_total")
    expired_before = dep.metric(dep.prefill, "kv_releases_total", cause="lease_expired")
    first, second = "Paused. " + LONG_PROMPT, "Meanwhile. " + LONG_PROMPT
    answers: dict[str, dict] = {}

    def ask(prompt: str) -> None:
        answers[prompt] = dep.complete(prompt, 2)

    workers = dep.worker_pids(dep.decode)
    assert len(workers) == 9, workers
    asking = [threading.Thread(target=ask, args=(p,)) for p in (first, second)]
    dep.prefill.slow("100mbit")  # the pull takes ~4 s
    sent = dep.prefill.bytes_sent()
    asking[0].start()
    try:
        deadline = time.monotonic() + 300
        while dep.prefill.bytes_sent() - sent < 10e6:  # a quarter of the KV is across
            assert time.monotonic() < deadline and asking[0].is_alive(), answers
            time.sleep(0.01)
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        dep.prefill.unslow()
        deadline = time.monotonic() + 60  # the prefill frees the blocks at its lease
        while dep.metric(dep.prefill, "kv_releases_total", cause="lease_expired") == expired_before:
            assert time.monotonic() < deadline, "the prefill's lease never expired"
            time.sleep(0.2)
        asking[1].start()  # prefilled into the freed cache while the readers sleep
        while not dep.metric(dep.prefill, "kv_pinned_blocks"):
            assert time.monotonic() < deadline and asking[1].is_alive(), answers
            time.sleep(0.05)
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
        dep.prefill.unslow()
    for t in asking:
        t.join(300)
    got = answers[first]
    assert got["choices"][0]["text"] == dep.colocated(first, 2)  # recomputed
    assert "no longer held" in got["kvbridge_kv_load_error"], got
    assert got["kvbridge_stages"]["kv_load_failed"]
    again = answers[second]
    assert again["choices"][0]["text"] == dep.colocated(second, 2)
    stale = sum("no longer held" in a.get("kvbridge_kv_load_error", "") for a in answers.values())
    assert dep.metric(dep.proxy, "kv_stale_pulls_total") == stale_before + stale
    dep.wait_released(dep.decode, 60)
    dep.wait_released(dep.prefill, 60)


def test_a_decode_instance_at_tp_9_takes_each_kv_byte_over_the_link_once(
    three_hosts: ThreeHosts,
) -> None:
    """Issue #22 item 2 through `kvbridge serve` across hosts: the decode instance runs
    at tp 9 since the decode-restart order, holding each of SmolLM2's 3 KV heads on three
    workers. With the prefill on another host it fans out (`--kv-fan-out auto`): one of a
    head's holders reads it from the prefill host, the other two copy it from that
    worker's cache on the decode host. The prefill host's cable carries the distinct KV
    once (three times before), the answer equals colocated generation, and the proxy
    counts both hops."""
    dep = three_hosts
    assert len(dep.worker_pids(dep.decode)) == 9
    prompt = "Fanned out. " + LONG_PROMPT
    local_before = dep.metric(dep.proxy, "kv_local_bytes_total")
    sent = dep.prefill.bytes_sent()
    got = dep.complete(prompt, 4)
    crossed = dep.prefill.bytes_sent() - sent
    assert got["choices"][0]["text"] == dep.colocated(prompt, 4)
    stages = got["kvbridge_stages"]
    # tokens x layers x K,V x head_dim x fp32 x 3 KV heads
    distinct = got["usage"]["prompt_tokens"] * 30 * 2 * 64 * 4 * 3
    assert "kvbridge_kv_load_error" not in got
    assert stages["kv_bytes"] == distinct and stages["kv_local_bytes"] == 2 * distinct
    assert distinct < crossed < 1.5 * distinct, (crossed, distinct)  # once, not 3 times
    assert dep.metric(dep.proxy, "kv_local_bytes_total") == local_before + 2 * distinct


def test_a_hello_flood_from_one_host_leaves_other_hosts_welcome(three_hosts: ThreeHosts) -> None:
    """Issue #21 item 3 over the test hosts' network: a token holder on the proxy host
    sends the prefill worker 1,100 valid Hellos, each in a fresh instance's name (young
    sessions, none of which may be evicted for `grace_s`). They filled its table of 1,024
    and a decode instance meeting it from another host was refused "busy"; now the
    proxy host's address gets a quarter of the shared pool (half the table), a newcomer
    from the decode host is welcome, and the deployment serves on. (Last in the module: the flood's sessions
    stay young for the rest of its grace.)"""
    dep = three_hosts
    with dep.proxy.inside():
        r = httpx.get(f"{dep.url(dep.prefill)}/internal/info", auth=AUTH, timeout=30, verify=VERIFY)
        assert r.status_code == 200, r.text
        endpoint = r.json()["endpoint"]
    tool = [sys.executable, "-m", "tests.hosts.flood_hello", endpoint, TOKEN_FILE]
    tool.append(str(smollm2_gguf()))
    flood = json.loads(dep.proxy.run([*tool, "flood", "1100"], timeout_s=300))
    newcomer = json.loads(dep.decode.run([*tool, "newcomer", "1"], timeout_s=120))
    assert newcomer.get("welcome") == 1, (newcomer, flood)
    assert flood.get("welcome", 0) <= 256 and flood.get("busy", 0) >= 1100 - 256, flood
    assert f"come from {dep.proxy.address} already" in flood["reason"], flood
    assert dep.complete("Still served:", 4)["choices"][0]["text"]
