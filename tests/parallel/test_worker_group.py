"""WorkerGroup: calls and replies, failures reaching the driver, nothing left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from kvbridge.engine.parallel import (
    WorkerDiedError,
    WorkerError,
    WorkerGroup,
    WorkerGroupClosedError,
    WorkerStartError,
    WorkerTimeoutError,
)
from kvbridge.engine.parallel.shm_segment import SHM_DIR, is_process_alive
from tests.parallel.helpers import check_stress

ECHO = "tests.parallel.workers:echo_worker"
pytestmark = pytest.mark.slow


def our_segments() -> set[str]:
    """Our communicator segments and reply buffers in /dev/shm."""
    return {p.name for p in SHM_DIR.glob(f"kvbridge-*-{os.getpid()}-*")}


def assert_gone(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(is_process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if is_process_alive(pid)], "worker processes survive"


def test_nine_workers_calls_replies_and_collectives() -> None:
    """One 9-worker group (spawning is the slow part) checks the happy paths."""
    events: list[tuple[int, str]] = []
    before = our_segments()
    group = WorkerGroup(
        9, ECHO, b"init", comm_max_bytes=16384, on_progress=lambda r, t: events.append((r, t))
    )
    with group:
        pids = group.pids
        # start-up progress: spawned, the worker's own report, ready — for every rank
        for rank in range(9):
            texts = [t for r, t in events if r == rank]
            assert texts[0].startswith("spawned pid") and texts[-1] == "ready"
            assert "init with 4 bytes" in texts
        assert group.call("echo", b"x") == [f"init|{r}|x".encode() for r in range(9)]
        assert group.call("echo", b"y", ranks=[4, 0]) == [b"init|4|y", b"init|0|y"]
        # the workers' pids are the processes the driver sees
        assert [int(p) for p in group.call("pid")] == pids
        # each froze its start-up objects before it reported ready (`kvbridge.heap`)
        assert all(int(n) > 1000 for n in group.call("frozen"))
        # all_reduce through ctx.comm: every rank gets 1 + 2 + ... + 9
        replies = group.call("sum", b"576")
        for reply in replies:
            assert np.array_equal(np.frombuffer(reply, np.float32), np.full(576, 45.0))
        # pipelined calls run in order and are collected independently
        first = group.submit("echo", b"1")
        second = group.submit("echo", b"2", ranks=[8])
        assert group.collect(second) == [b"init|8|2"]
        assert group.collect(first)[3] == b"init|3|1"
        # large replies come back through each worker's shared-memory reply buffer, also
        # when several are in flight from the same worker
        big = [bytes([i]) * 300_000 for i in range(3)]
        handles = [group.submit("echo", b, ranks=[0, 5]) for b in big]
        for handle, b in reversed(list(zip(handles, big, strict=True))):
            assert group.collect(handle) == [b"init|0|" + b, b"init|5|" + b]
        # random back-to-back collectives with delayed ranks, checked on every rank
        stress = group.call("stress", json.dumps({"seed": 9, "steps": 80}).encode())
        check_stress([json.loads(r) for r in stress])
    assert_gone(pids)
    assert our_segments() == before
    with pytest.raises(WorkerGroupClosedError, match="closed"):
        group.call("echo")


def test_workers_see_the_drivers_environment_as_it_is_when_their_group_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Workers fork from a server started with the driver's first group; a variable set
    or removed after that (a cache directory, UCX's devices) still reaches later groups,
    as it would reach a spawned process."""
    monkeypatch.setenv("KVBRIDGE_TEST_SETTING", "first")
    monkeypatch.setenv("KVBRIDGE_TEST_REMOVED", "set")
    with WorkerGroup(1, ECHO) as first:
        assert first.call("env", b"KVBRIDGE_TEST_SETTING") == [b"first"]
        monkeypatch.setenv("KVBRIDGE_TEST_SETTING", "second")
        monkeypatch.delenv("KVBRIDGE_TEST_REMOVED")
        with WorkerGroup(2, ECHO) as second:
            assert second.call("env", b"KVBRIDGE_TEST_SETTING") == [b"second"] * 2
            assert second.call("env", b"KVBRIDGE_TEST_REMOVED") == [b"<unset>"] * 2
        assert first.call("env", b"KVBRIDGE_TEST_SETTING") == [b"first"]


def test_worker_exception_reaches_the_driver_with_rank_and_traceback() -> None:
    with WorkerGroup(3, ECHO) as group:
        assert group.call("echo", b"") == [b"|0|", b"|1|", b"|2|"]
        with pytest.raises(WorkerError) as info:
            group.call("raise", b"1")  # ranks 0 and 2 wait for rank 1 in all_reduce
        err = info.value
        assert err.rank == 1
        assert "boom from rank 1" in str(err) and "ValueError" in str(err)
        assert "ValueError: boom from rank 1" in err.traceback_text
        assert "ranks [0, 2] failed as a consequence" in str(err)
        with pytest.raises(WorkerGroupClosedError, match="rank 1 raised"):
            group.call("echo")
        pids = group.pids
    assert_gone(pids)


def test_worker_exit_mid_call_names_rank_and_exit_code() -> None:
    before = our_segments()
    with WorkerGroup(2, ECHO) as group:
        with pytest.raises(WorkerDiedError) as info:
            group.call("exit", b"1")  # rank 1 exits while rank 0 waits in all_reduce
        assert info.value.rank == 1 and info.value.exitcode == 7
        assert "rank 1" in str(info.value) and "code 7" in str(info.value)
        pids = group.pids
    assert_gone(pids)
    assert our_segments() == before


def test_worker_killed_between_calls_fails_the_next_call() -> None:
    with WorkerGroup(2, ECHO) as group:
        os.kill(group.pids[1], signal.SIGKILL)
        with pytest.raises(WorkerDiedError) as info:
            group.call("echo", timeout=30)
        assert info.value.rank == 1 and info.value.exitcode == -signal.SIGKILL
        pids = group.pids
    assert_gone(pids)


def test_check_alive_notices_a_death_without_a_call() -> None:
    """An idle driver (a server between requests) learns of a death by `check_alive`."""
    with WorkerGroup(2, ECHO) as group:
        group.check_alive()
        os.kill(group.pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        with pytest.raises(WorkerDiedError) as info:
            while time.monotonic() < deadline:
                group.check_alive()
                time.sleep(0.01)
        assert info.value.rank == 1 and info.value.exitcode == -signal.SIGKILL
        with pytest.raises(WorkerGroupClosedError, match="rank 1"):
            group.check_alive()


def test_start_failure_reports_rank_and_traceback_and_cleans_up() -> None:
    before = our_segments()
    with pytest.raises(WorkerStartError) as info:
        WorkerGroup(2, "tests.parallel.workers:failing_init_worker", start_timeout=120)
    assert "rank 1" in str(info.value) and "cannot load weights on rank 1" in str(info.value)
    assert our_segments() == before
    with pytest.raises(WorkerStartError, match=r"package\.module:function"):
        WorkerGroup(2, "no_colon_here")


def test_start_failure_names_the_root_cause_whichever_death_is_seen_first() -> None:
    """Ranks 0 and 2 die first, without a reason; rank 1, the root cause, sent its
    reason and exits later. The driver reports the first death with rank 1's reason."""
    with pytest.raises(WorkerStartError) as info:
        WorkerGroup(3, "tests.parallel.workers:one_rank_fails_init_worker", start_timeout=120)
    message = str(info.value)
    assert re.search(
        r"worker rank [02] \(pid \d+\) exited with code 1; rank 1 failed first", message
    )
    assert "RuntimeError: cannot load weights on rank 1" in message


def test_workers_exit_when_the_driver_dies(tmp_path: Path) -> None:
    driver = textwrap.dedent(
        f"""
        import os, sys
        from kvbridge.engine.parallel import WorkerGroup
        if __name__ == "__main__":
            group = WorkerGroup(2, {ECHO!r})
            print(" ".join(str(p) for p in group.pids), flush=True)
            os._exit(0)  # no close(), no atexit: like a crash
        """
    )
    script = tmp_path / "driver.py"
    script.write_text(driver)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2
    assert_gone(pids, timeout=15.0)


def test_call_timeout_names_the_silent_ranks_and_close_still_cleans_up() -> None:
    before = our_segments()
    with WorkerGroup(1, ECHO) as group:
        with pytest.raises(WorkerTimeoutError, match=r"no answer from ranks \[0\]"):
            group.call("sleep", b"3", timeout=0.2)
        with pytest.raises(WorkerGroupClosedError, match="timed out"):
            group.call("echo")
        pids = group.pids
    assert_gone(pids)
    assert our_segments() == before
