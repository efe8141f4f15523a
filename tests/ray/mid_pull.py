"""A request whose KV pull is under way over slowed links, for a test to cut it
(tests/ray)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvbridge.ray.app import Side
from kvbridge.ray.cluster import RayCluster

#: a pull is under way once this much has left a prefill host since the request
UNDER_WAY_BYTES = 1 << 20


@contextlib.contextmanager
def pull_under_way(
    cluster: RayCluster, body: dict[str, Any], headers: dict[str, str] | None = None
) -> Iterator[tuple[str, Future[tuple[int, Any, dict[str, int]]]]]:
    """Send `body` (greedy) with every prefill host's link slowed to 4 Mbit/s (a few MB
    of KV take seconds); yield, once its pull is under way, the name of the host its KV
    leaves and the future of `cluster.complete`'s answer. The links are restored when
    the block ends; the caller awaits the answer."""
    hosts = cluster.side_hosts(Side.PREFILL)
    for host in hosts.values():
        host.slow(rate="4mbit", burst="32kbit", latency="60s")
    pool = ThreadPoolExecutor(1, thread_name_prefix="ask")
    try:
        sent = {name: host.bytes_sent() for name, host in hosts.items()}
        answer = pool.submit(cluster.complete, {**body, "temperature": 0}, headers=headers)

        def carrying() -> str | None:
            moved = {name: host.bytes_sent() - sent[name] for name, host in hosts.items()}
            return next((name for name, n in moved.items() if n > UNDER_WAY_BYTES), None)

        yield cluster.wait_for("the pull under way", carrying, 600, 0.2), answer
    finally:
        for host in hosts.values():
            host.unslow()
        pool.shutdown(wait=False)
