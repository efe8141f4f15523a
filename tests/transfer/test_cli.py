"""`kvbridge transfer-check` as users run it: one JSON object, exit codes, no leftovers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.transfer.helpers import bench_transfer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def kvbridge(*args: str, **kw: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "kvbridge.cli.main", "transfer-check", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kw,  # type: ignore[call-overload]
    )


def children_of(pid: int) -> set[int]:
    """Descendant pids of `pid` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - out
        out |= frontier
    return out


def is_worker(pid: int) -> bool:
    """A spawned worker (not multiprocessing's own resource tracker)."""
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_json_is_exactly_one_object_and_exit_0_when_verified() -> None:
    proc = kvbridge(
        "--prefill-tp",
        "2",
        "--decode-tp",
        "4",
        "--num-kv-heads",
        "4",
        "--requests",
        "3",
        "--tokens",
        "40",
        "--json",
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    report = json.loads(out)  # the whole of stdout is one object
    assert report["verified"] is True and report["failures"] == []
    assert report["requests"] == 3
    # 4 layers x K,V x 4 heads x head_dim 64 x bf16 per token, 3 requests of 40 tokens
    assert report["bytes"] == 3 * 40 * 4 * 2 * 4 * 64 * 2
    for key in ("seconds", "gbps", "descriptors"):
        assert report[key] > 0


def test_unsupported_layout_exits_2_with_the_reason() -> None:
    proc = kvbridge("--prefill-tp", "3", "--decode-tp", "2", "--json")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    report = json.loads(out)
    assert report["verified"] is False
    assert "tp_size=3 neither divides nor is a multiple of num_kv_heads=8" in report["failures"][0]


def test_ctrl_c_leaves_no_worker_processes() -> None:
    # the run gets Ctrl-C as from a terminal: a pytest started in the background by a
    # non-interactive shell ignores SIGINT, and an ignored signal stays ignored across
    # exec, while a handled one is reset to the default (the run then ignored Ctrl-C and
    # finished, exit 0)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = kvbridge(
            "--prefill-tp",
            "2",
            "--decode-tp",
            "2",
            "--requests",
            "2",
            "--tokens",
            "3000",
            "--timeout",
            "600",
        )
    finally:
        signal.signal(signal.SIGINT, handler)
    workers: set[int] = set()
    deadline = time.monotonic() + 60
    while len(workers) < 2 and time.monotonic() < deadline:  # the run has started workers
        workers = {p for p in children_of(proc.pid) if alive(p) and is_worker(p)}
        time.sleep(0.05)
    assert len(workers) >= 2, "the workers never started"
    # freeze the workers seen so far so that the run cannot finish before Ctrl-C arrives
    # (on an idle machine a 2-request run finishes in well under a second)
    for p in workers:
        os.kill(p, signal.SIGSTOP)
    assert proc.poll() is None, "the run ended before its workers were frozen"
    proc.send_signal(signal.SIGINT)
    for p in workers:
        os.kill(p, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:  # and any it starts now
        workers |= {p for p in children_of(proc.pid) if is_worker(p)}
        time.sleep(0.05)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert not [p for p in workers if alive(p)]


def test_bench_transfer_json_has_the_pair_the_baselines_the_descriptors_and_the_floor() -> None:
    out = bench_transfer("--tokens", "64", "--repeat", "1", "--block-size", "32", "--json")
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    main, compare = obj["rows"]
    assert {k: obj[k] for k in main} == main
    assert (main["prefill_layout"], main["decode_layout"]) == ("BHLNC", "BHLNC")
    assert (compare["prefill_layout"], compare["decode_layout"]) == ("LBHNC", "LBHNC")
    for row in (main, compare):
        assert row["block_size"] == 32
        for field in ("plan_ms", "single_read_ms", "memcpy_ms", "ratio"):
            assert row[field] > 0
        assert row["ratio"] == pytest.approx(row["single_read_ms"] / row["plan_ms"])
    # 64 tokens = 2 blocks of 32 on 4 decode workers: cross-layer, one run per block and
    # worker (2 of a prefill worker's 4 heads over 32 layers and K/V); per layer, one per
    # block, layer and K/V
    assert main["descriptors"] == main["descriptors_unmerged"] == 8
    assert main["run_bytes"] == 2 * 32 * 2 * 32 * 128 * 2
    assert compare["descriptors"] == 512 and compare["run_bytes"] == 2 * 32 * 128 * 2
    assert obj["floor_ratio"] > 0
    assert obj["shared_floor_ratio"] > 0  # the kernel floor of an export's shared memory


def test_bench_transfer_prints_a_mixed_pair_and_refuses_a_bad_layout() -> None:
    """(And the KV read from export processes beside the workers' own agents.)"""
    args = ["--tokens", "40", "--repeat", "1", "--no-compare", "--no-floor"]
    pair = ["--prefill-layout", "LBHNC", "--decode-layout", "BHLNC"]
    out = bench_transfer(*args, *pair, "--kv-export", "both")
    assert out.returncode == 0, out.stderr
    assert "plan, LBHNC -> BHLNC (inline)" in out.stdout and "(b) in-process memcpy" in out.stdout
    assert "plan, LBHNC -> BHLNC (process)" in out.stdout
    cost = re.search(
        r"LBHNC -> BHLNC: the KV read from an export process takes ([\d.]+)x", out.stdout
    )
    assert cost is not None and float(cost.group(1)) > 0
    assert "target plan / (a) >= 0.95 for LBHNC -> BHLNC" in out.stdout
    # where a pull's time goes, per pair and export mode: the phases are reported
    for mode in ("inline", "process"):
        line = f"LBHNC -> BHLNC ({mode}): where a pull's time goes"
        assert line in out.stdout and "post " in out.stdout.split(line)[1].splitlines()[0]
    out = bench_transfer(*args, "--layout", "BHL")
    assert out.returncode == 2 and "cache layout='BHL' is not a valid axis order" in out.stderr
