"""Test hosts for the multi-host tests: network namespaces on a bridge
(`kvbridge.harness.hosts`), and one three-host deployment shared by the module's tests
(starting instances is the slow part on two cores). Skipped, with the reason, where
test hosts cannot be made (not root, `ip` missing)."""

from __future__ import annotations

import pytest

from kvbridge.harness.hosts import HostNetwork, missing
from tests.hosts.helpers import ThreeHosts


@pytest.fixture(scope="module")
def network(tmp_path_factory):
    """A `HostNetwork`, torn down (processes, namespaces, veths, bridge) after the
    module, whatever its tests did; the hosts' output stays in pytest's tmp dir."""
    reason = missing()
    if reason:
        pytest.skip(reason)
    with HostNetwork(log_dir=tmp_path_factory.mktemp("hosts")) as net:
        yield net


@pytest.fixture(scope="module")
def hosts(network) -> ThreeHosts:
    """The module's prefill, decode and proxy hosts, nothing started on them yet."""
    return ThreeHosts(network.add("prefill"), network.add("decode"), network.add("proxy"))


@pytest.fixture(scope="module")
def three_hosts(hosts):
    """Prefill (tp 1), decode (tp 3) and proxy, each on its own host, started with
    `kvbridge serve --role ...` and the deployment's token; or the same deployment as
    the module's tests before left it serving (the start-order tests start it so)."""
    hosts.serve(900)
    yield hosts
