"""Ray Serve LLM restarts a killed prefill replica, and KVBridgeConnector serves through it;
a decode replica that dies mid-pull leaves no prefill block pinned past the lease: a Ray
cluster over three test hosts (`kvbridge.ray.cluster`), prefill tp 1 and decode tp 3,
vLLM's `kv_load_failure_policy` recompute, a lease of `LEASE_S`. Needs root; `make
test-ray` runs it."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvbridge.ray.app import Side
from kvbridge.ray.cluster import MODEL_ID, RayCluster
from tests.ray.mid_pull import pull_under_way

pytestmark = pytest.mark.timeout(3600)
#: the prefill's lease: long enough for a first pull (handshake included) on this host,
#: short enough to wait for once
LEASE_S = 60
#: the `cluster` fixture's settings (tests/ray/conftest.py)
CLUSTER: dict[str, Any] = {"failure_policy": "recompute", "pool_size": 4, "lease_s": LEASE_S}
#: vLLM's series (its spelling) the prefill's replica exports through Ray
PINNED, RELEASES, USAGE = (
    "vllm:kvbridge_kv_pinned_blocks",
    "vllm:kvbridge_kv_releases",
    "vllm:kv_cache_usage_perc",
)
UNFINISHED = "releases of pulls not completed"

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
    num_claims = len(cluster.claims(Side.PREFILL))
    failed_before = len(cluster.failed_pulls())

    with pull_under_way(cluster, {**LONG, "cache_salt": "cut"}) as (_, asked):
        cluster.kill_replica(Side.PREFILL)
    status, answer, _ = asked.result(900)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == reference  # recomputed on the decode host
    assert len(cluster.failed_pulls()) > failed_before

    new_replica(cluster, Side.PREFILL, num_claims)
    started = time.monotonic()
    _, pulls, _ = complete(cluster, {**LONG, "prompt": LONG["prompt"] + " Done."})
    assert sorted(p.rank for p in pulls) == [0, 1, 2], f"after {time.monotonic() - started:.0f} s"


def test_a_decode_dying_mid_pull_leaves_no_prefill_block_pinned_past_the_lease(
    cluster: RayCluster,
) -> None:
    """The decode replica is killed while it pulls: the prefill replica's own figures, as
    Ray exports them, show the request's blocks freed with one more release that is not a
    completed pull (aborted when the decode's orphaned engine, shutting down, says its
    pulls failed, lease_expired when nobody says), no block pinned and vLLM's KV cache
    empty. (How long the blocks stay pinned before the release depends on which of the
    two comes first, so the test does not wait to see them pinned.)"""

    def figures() -> dict[str, dict[str, float]]:
        """Each prefill replica's pinned blocks, KV cache usage and unfinished releases."""
        unfinished: dict[str, float] = {}
        for cause in ("aborted", "lease_expired"):
            for r, n in cluster.replica_metric("prefill", RELEASES, cause=cause).items():
                unfinished[r] = unfinished.get(r, 0) + n
        return {
            PINNED: cluster.replica_metric("prefill", PINNED),
            USAGE: cluster.replica_metric("prefill", USAGE),
            UNFINISHED: unfinished,
        }

    before = figures()[UNFINISHED]
    with pull_under_way(cluster, {**LONG, "cache_salt": "orphan"}) as (_, asked):
        cluster.kill_replica(Side.DECODE)

    def freed() -> str | None:
        """The replica whose blocks were released unfinished once, now pinning nothing
        and with vLLM's cache empty (a step's figures: vLLM's freed blocks and the
        connector's release come together)."""
        now = figures()
        grown = [r for r, n in now[UNFINISHED].items() if n == before.get(r, 0) + 1]
        done = [r for r in grown if now[PINNED].get(r) == 0 and now[USAGE].get(r) == 0]
        return done[0] if len(grown) == 1 and done else None

    replica = cluster.wait_for(
        "the blocks freed by the decode's notice or the lease", freed, LEASE_S + 120, 1
    )
    # no other replica released anything unfinished
    after = figures()[UNFINISHED]
    assert {r: n for r, n in after.items() if r != replica} == {
        r: n for r, n in before.items() if r != replica
    }
    asked.result(900)  # the client's request ended too (as Ray Serve ends it)
