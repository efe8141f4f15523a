"""The serving plane lets no one in (issues #13 and #14), with the test instances' shared
token: internal calls must be signed, a decode instance pulls only with a capability
issued to it, replayed handshakes are counted in /metrics, every listener is on
loopback, and a deployment refuses an unauthenticated address other hosts can reach."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from kvbridge.cli.main import main
from kvbridge.connector import ConnectorRole, RemotePrefill, RootKey
from kvbridge.serve import wire
from kvbridge.serve.backend import GenerateRequest, SamplingParams
from kvbridge.serve.http_auth import SIGNATURE_HEADER, TIME_HEADER, SignedRequests
from kvbridge.serve.metrics import metric_value
from kvbridge.transfer.capability import Capability, issue, prompt_digest
from kvbridge.transfer.messages import Hello, LayoutWire, ModelWire, Refused, Welcome
from kvbridge.transfer.side_channel import SideChannelClient
from tests.credentials import enrolled
from tests.listening import is_loopback, listening
from tests.plant_kv import check_refused, plant
from tests.serve.helpers import AUTH, TOKEN, credential_of, instance_id

pytestmark = pytest.mark.slow


def _gen(rid: str, reader: str | None = None) -> GenerateRequest:
    return GenerateRequest(
        rid,
        SamplingParams(max_tokens=4, temperature=0.0),
        prompt="The secret code is 4812. The code is",
        kv_reader=reader,
    )


def _prefill(url: str, gen: GenerateRequest) -> wire.PrefillResult:
    r = httpx.post(
        f"{url}/internal/prefill", content=msgspec.json.encode(gen), auth=AUTH, timeout=120
    )
    assert r.status_code == 200, r.text
    return wire.prefill_result_decoder.decode(r.content)


def _generate(url: str, gen: GenerateRequest, pf: wire.PrefillResult | None) -> httpx.Response:
    body = msgspec.json.encode(wire.DecodeRequest(gen, pf))
    return httpx.post(f"{url}/internal/generate", content=body, auth=AUTH, timeout=120)


def test_internal_calls_need_a_signature_with_the_shared_token(instances) -> None:
    url = instances[("prefill", 1)]
    body = msgspec.json.encode(_gen("r-unsigned"))
    r = httpx.post(f"{url}/internal/prefill", content=body, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"
    wrong = SignedRequests(b"some-other-deployment-token")
    r = httpx.post(f"{url}/internal/prefill", content=body, auth=wrong, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "bad_signature"
    stale = {TIME_HEADER: str(time.time() - 600), SIGNATURE_HEADER: "00" * 32}
    r = httpx.post(f"{url}/internal/prefill", content=body, headers=stale, timeout=30)
    assert r.status_code == 403 and "stale" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/internal/info", timeout=30).status_code == 401
    for open_path in ("/health", "/metrics"):
        assert httpx.get(f"{url}{open_path}", timeout=30).status_code == 200


ENDPOINT = "tcp://127.0.0.1:1"
P = enrolled(ConnectorRole.PRODUCER, "p")  # a prefill instance of the tests' deployment
OWN = enrolled(ConnectorRole.PRODUCER, "p", RootKey.generate())  # of another root


def test_a_decode_instance_pulls_only_with_a_capability_issued_to_it(instances) -> None:
    """The attack of issue #14: /internal/generate given another request's blocks
    continued that request's prompt. Now the decode instance takes the blocks from the
    prefill instance's signed capability, issued to it, for this request only."""
    prefill, decode = instances[("prefill", 1)], instances[("decode", 1)]
    me = instance_id(decode)
    victim = _prefill(prefill, _gen("r-victim", me))
    assert victim.kv is not None
    attacker = _gen("r-attacker", me)
    ids = victim.prompt_token_ids

    def result(kv: RemotePrefill) -> wire.PrefillResult:
        return wire.PrefillResult("r-attacker", ids, victim.first_token_id, "", None, kv, 1.0)

    forged = [
        # another request's capability, replayed for the attacker's request
        (victim.kv, "covers request 'r-victim'"),
        # a capability signed by a prefill key of a root of its own
        (
            RemotePrefill(
                victim.first_token_id,
                issue(Capability("r-attacker", "p", ENDPOINT, [0], len(ids), me, 1e12), OWN),
                victim.kv.instance_id,
            ),
            "not by this deployment's root",
        ),
        # signed by an enrolled prefill key but issued to another decode instance
        (
            RemotePrefill(
                victim.first_token_id,
                issue(Capability("r-attacker", "p", ENDPOINT, [0], len(ids), "x", 1e12), P),
                victim.kv.instance_id,
            ),
            "issued to decode instance 'x'",
        ),
    ]
    for kv, words in forged:
        r = _generate(decode, attacker, result(kv))
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["code"] == "capability_refused" and words in err["message"]
    # a genuine capability for this very request and prompt, taken after it expired:
    # nothing is pulled, the decode instance computes the prompt (its load failed)
    late = Capability("r-late", "p", ENDPOINT, [0], len(ids), me, 1.0, 0, 16, prompt_digest(ids))
    late_kv = RemotePrefill(victim.first_token_id, issue(late, P), victim.kv.instance_id)
    r = _generate(
        decode,
        _gen("r-late", me),
        wire.PrefillResult("r-late", ids, victim.first_token_id, "", None, late_kv, 1.0),
    )
    assert r.status_code == 200, r.text
    last = [wire.event_decoder.decode(line) for line in r.text.splitlines() if line][-1]
    assert last.finish_reason and not last.error, last
    assert last.stages.kv_load_failed and last.stages.kv_bytes is None
    assert last.kv_load_error is not None and "expired" in last.kv_load_error
    # the real reader with the real capability is served, and nothing stayed pinned
    r = _generate(decode, _gen("r-victim", me), victim)
    assert r.status_code == 200
    events = [wire.event_decoder.decode(line) for line in r.text.splitlines() if line]
    assert events[-1].finish_reason and not events[-1].error
    stages = events[-1].stages
    assert stages.kv_bytes is not None and stages.kv_bytes > 0 and stages.kv_load_failed is None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = httpx.get(f"{prefill}/metrics", timeout=30).text
        if metric_value(text, "kv_pinned_blocks") == 0:
            break
        time.sleep(0.2)
    assert metric_value(text, "kv_pinned_blocks") == 0


def test_a_decode_hosts_files_cannot_plant_a_victims_kv_under_other_ids(instances) -> None:
    """The prefix-cache poisoning attack (tests/plant_kv.py): a party holding everything
    a decode host holds (the shared token, the host's own credential) asks the prefill
    instance for a victim's prompt and re-signs the capability for token ids of its own,
    so that the decode instance would keep the victim's KV under those ids. Refused
    (403), nothing pulled, nothing cached under those ids; the victim is served."""
    prefill, decode = instances[("prefill", 1)], instances[("decode", 3)]
    check_refused(plant(prefill, decode, TOKEN, credential_of(instance_id(decode))))


def test_a_replayed_handshake_is_refused_and_counted_in_metrics(instances) -> None:
    prefill = instances[("prefill", 1)]
    info = httpx.get(f"{prefill}/internal/info", auth=AUTH, timeout=30).json()
    from kvbridge.plan.geometry import load_model_spec
    from kvbridge.plan.layout import InstanceLayout

    hello = Hello(
        instance_id="someone",
        rank=0,
        model=ModelWire.of(load_model_spec("smollm2-135m", dtype="float32")),
        layout=LayoutWire.of(InstanceLayout(tp_size=1)),
        nonce=os.urandom(16),
    )
    before = metric_value(httpx.get(f"{prefill}/metrics", timeout=30).text, "kv_replays_refused")
    replies = []
    for _ in range(2):  # the same bytes twice, as someone who captured them would
        client = SideChannelClient(info["endpoint"], TOKEN, 1 << 22)
        try:
            replies.append(client.call(hello, timeout_s=20))
        finally:
            client.close()
    assert isinstance(replies[0], Welcome)
    assert isinstance(replies[1], Refused) and replies[1].kind == "replay"
    after = metric_value(httpx.get(f"{prefill}/metrics", timeout=30).text, "kv_replays_refused")
    assert after == before + 1


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").iterdir():
            children = (task / "children").read_text().split()
            todo += [int(c) for c in children]
    return out


def test_a_default_deployment_listens_on_loopback_only(instances) -> None:
    pids = []
    for url in instances.values():
        info = httpx.get(f"{url}/internal/info", auth=AUTH, timeout=30).json()
        pids += _descendants(int(info["pid"]))
    found = [(pid, addr) for pid in pids for addr in listening(pid)]
    assert len({pid for pid, _ in found}) >= len(instances)  # every instance listens
    assert all(is_loopback(addr) for _, (addr, _) in found), found


def test_an_address_other_hosts_reach_needs_a_token_or_insecure(monkeypatch, capsys) -> None:
    monkeypatch.delenv("KVBRIDGE_TRANSFER_TOKEN", raising=False)
    monkeypatch.delenv("KVBRIDGE_TRANSFER_TOKEN_FILE", raising=False)
    for args, words in (
        (["serve", "--role", "decode", "--tp", "1", "--host", "0.0.0.0"], "--kv-token-file"),
        (["serve", "--role", "proxy", "--decode", "http://x", "--host", "0.0.0.0"], "--insecure"),
        (
            ["serve", "--role", "prefill", "--tp", "1", "--kv-host", "0.0.0.0", "--insecure"],
            "--kv-advertise-host",
        ),
    ):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err


def test_a_request_no_decode_instance_takes_is_released_at_once(instances) -> None:
    """The decode instance the capability was issued to refuses the request (here: it
    answers 503): the proxy tells the prefill instance, which frees the blocks within a
    second instead of at its 120 s lease; the request is still answered by another."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from kvbridge.serve.http_server import ServerThread
    from tests.serve.helpers import complete, proxy_for

    stub = FastAPI()

    @stub.get("/internal/info")
    async def info() -> dict:
        return {"instance_id": "refuser", "role": "decode"}

    @stub.post("/internal/generate")
    async def generate() -> JSONResponse:
        return JSONResponse({"error": {"message": "out of memory", "type": "server_error"}}, 503)

    refuser = ServerThread(stub).start()
    prefill, decode = instances[("prefill", 1)], instances[("decode", 1)]
    proxy = proxy_for([prefill], [refuser.url, decode])
    try:
        out = complete(proxy.url, "Once upon a time", 4)
        assert out["choices"][0]["text"]  # the second decode instance computed it
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5:
            if (
                metric_value(httpx.get(f"{prefill}/metrics", timeout=30).text, "kv_pinned_blocks")
                == 0
            ):
                break
            time.sleep(0.1)
        assert (
            metric_value(httpx.get(f"{prefill}/metrics", timeout=30).text, "kv_pinned_blocks") == 0
        )
    finally:
        proxy.stop()
        refuser.stop()
