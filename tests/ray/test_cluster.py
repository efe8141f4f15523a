"""Ray Serve LLM restarts a killed prefill replica, and KVBridgeConnector serves through it:
a Ray cluster over three test hosts (`kvbridge.ray.cluster`), prefill tp 1 and decode tp 3,
vLLM's `kv_load_failure_policy` recompute. Needs root; `make test-ray` runs it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvbridge.ray.app import Side
from kvbridge.ray.cluster import MODEL_ID, RayCluster

pytestmark = pytest.mark.timeout(3600)
#: the `cluster` fixture's settings (tests/ray/conftest.py)
CLUSTER: dict[str, Any] = {"failure_policy": "recompute", "pool_size": 4}

QUESTION = {"model": MODEL_ID, "prompt": "The capital of France is", "max_tokens": 10}
#: a prompt whose KV (about 20 MB) takes long enough over a slowed link to be cut mid-pull
LONG = {
    "model": MODEL_ID,
    "prompt": " ".join(f"Item {i} of the list is the number {i * 7 % 97}." for i in range(40)),
    "max_tokens": 8,
}


def complete(cluster: RayCluster, body: dict[str, Any]) -> tuple[str, list[Any], int]:
    """The answer, the pulls its request made (every decode worker's) and the bytes the
    prefill host sent meanwhile."""
    before = {p.request_id for p in cluster.pulls()}
    status, answer, link = cluster.complete({**body, "temperature": 0})
    assert status == 200, answer
    new = [p for p in cluster.pulls() if p.request_id not in before]
    return answer["choices"][0]["text"], new, link["prefill"]


def new_replica(cluster: RayCluster, side: Side, num_claims: int) -> dict[str, Any]:
    """The claim of the replica Ray starts after `num_claims` claims."""
    claims = cluster.wait_for(
        f"a new {side.value} replica claiming a credential",
        lambda: len(cluster.claims(side)) > num_claims and cluster.claims(side),
        timeout_s=600,
    )
    return claims[num_claims]


def test_a_killed_prefill_replica_is_restarted_and_its_successor_met_afresh(
    cluster: RayCluster,
) -> None:
    text, pulls, link = complete(cluster, QUESTION)
    assert text.startswith(" Paris.")
    assert sorted(p.rank for p in pulls) == [0, 1, 2]
    assert link >= sum(p.link_bytes for p in pulls) > 0
    first = cluster.claims(Side.PREFILL)
    assert [c["node"] for c in first] == [cluster.hosts["prefill"].address]

    killed = cluster.kill_replica(Side.PREFILL)
    successor = new_replica(cluster, Side.PREFILL, len(first))
    # another credential, so another instance id: the decode workers meet it afresh
    assert successor["credential"] != first[0]["credential"]
    assert successor["node"] == cluster.hosts["prefill"].address

    again, pulls, link = complete(cluster, QUESTION)
    assert again == text
    assert sorted(p.rank for p in pulls) == [0, 1, 2]  # pulled, not recomputed
    # the only KV on the prefill host is the successor's: the bytes came over its link
    assert link >= sum(p.link_bytes for p in pulls) > 0
    assert not set(killed) & set(cluster.replica_pids(Side.PREFILL))


def test_a_pull_cut_by_a_killed_prefill_is_recomputed_and_later_requests_pull(
    cluster: RayCluster,
) -> None:
    reference, pulls, _ = complete(cluster, LONG)
    assert sorted(p.rank for p in pulls) == [0, 1, 2]
    kv_bytes = sum(p.link_bytes for p in pulls)
    num_claims = len(cluster.claims(Side.PREFILL))
    failed_before = len(cluster.failed_pulls())

    prefill = cluster.hosts["prefill"]
    prefill.slow(rate="4mbit", burst="32kbit", latency="60s")  # ~40 s for the KV
    result: dict[str, Any] = {}

    def ask() -> None:
        result["answer"] = cluster.complete({**LONG, "temperature": 0, "cache_salt": "cut"})

    asking = threading.Thread(target=ask)
    sent = prefill.bytes_sent()
    asking.start()
    try:
        # the pull is under way once a tenth of the KV has left the prefill host
        cluster.wait_for(
            "the pull under way", lambda: prefill.bytes_sent() - sent > kv_bytes // 10, 600, 0.2
        )
        cluster.kill_replica(Side.PREFILL)
    finally:
        prefill.unslow()
    asking.join(900)
    assert not asking.is_alive()
    status, answer, _ = result["answer"]
    assert status == 200, answer
    assert answer["choices"][0]["text"] == reference  # recomputed on the decode host
    assert len(cluster.failed_pulls()) > failed_before

    new_replica(cluster, Side.PREFILL, num_claims)
    started = time.monotonic()
    _, pulls, _ = complete(cluster, {**LONG, "prompt": LONG["prompt"] + " Done."})
    assert sorted(p.rank for p in pulls) == [0, 1, 2], f"after {time.monotonic() - started:.0f} s"
