"""Scale-out under Ray Serve LLM: two prefill replicas (one per host) and one decode
replica (tp 3); Ray's router spreads the prefills over both, and each request's KV comes
from the replica that computed it, over that replica's link. Under vLLM's
`kv_load_failure_policy` fail, a request whose KV is lost fails and later ones are
served. Needs root; `make test-ray`."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from kvbridge.ray.app import Side
from kvbridge.ray.cluster import MODEL_ID, RayCluster
from tests.ray.mid_pull import pull_under_way

pytestmark = pytest.mark.timeout(3600)
#: the `cluster` fixture's settings (tests/ray/conftest.py)
CLUSTER: dict[str, Any] = {"num_prefill_replicas": 2}

#: a prompt whose KV (about 10 MB) dwarfs what a prefill host sends besides (Ray's own
#: traffic, replies: under 1 MB a request)
PROMPT = " ".join(f"Step {i}: add {i * 3 % 11} to the total." for i in range(20))
BODY = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}


def test_prefills_spread_over_both_replicas_and_each_pull_reads_from_its_own(
    cluster: RayCluster,
) -> None:
    claims = cluster.claims(Side.PREFILL)
    hosts = cluster.side_hosts(Side.PREFILL)
    assert sorted(c["node"] for c in claims) == sorted(h.address for h in hosts.values())
    served: Counter[str] = Counter()
    answers = set()
    for i in range(12):
        before = {p.request_id for p in cluster.pulls()}
        status, answer, link = cluster.complete({**BODY, "cache_salt": f"request-{i}"})
        assert status == 200, answer
        answers.add(answer["choices"][0]["text"])
        pulls = [p for p in cluster.pulls() if p.request_id not in before]
        assert sorted(p.rank for p in pulls) == [0, 1, 2]  # every prompt token pulled
        kv = sum(p.link_bytes for p in pulls)
        # the KV left exactly one prefill host: the one whose replica computed it
        carried = [name for name, n in link.items() if n >= kv]
        assert len(carried) == 1, (kv, link)
        assert all(n < kv // 4 for name, n in link.items() if name != carried[0]), (kv, link)
        served[carried[0]] += 1
        if len(served) == 2 and i >= 3:
            break
    assert set(served) == set(hosts), served
    assert len(answers) == 1  # the same tokens through either replica


def test_a_request_whose_kv_was_lost_fails_and_later_requests_are_served(
    cluster: RayCluster,
) -> None:
    """The prefill replica that computed a request is killed while the decode workers
    pull its KV (both links slowed): under the fail policy the client gets an error
    (vLLM's OpenAI layer answers a failed request with 500 "Internal server error"), the
    decode workers log why their pull failed, naming the request; the next requests
    are served through the other replica, pulled, not recomputed."""
    status, answer, _ = cluster.complete({**BODY, "cache_salt": "reference"})
    assert status == 200, answer
    reference = answer["choices"][0]["text"]
    failed_before = set(cluster.failed_pulls())
    body = {**BODY, "cache_salt": "lost"}
    with pull_under_way(cluster, body, headers={"x-request-id": "lost-kv"}) as (carrying, asked):
        cluster.kill_replica(Side.PREFILL, carrying)
    status, answer, _ = asked.result(900)
    assert status == 500, answer
    assert "internal server error" in str(answer).lower(), answer
    failed = set(cluster.failed_pulls()) - failed_before
    # each decode worker's pull of that one request ended: failed with its reason where
    # the kill cut it, pulled where its share had all arrived before
    failed_ranks = {int(rank) for rank, _, _ in failed}
    pulled = {p.rank for p in cluster.pulls() if "lost-kv" in p.request_id}
    assert failed_ranks and not failed_ranks & pulled, (failed, pulled)
    assert failed_ranks | pulled == {0, 1, 2}, (failed, pulled)
    assert len({request for _, request, _ in failed}) == 1, failed
    assert all("lost-kv" in request and reason for _, request, reason in failed), failed

    survivor = next(n for n in cluster.side_hosts(Side.PREFILL) if n != carrying)
    for i in range(2):
        before = {p.request_id for p in cluster.pulls()}
        status, answer, link = cluster.complete({**BODY, "cache_salt": f"after-{i}"})
        assert status == 200, answer
        assert answer["choices"][0]["text"] == reference
        pulls = [p for p in cluster.pulls() if p.request_id not in before]
        assert sorted(p.rank for p in pulls) == [0, 1, 2]  # pulled, not recomputed
        assert link[survivor] >= sum(p.link_bytes for p in pulls) > 0
