"""The test hosts themselves: separate hostnames, pids and links, and nothing left after."""

from __future__ import annotations

import json
import time

import pytest

from kvbridge.harness.hosts import HostNetwork, TestHost, missing, sh
from tests.transfer.helpers import bench_transfer


def test_hosts_are_apart_and_torn_down_completely() -> None:
    reason = missing()
    if reason:
        pytest.skip(reason)
    with HostNetwork() as net:
        a, b = net.add("kvbh-a"), net.add("kvbh-b")
        a.start(["sh", "-c", 'echo "$(hostname) pid $$"; ls /dev/shm | wc -l; sleep 600'])
        deadline = time.monotonic() + 30
        while len(a.log_tail().split()) < 4:  # both lines written
            assert a.is_running and time.monotonic() < deadline, a.log_tail()
            time.sleep(0.05)
        assert a.log_tail().split() == ["kvbh-a", "pid", "1", "0"]  # own name, pids, shm
        assert a.pids()
        assert _connect(b, a.address) == "ConnectionRefusedError"  # reached; nobody on 9
        a.cut()
        assert _connect(b, a.address) in ("TimeoutError", "OSError")  # unreachable
        a.heal()
        names = (a.netns, b.netns, a.veth, b.veth, net.bridge)
    assert not a.is_running
    leftovers = sh(["ip", "netns", "list"]) + sh(["ip", "link", "show"])
    for name in names:
        assert name not in leftovers


def _connect(src: TestHost, address: str) -> str:
    """How a TCP connection from host `src` to port 9 of `address` fails."""
    probe = (
        "import socket\ntry: socket.create_connection((%r, 9), timeout=3)\n"
        "except OSError as e: print(type(e).__name__)"
    )
    return src.run(["python3", "-c", probe % address]).strip()


def test_bench_transfer_hosts_moves_the_kv_across_the_link() -> None:
    """`kvbridge bench transfer --hosts`: workers on two hosts, the bytes over the link."""
    reason = missing()
    if reason:
        pytest.skip(reason)
    args = ["--hosts", "--tokens", "64", "--repeat", "1", "--no-compare", "--json"]
    out = bench_transfer(*args)
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    assert obj["hosts"] and obj["tcp_ms"] > 0 and obj["ratio"] > 0
    assert obj["tcp_streams"] == 4 and obj["tcp_multi_ms"] > 0 and obj["single_write_ms"] > 0
    best = min(obj["tcp_ms"], obj["tcp_multi_ms"])
    assert obj["link_ratio"] == pytest.approx(best / obj["plan_ms"])
    assert obj["floor_ratio"] is None
    # two plan requests, one READ and one WRITE of the same bytes (the WRITE crosses
    # the link towards the prefill host: its received bytes are not counted here)
    moved = 3 * obj["run_bytes"] * obj["descriptors"]
    assert obj["link_bytes"] >= moved
    assert "kvbh" not in sh(["ip", "netns", "list"])
