"""ShmCommunicator: results against a reference, bit-identical across ranks, failures."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time

import pytest
import torch

from kvbridge.engine.parallel import (
    CommError,
    CommUsageError,
    ShmCommunicator,
    ShmSegment,
)
from kvbridge.engine.parallel.shm_segment import SHM_DIR
from tests.parallel.helpers import check_stress
from tests.parallel.workers import SCENARIOS, rank_input, reference_sum, run_scenarios

HARNESS_TIMEOUT_S = 60.0


def run_ranks(world_size: int, plan: list[tuple[str, dict]]) -> list[list[dict | None]]:
    """Run scenarios on `world_size` spawned ranks (one spawn for all: start-up is the
    expensive part), each on a fresh segment. Returns results[scenario][rank], None for
    a rank that died first. Asserts no segment file is left in /dev/shm."""
    ctx = mp.get_context("spawn")
    # small slots: the stress sizes (up to 80 KB) also exercise splitting into pieces
    segments = [ShmSegment(world_size, max_bytes=16384) for _ in plan]
    names = [s.name for s in segments]
    procs, conns = [], []
    for rank in range(world_size):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=run_scenarios,
            args=(json.dumps(plan), names, rank, world_size, child),
            daemon=True,
        )
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    results: list[list[dict | None]] = [[None] * world_size for _ in plan]
    try:
        for rank, conn in enumerate(conns):
            for i in range(len(plan)):
                if not conn.poll(HARNESS_TIMEOUT_S):
                    pytest.fail(f"rank {rank} gave no result in {HARNESS_TIMEOUT_S} s")
                try:
                    results[i][rank] = json.loads(conn.recv_bytes())
                except EOFError:
                    break  # it died
        for proc in procs:
            proc.join(HARNESS_TIMEOUT_S)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        # ranks unlink each segment themselves once all attached; close() is the fallback
        leaked = [name for name in names if (SHM_DIR / name).exists()]
        for segment in segments:
            segment.close()
    assert not leaked, f"{leaked} still in /dev/shm after the ranks finished"
    return results


# ---- one process ------------------------------------------------------------------------


def test_single_rank_collectives_and_refusals() -> None:
    with ShmSegment(1, max_bytes=4096) as segment:
        comm = ShmCommunicator(segment.name, 0, 1)
        assert not (SHM_DIR / segment.name).exists()  # unlinked once every rank attached
        t = torch.arange(10, dtype=torch.float32)
        assert torch.equal(comm.all_reduce(t.clone()), t)
        assert torch.equal(comm.all_gather(t.view(2, 5), dim=0), t.view(2, 5))
        comm.barrier()
        # larger than a slot: goes in slot-sized pieces, same result
        big = torch.arange(5000, dtype=torch.float32)
        assert torch.equal(comm.all_reduce(big.clone()), big)
        assert torch.equal(comm.all_gather(big.view(50, 100), dim=1), big.view(50, 100))
        assert torch.equal(comm.broadcast(big.clone(), src=0), big)
        with pytest.raises(CommUsageError, match="contiguous"):
            comm.all_reduce(torch.zeros(4, 4).t())
        with pytest.raises(CommUsageError, match="float64 is not supported"):
            comm.all_reduce(torch.zeros(4, dtype=torch.float64))
        comm.barrier()  # a refused call breaks nothing: it never touched the protocol
        comm.close()
        with pytest.raises(CommError, match="unusable"):
            comm.barrier()


def test_attach_refuses_wrong_world_size_and_missing_segment() -> None:
    with ShmSegment(3) as segment, pytest.raises(CommError, match="created for 3 ranks"):
        ShmCommunicator(segment.name, 0, 2)
    with pytest.raises(CommError, match="does not exist"):
        ShmCommunicator(segment.name, 0, 3)


def test_segment_close_removes_the_file() -> None:
    segment = ShmSegment(2)
    assert (SHM_DIR / segment.name).exists()
    segment.close()
    segment.close()
    assert not (SHM_DIR / segment.name).exists()


# ---- real processes ---------------------------------------------------------------------

THREE_RANK_PLAN: list[tuple[str, dict]] = [
    ("stress", {"seed": 3, "steps": 300}),
    ("mismatch", {"odd_rank": 1}),
    ("skip", {"skipper": 1, "sleep": 2.0, "timeout": 0.5}),
    ("kill", {"victim": 2, "at": 5, "steps": 50, "timeout": 30.0}),  # last: rank 2 dies
]


@pytest.fixture(scope="module")
def three_ranks() -> dict[str, list[dict | None]]:
    results = run_ranks(3, THREE_RANK_PLAN)
    return {name: result for (name, _), result in zip(THREE_RANK_PLAN, results, strict=True)}


def test_stress_single_rank_in_process() -> None:
    with ShmSegment(1, max_bytes=16384) as segment:
        comm = ShmCommunicator(segment.name, 0, 1)
        check_stress([SCENARIOS["stress"](comm, {"seed": 1, "steps": 200})])
        comm.close()


@pytest.mark.slow
def test_stress_three_ranks_matches_reference_bit_identically(three_ranks: dict) -> None:
    check_stress(three_ranks["stress"])


def test_reference_order_matters_so_bit_identity_is_meaningful() -> None:
    # Guards the stress test's premise: a different summation order gives other bits,
    # so agreeing digests are evidence of the fixed order, not of luck.
    inputs = [rank_input(0, 0, r, 4096, "float32") for r in range(9)]
    assert not torch.equal(reference_sum(inputs), reference_sum(inputs[::-1]))


@pytest.mark.slow
def test_killed_peer_fails_the_collective_naming_it(three_ranks: dict) -> None:
    results = three_ranks["kill"]
    assert results[2] is None  # the victim died
    for rank in (0, 1):
        result = results[rank]
        assert result is not None and result["step"] == 5
        # detected through the pid probe or the abort flag, not the 30 s timeout
        assert result["type"] in ("PeerDiedError", "PeerAbortedError"), result
        assert "rank 2" in result["message"] and "died" in result["message"]
        assert result["again"] == "CommError"  # the communicator stays unusable


@pytest.mark.slow
def test_mismatched_collectives_are_refused_on_every_rank(three_ranks: dict) -> None:
    for result in three_ranks["mismatch"]:
        assert result is not None
        assert result["type"] in ("CommMismatchError", "PeerAbortedError"), result
        assert "all_gather" in result["message"] and "all_reduce" in result["message"]


@pytest.mark.slow
def test_absent_peer_times_out_naming_it(three_ranks: dict) -> None:
    for rank in (0, 2):
        result = three_ranks["skip"][rank]
        assert result is not None
        assert result["type"] in ("CommTimeoutError", "PeerAbortedError"), result
        assert "[1]" in result["message"] and "timed out" in result["message"]


def test_sigkill_probe_sees_zombies_as_dead() -> None:
    from kvbridge.engine.parallel.shm_segment import is_process_alive

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    # not reaped yet: a zombie, which os.kill(pid, 0) would still report alive
    for _ in range(500):
        if not is_process_alive(pid):
            break
        time.sleep(0.01)
    assert not is_process_alive(pid)
    os.waitpid(pid, 0)
    assert is_process_alive(os.getpid())


def test_files_of_dead_creators_are_swept_when_a_segment_is_created() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # reaped: this pid is gone
    stale = SHM_DIR / f"kvbridge-comm-{pid}-0123456789ab"
    stale.write_bytes(b"left by a group killed while starting")
    mine = ShmSegment(2)  # a live creator's file is never swept
    with ShmSegment(2):
        assert not stale.exists()
        assert (SHM_DIR / mine.name).exists()
    mine.close()
