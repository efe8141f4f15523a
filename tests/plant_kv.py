"""The prefix-cache poisoning attack, as a party holding only a decode host's files
makes it (the shared token and that host's credential): ask the prefill instance for a
victim's prompt, re-sign the capability for token ids of its own, and hand it to the
decode instance, hoping it keeps the victim's KV under those ids.

    python -m tests.plant_kv PREFILL_URL DECODE_URL TOKEN_FILE CREDENTIAL_FILE

prints one JSON object (`plant`'s); tests/serve runs `plant` in-process, tests/hosts
runs this on the decode test host. Imports nothing of the serving tests' fixtures
(tests.serve.helpers writes a token of its own at import; a process on a test host must
use only the files that host was given)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import msgspec

from kvbridge.connector import Credential, RemotePrefill
from kvbridge.serve import wire
from kvbridge.serve.backend import GenerateRequest, SamplingParams
from kvbridge.serve.http_auth import SignedRequests
from kvbridge.serve.metrics import metric_value
from kvbridge.serve.tls import client_context
from kvbridge.transfer.capability import issue, prompt_digest
from tests.credentials import opened, resigned

VICTIM = "The secret code is 4812. I repeat, the secret code is"
SAMPLING = SamplingParams(max_tokens=4, temperature=0.0)


class Client:
    def __init__(self, token: bytes) -> None:
        self.auth, self.verify = SignedRequests(token), client_context(token)

    def post(self, url: str, body: Any) -> httpx.Response:
        data = msgspec.json.encode(body)
        return httpx.post(url, content=data, auth=self.auth, verify=self.verify, timeout=120)

    def kv_bytes(self, url: str) -> float:
        text = httpx.get(f"{url}/metrics", verify=self.verify, timeout=30).text
        return metric_value(text, "kv_instance_bytes_total")

    def generate(self, url: str, gen: GenerateRequest, pf: wire.PrefillResult | None) -> Any:
        """(status, the error object or the last event)."""
        r = self.post(f"{url}/internal/generate", wire.DecodeRequest(gen, pf))
        if r.status_code != 200:
            return r.status_code, r.json()["error"]
        return 200, wire.event_decoder.decode(r.text.splitlines()[-1])


def plant(prefill: str, decode: str, token: bytes, held: Credential) -> dict[str, Any]:
    """The attack, then its checks: {"refused": [[status, code, message], ...] (one per
    forged capability), "kv_bytes": the decode instance's counter before, after the
    attack and after the victim's pull, "cached": the decode
    instance's prefix-cache hit for the attacker's ids, "victim_kv_bytes": what the
    victim's own request pulled, "victim_cached": its hit for the victim's ids after}."""
    client = Client(token)
    me = httpx.get(
        f"{decode}/internal/info", auth=client.auth, verify=client.verify, timeout=30
    ).json()["instance_id"]
    victim_gen = GenerateRequest("r-planted-victim", SAMPLING, prompt=VICTIM, kv_reader=me)
    r = client.post(f"{prefill}/internal/prefill", victim_gen)
    assert r.status_code == 200, r.text
    victim = wire.prefill_result_decoder.decode(r.content)
    assert victim.kv is not None
    own = [1000 + 7 * i for i in range(len(victim.prompt_token_ids))]  # the attacker's ids
    planted = {"request_id": "r-plant", "prompt_digest": prompt_digest(own)}
    forged = [
        # re-signed with the decode host's key, the prefill's certificate kept
        resigned(victim.kv.capability, held, **planted),
        # signed with the decode host's own credential, as its own producer
        issue(msgspec.structs.replace(opened(victim.kv.capability), producer=me, **planted), held),
    ]
    before = client.kv_bytes(decode)
    attacker = GenerateRequest("r-plant", SAMPLING, prompt_token_ids=own, kv_reader=me)
    refused = []
    for data in forged:
        kv = RemotePrefill(victim.first_token_id, data, victim.kv.instance_id)
        result = wire.PrefillResult("r-plant", own, victim.first_token_id, "", None, kv, 1.0)
        status, err = client.generate(decode, attacker, result)
        refused.append([status, err.get("code"), err.get("message")])
    after = client.kv_bytes(decode)

    def cached(rid: str, ids: list[int]) -> int:
        gen = GenerateRequest(rid, SamplingParams(max_tokens=1), prompt_token_ids=ids)
        status, last = client.generate(decode, gen, None)
        assert status == 200, last
        return int(last.stages.cached_tokens or 0)

    probe = cached("r-plant-probe", own)  # a client who now sends the attacker's ids
    status, last = client.generate(decode, victim_gen, victim)
    assert status == 200, last
    return {
        "refused": refused,
        "kv_bytes": [before, after, client.kv_bytes(decode)],
        "cached": probe,
        "victim_kv_bytes": last.stages.kv_bytes,
        "victim_cached": cached("r-victim-probe", victim.prompt_token_ids),
    }


def check_refused(out: dict[str, Any]) -> None:
    """What the attack must come to: each forgery refused naming why, nothing pulled,
    nothing cached under the attacker's ids; the victim served, its ids cached."""
    words = ["not signed by the key certified for", "enrolled as a decode instance"]
    for (status, code, message), want in zip(out["refused"], words, strict=True):
        assert status == 403 and code == "capability_refused" and want in message, out
    before, after, victim = out["kv_bytes"]
    assert before == after < victim and out["cached"] == 0, out
    assert out["victim_kv_bytes"] and out["victim_cached"] >= 16, out


def main(argv: list[str]) -> int:
    prefill, decode, token_file, credential_file = argv
    token = Path(token_file).read_bytes().strip()
    out = plant(prefill, decode, token, Credential.load(credential_file))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
