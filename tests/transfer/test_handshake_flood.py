"""Issue #46 item 2 with real processes: a token holder's handshake flood from four
network addresses, with fresh keys and ids, cannot keep a new decode instance out.

A prefill worker (its own process, a real NIXL agent, the real side channel with CURVE)
is flooded from 127.0.0.2-.5 (loopback aliases: ZMQ's ``tcp://SRC:0;DST:PORT``) by four
`flooder` processes, each sending at least 1,100 valid Hellos over connections with keys
of their own, half of them in ids bound to those keys. Once every flooder has been
refused "busy", a decode instance with its own identity starts; the prefill worker
exposes a request for it (the capability's reader) and it pulls while the flood goes on.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from typing import Any

import msgspec
import pytest

from kvbridge.harness.check import make_workload
from kvbridge.harness.cluster import Cluster
from kvbridge.harness.commands import Expose, Finished, Pull, Released, Verified, Verify
from kvbridge.plan.geometry import AttentionKind, ModelKVSpec
from kvbridge.plan.layout import InstanceLayout
from kvbridge.transfer.identity import Identity
from kvbridge.transfer.messages import LayoutWire, ModelWire
from kvbridge.transfer.producer import MAX_SESSIONS
from kvbridge.transfer.sessions import SessionTable

from .helpers import ROOT

pytestmark = pytest.mark.slow

MODEL = ModelKVSpec(3, 4, 2, 8, "float16", AttentionKind.GQA, "test")
LAYOUT = InstanceLayout(tp_size=1)
SOURCES = [f"127.0.0.{i}" for i in range(2, 6)]
#: Hellos each flooder sends at least (the issue's flood), and at most
MIN_HELLOS, MAX_HELLOS = 1100, 50_000
#: A prefill worker's session table, for its sizes: its pool, each address's share of it
TABLE = SessionTable(
    token=None, me=("", 0), max_sessions=MAX_SESSIONS, grace_s=0, active_s=0, clock=time.monotonic
)


def start_flooder(endpoint: str, source: str, token: bytes) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "FLOOD_MODEL": msgspec.json.encode(ModelWire.of(MODEL)).decode(),
        "FLOOD_LAYOUT": msgspec.json.encode(LayoutWire.of(LAYOUT)).decode(),
    }
    cmd = [sys.executable, "-m", "tests.transfer.flooder", endpoint, source]
    proc = subprocess.Popen(
        [*cmd, str(MIN_HELLOS), str(MAX_HELLOS), "180"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.stdin is not None
    proc.stdin.write(token.hex() + "\n")
    proc.stdin.flush()
    return proc


def first_line(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    """The flooder's first JSON line (the flood is full), or a failure naming why not."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"flooder {proc.args} said nothing within {timeout_s:g} s"
    line = proc.stdout.readline()
    assert line, f"flooder {proc.args} exited with {proc.wait(10)} before the pool was full"
    found: dict[str, Any] = json.loads(line)
    return found


def stop(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """Tell a flooder to stop; its report (or a failure if it has none)."""
    try:
        out, _ = proc.communicate("stop\n", timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    lines = out.splitlines()
    assert proc.returncode == 0 and lines, f"flooder {proc.args} failed: {proc.returncode}"
    report: dict[str, Any] = json.loads(lines[-1])
    return report


def test_a_flood_from_four_addresses_leaves_room_for_a_new_decode_instance() -> None:
    token = os.urandom(32)
    work = make_workload(LAYOUT, LAYOUT, num_requests=1, num_tokens=37)
    (ps,), (ds,) = work.prefill, work.decode
    key = Identity.generate()
    reader = key.bind("decode")
    flooders: list[subprocess.Popen[str]] = []
    reports: list[dict[str, Any]] = []
    with Cluster() as c:
        # the flood's sessions stay young (a pull's timeout, plus a handshake's) for the
        # whole test, so none of them may be evicted: the pool stays full of them
        pre = c.start(
            "prefill",
            MODEL,
            LAYOUT,
            work.prefill_blocks,
            "prefill",
            fill=work.prefill,
            salt=1000,
            token=token,
            transfer_timeout_s=600,
            lease_s=900,
        )
        try:
            flooders = [start_flooder(pre.endpoint, s, token) for s in SOURCES]
            full_at = [first_line(f, 120)["full"] for f in flooders]
            dec = c.start(
                "decode",
                MODEL,
                LAYOUT,
                work.decode_blocks,
                reader,
                salt=5000,
                token=token,
                identity=key.secret,
            )
            (p,), (d,) = pre.workers, dec.workers
            # sent together, as in a deployment (the capability may reach the decode
            # instance before the prefill worker pins the request)
            p.send(Expose("r1", ps.block_ids, ps.num_tokens, reader=reader))
            pulled_at = time.monotonic()
            d.send(Pull("r1", pre.endpoint, ps.block_ids, ds.block_ids, ds.num_tokens))
            done: Finished = c.expect(d, Finished, 120)
            served_at = time.monotonic()
            released: Released = c.expect(p, Released, 60)
            d.send(Verify([ds]))
            verified: Verified = c.expect(d, Verified, 60)
        finally:
            reports = [stop(f) for f in flooders]
    assert done.state == "done", done.reason
    assert verified.ok, verified.detail
    assert (released.request_id, released.cause) == ("r1", "completed"), released
    for source, report in zip(SOURCES, reports, strict=True):
        replies = report["replies"]
        assert report["sent"] >= MIN_HELLOS and report["unanswered"] == 0, (source, report)
        assert sum(replies.values()) == report["sent"], (source, report)
        # each address got its share of the pool (the four fill it) and no more
        assert replies.get("welcome") == TABLE.per_source, (source, report)
        assert set(replies) == {"welcome", "busy"}, (source, report)
        assert any(f"come from {source} already" in r for r in report["reasons"]), report
        # the pool was full before the decode instance came, the flood went on after
        assert report["first_busy_at"] < pulled_at < served_at < report["last_reply_at"], (
            source,
            report,
            pulled_at,
            served_at,
        )
    assert max(full_at) < pulled_at
    assert 4 * TABLE.per_source == TABLE.pool_size  # the four addresses filled the pool
