"""make_communicator: the right kind for the environment, the same results either way."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
import torch

from kvbridge.engine.parallel import (
    CommUsageError,
    ShmSegment,
    SingleProcessCommunicator,
    make_communicator,
)
from kvbridge.engine.parallel.shm_segment import SHM_DIR
from kvbridge.engine.parallel.worker import Kind, decode_frame, encode_frame
from kvbridge.transfer.netdev import free_port
from tests.parallel.workers import factory_scenario


def test_single_process_and_explicit_segment() -> None:
    comm = make_communicator(rank=0, world_size=1)
    assert isinstance(comm, SingleProcessCommunicator)
    t = torch.arange(4.0)
    assert comm.broadcast(comm.all_reduce(t), src=0) is t
    with ShmSegment(1) as segment:
        # world_size 1 never needs a segment, even if given one
        assert isinstance(
            make_communicator(rank=0, world_size=1, shm_name=segment.name),
            SingleProcessCommunicator,
        )


def test_env_values_must_be_integers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "three")
    with pytest.raises(CommUsageError, match="WORLD_SIZE='three'"):
        make_communicator()


@pytest.mark.slow
def test_torchrun_environment_picks_shm_on_one_host_and_torch_otherwise() -> None:
    ctx = mp.get_context("spawn")
    world_size = 3
    ports = [free_port(), free_port()]
    procs, conns = [], []
    for rank in range(world_size):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=factory_scenario, args=(rank, world_size, ports, child))
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    try:
        results = []
        for conn in conns:
            assert conn.poll(120), "a rank gave no result"
            results.append(json.loads(conn.recv_bytes()))
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    for rank, (shm, dist) in enumerate(results):
        assert shm["type"] == "ShmCommunicator" and dist["type"] == "TorchDistCommunicator"
        for res in (shm, dist):
            assert res["rank"] == rank
            assert res["sum"] == [6.0] * 5
            assert res["gathered"] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
            assert res["broadcast"] == [2.0] * 3
    # rank 0 created the segment (named after its pid); nothing of it is left
    assert not list(SHM_DIR.glob(f"kvbridge-comm-{procs[0].pid}-*"))


def test_frames_round_trip_and_refuse_garbage() -> None:
    frame = encode_frame(Kind.CALL, 42, "step", b"\x00payload")
    assert decode_frame(frame) == (Kind.CALL, 42, "step", b"\x00payload")
    assert decode_frame(encode_frame(Kind.STOP)) == (Kind.STOP, 0, "", b"")
    with pytest.raises(ValueError, match="shorter than"):
        decode_frame(b"\x01")
    with pytest.raises(ValueError, match="method is"):
        decode_frame(frame[:18])
