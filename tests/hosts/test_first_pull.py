"""The first pull across hosts in every start order (`kvbridge bench first-pull` times
them): the proxy started with the instances, before them, after them, and each instance
restarted under a serving proxy. A request sent as soon as the proxy answers /health 200
finds its prefill instance met by every decode worker and every path to a prefill worker
warmed by a READ already, as a later request does. Shown by what each pull reports
(`kv_handshakes`: decode workers that waited for a handshake; `kv_cold_peers`: paths
to a prefill worker its READs were the first over, which the decode worker counts when
it posts them, so 0 says a warm-up READ over each path completed before) and by the
bytes that crossed the prefill host's cable; never by how long anything took."""

from __future__ import annotations

import pytest

from kvbridge.bench.first_pull import ORDERS, run_order
from kvbridge.harness.hosts import HostNetwork
from tests.hosts.helpers import ThreeHosts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hosts(network: HostNetwork) -> ThreeHosts:
    """Three test hosts with nothing started: each test starts them in its order."""
    return ThreeHosts(network.add("prefill"), network.add("decode"), network.add("proxy"))


@pytest.mark.parametrize("order", ORDERS)
def test_the_first_pull_finds_warm_paths(hosts: ThreeHosts, order: str) -> None:
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
