"""Code that runs inside spawned test processes (imported there by module name).

Two kinds of entry points: `run_scenario` (a raw rank process with a ShmCommunicator,
driven by `run_ranks` in the tests) and WorkerGroup targets (`*_worker(ctx)`).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import signal
import threading
import time
from multiprocessing.connection import Connection

import numpy as np
import torch

from kvbridge.engine.parallel import CommError, ShmCommunicator, WorkerContext

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
}


def rank_input(seed: int, step: int, rank: int, numel: int, dtype: str) -> torch.Tensor:
    """The tensor rank `rank` contributes at `step`; any rank can recompute anyone's."""
    rng = np.random.default_rng([seed, step, rank])
    if dtype == "int64":
        return torch.from_numpy(rng.integers(-1000, 1000, numel, dtype=np.int64))
    values = torch.from_numpy(rng.standard_normal(numel, dtype=np.float32))
    return values.to(DTYPES[dtype])


def reference_sum(inputs: list[torch.Tensor]) -> torch.Tensor:
    """Sum in rank order, half types accumulated in float32: the documented semantics."""
    if inputs[0].dtype in (torch.bfloat16, torch.float16):
        acc = inputs[0].float()
        for t in inputs[1:]:
            acc = acc + t.float()
        return acc.to(inputs[0].dtype)
    acc = inputs[0].clone()
    for t in inputs[1:]:
        acc = acc + t
    return acc


def _stress(comm: ShmCommunicator, args: dict) -> dict:
    """Back-to-back collectives of random kinds and sizes with random per-rank delays;
    checks every result against a reference recomputed from all ranks' inputs."""
    seed, steps, world = args["seed"], args["steps"], comm.world_size
    plan = np.random.default_rng(seed)  # same sequence on every rank: SPMD
    delay = np.random.default_rng([seed, comm.rank, 99])  # differs per rank
    digest = hashlib.sha256()
    failures: list[str] = []
    kinds = {"all_reduce": 0, "all_gather": 0, "broadcast": 0, "barrier": 0}
    for step in range(steps):
        kind = str(plan.choice(list(kinds)))
        numel = int(plan.choice([1, 7, 576, 4608, int(plan.integers(1, 20000))]))
        dtype = str(plan.choice(["float32", "float32", "bfloat16", "float16", "int64"]))
        src = int(plan.integers(0, world))
        r = delay.random()
        if r < 0.1:
            time.sleep(delay.random() * 0.002)
        elif r < 0.4:
            os.sched_yield()
        kinds[kind] += 1
        mine = rank_input(seed, step, comm.rank, numel, dtype)
        if kind == "barrier":
            comm.barrier()
            continue
        inputs = [rank_input(seed, step, j, numel, dtype) for j in range(world)]
        if kind == "all_reduce":
            got = comm.all_reduce(mine)
            want = reference_sum(inputs)
        elif kind == "all_gather":
            got = comm.all_gather(mine.view(1, -1), dim=step % 2 - 1)
            want = torch.cat([t.view(1, -1) for t in inputs], dim=step % 2 - 1)
        else:
            got = comm.broadcast(mine, src=src)
            want = inputs[src]
        if got.dtype != want.dtype or not torch.equal(
            got.view(torch.uint8), want.view(torch.uint8)
        ):
            failures.append(f"step {step} {kind} numel={numel} {dtype}")
        digest.update(got.contiguous().view(torch.uint8).numpy().tobytes())
    return {"failures": failures, "digest": digest.hexdigest(), "kinds": kinds}


def _kill(comm: ShmCommunicator, args: dict) -> dict:
    """Rank `victim` SIGKILLs itself at step `at` while the others are in all_reduce."""
    t = torch.ones(576)
    for step in range(args["steps"]):
        if comm.rank == args["victim"] and step == args["at"]:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            comm.all_reduce(t)
        except CommError as exc:
            # a later collective must refuse at once, not wait again
            try:
                comm.barrier()
                again = "barrier passed"
            except CommError as exc2:
                again = type(exc2).__name__
            return {
                "step": step,
                "type": type(exc).__name__,
                "message": str(exc),
                "rank_attr": getattr(exc, "rank", None),
                "again": again,
            }
    return {"step": None}


def _mismatch(comm: ShmCommunicator, args: dict) -> dict:
    t = torch.ones(16)
    try:
        if comm.rank == args["odd_rank"]:
            comm.all_gather(t)
        else:
            comm.all_reduce(t)
    except CommError as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None}


def _skip(comm: ShmCommunicator, args: dict) -> dict:
    """Rank `skipper` stays alive but makes no collective: the others time out."""
    if comm.rank == args["skipper"]:
        time.sleep(args["sleep"])
        return {"type": None}
    try:
        comm.barrier()
    except CommError as exc:
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "missing": getattr(exc, "missing_ranks", None),
        }
    return {"type": None}


SCENARIOS = {"stress": _stress, "kill": _kill, "mismatch": _mismatch, "skip": _skip}


def run_scenarios(
    plan_json: str, shm_names: list[str], rank: int, world_size: int, conn: Connection
) -> None:
    """Run scenarios one after another, each on a fresh communicator (segment), sending
    each result as it is known; plan_json is a list of [scenario, args]."""
    torch.set_num_threads(1)
    for (scenario, args), shm_name in zip(json.loads(plan_json), shm_names, strict=True):
        comm = ShmCommunicator(shm_name, rank, world_size, timeout=args.get("timeout", 30.0))
        try:
            result = SCENARIOS[scenario](comm, args)
        finally:
            comm.close()
        conn.send_bytes(json.dumps(result).encode())
    conn.close()


# ---- WorkerGroup targets --------------------------------------------------------------


def echo_worker(ctx: WorkerContext) -> None:
    """Serves: echo, sum (all_reduce of rank+1 over the group), raise, exit, sleep,
    stress, pid, frozen, env (a variable's value in the worker)."""
    prefix = ctx.init_payload
    ctx.report_progress(f"init with {len(prefix)} bytes")

    def handle(method: str, payload: bytes) -> bytes:
        if method == "echo":
            return prefix + f"|{ctx.rank}|".encode() + payload
        if method == "sum":
            t = torch.full((int(payload),), float(ctx.rank + 1))
            ctx.comm.all_reduce(t)
            return t.numpy().tobytes()
        if method == "raise":
            if ctx.rank == int(payload):
                raise ValueError(f"boom from rank {ctx.rank}")
            ctx.comm.all_reduce(torch.ones(8))  # peers wait for the failing rank here
            return b"unreachable"
        if method == "exit":
            if ctx.rank == int(payload):
                os._exit(7)
            ctx.comm.all_reduce(torch.ones(8))
            return b"unreachable"
        if method == "sleep":
            time.sleep(float(payload))
            return b"slept"
        if method == "stress":
            return json.dumps(SCENARIOS["stress"](ctx.comm, json.loads(payload))).encode()
        if method == "pid":
            return str(os.getpid()).encode()
        if method == "frozen":  # objects kept out of garbage collections (kvbridge.heap)
            return str(gc.get_freeze_count()).encode()
        if method == "env":
            return os.environ.get(payload.decode(), "<unset>").encode()
        raise KeyError(f"unknown method {method!r}")

    ctx.serve(handle)


def failing_init_worker(ctx: WorkerContext) -> None:
    if ctx.rank == 1:
        raise RuntimeError("cannot load weights on rank 1")
    ctx.serve(lambda method, payload: b"")


def one_rank_fails_init_worker(ctx: WorkerContext) -> None:
    """Rank 1 fails to start (the root cause) and its process lingers 3 s after saying
    so; the others, waiting for it in a collective, die at once without a word (as a
    process the kernel kills would), so the driver sees their deaths first."""
    if ctx.rank == 1:
        threading.Thread(target=time.sleep, args=(3.0,)).start()  # delays the exit
        raise RuntimeError("cannot load weights on rank 1")
    try:
        ctx.comm.all_reduce(torch.ones(8))
    except CommError:
        os._exit(1)
    ctx.serve(lambda method, payload: b"")


def factory_scenario(rank: int, world_size: int, ports: list[int], conn: Connection) -> None:
    """make_communicator under torchrun-like environments: one host, then "many hosts"."""
    from kvbridge.engine.parallel import make_communicator

    torch.set_num_threads(1)
    results = []
    for local_world_size, port in zip((world_size, 1), ports, strict=True):
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(local_world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        comm = make_communicator(timeout=60.0)
        t = torch.full((5,), float(rank + 1))
        comm.all_reduce(t)
        gathered = comm.all_gather(torch.full((2,), float(rank)), dim=0)
        b = comm.broadcast(torch.full((3,), float(rank)), src=world_size - 1)
        comm.barrier()
        results.append(
            {
                "type": type(comm).__name__,
                "rank": comm.rank,
                "sum": t.tolist(),
                "gathered": gathered.tolist(),
                "broadcast": b.tolist(),
            }
        )
        comm.close()
    conn.send_bytes(json.dumps(results).encode())
    conn.close()
