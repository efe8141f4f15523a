"""`kvbridge bench comm`: all-reduce latency, shared memory vs gloo, in the same run.

For each world size, one `WorkerGroup` of that many processes times both: first the
`ShmCommunicator` it already has, then a gloo process group on 127.0.0.1 set up by the
same processes. Figures are per call, median over rounds, slowest rank; the ratio
column is gloo / shm. Only figures measured in one run should be compared (the machine
is shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvbridge.errors import KVBridgeError
from kvbridge.transfer.netdev import free_port

if TYPE_CHECKING:
    from kvbridge.engine.parallel import WorkerContext, WorkerGroup


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--world-sizes", default="3,9", help="comma-separated process counts (default 3,9)"
    )
    parser.add_argument(
        "--sizes", default="576,4608", help="comma-separated float32 element counts"
    )
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument(
        "--shm-calls", type=int, default=400, help="all-reduces per round, shm (default 400)"
    )
    parser.add_argument(
        "--gloo-calls", type=int, default=40, help="all-reduces per round, gloo (default 40)"
    )
    parser.add_argument("--no-gloo", action="store_true", help="time shared memory only")
    parser.add_argument(
        "--calls", type=int, default=200, help="WorkerGroup.call round trips timed (default 200)"
    )


def _int_list(text: str, field: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise KVBridgeError(f"{field}={text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise KVBridgeError(f"{field}={text!r}: expected integers >= 1, e.g. 3,9")
    return values


def run_comm_bench(args: argparse.Namespace) -> int:
    from kvbridge.engine.parallel import WorkerGroup

    world_sizes = _int_list(args.world_sizes, "--world-sizes")
    sizes = _int_list(args.sizes, "--sizes")
    print(
        f"all-reduce of float32 tensors; per-call latency, median of {args.rounds} rounds, "
        f"slowest rank; shm {args.shm_calls} / gloo {args.gloo_calls} calls per round"
    )
    print(f"{'procs':>5} {'floats':>7} {'shm ms':>9} {'gloo ms':>9} {'gloo/shm':>9}")
    call_ms: dict[int, float] = {}
    for world_size in world_sizes:
        with WorkerGroup(
            world_size,
            "kvbridge.bench.comm:bench_worker",
            comm_max_bytes=max(sizes) * 4,
            call_timeout=600,
        ) as group:
            call_ms[world_size] = _time_calls(group, args.calls)
            spec = {"sizes": sizes, "rounds": args.rounds}
            shm = _slowest(
                group.call("shm", json.dumps({**spec, "calls": args.shm_calls}).encode())
            )
            gloo: dict[str, float] = {}
            if not args.no_gloo:
                group.call("gloo_init", json.dumps({"port": free_port()}).encode())
                gloo = _slowest(
                    group.call("gloo", json.dumps({**spec, "calls": args.gloo_calls}).encode())
                )
            for size in sizes:
                shm_ms = shm[str(size)] * 1e3
                line = f"{world_size:5d} {size:7d} {shm_ms:9.3f}"
                if gloo:
                    gloo_ms = gloo[str(size)] * 1e3
                    line += f" {gloo_ms:9.3f} {gloo_ms / shm_ms:8.1f}x"
                print(line, flush=True)
    for world_size, ms in call_ms.items():
        print(f"WorkerGroup.call round trip (empty payload), {world_size} workers: {ms:.3f} ms")
    return 0


def _time_calls(group: WorkerGroup, calls: int) -> float:
    """Median ms of a driver -> all workers -> driver round trip of an empty call."""
    for _ in range(10):
        group.call("noop", b"{}", ranks=[0])
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        group.call("noop", b"{}", ranks=[0])
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _slowest(replies: list[bytes]) -> dict[str, float]:
    per_rank = [json.loads(r) for r in replies]
    return {size: max(r[size] for r in per_rank) for size in per_rank[0]}


# ---- worker side ------------------------------------------------------------------------


def bench_worker(ctx: WorkerContext) -> None:
    """WorkerGroup target: times all-reduces on request (see `run_comm_bench`)."""
    import os

    import torch
    import torch.distributed as dist

    def timed(all_reduce: Callable[[torch.Tensor], object], spec: dict) -> dict[str, float]:
        result: dict[str, float] = {}
        for size in spec["sizes"]:
            t = torch.zeros(size)  # stays finite however often it is summed
            for _ in range(max(3, spec["calls"] // 10)):  # warm-up
                all_reduce(t)
            rounds = []
            for _ in range(spec["rounds"]):
                start = time.perf_counter()
                for _ in range(spec["calls"]):
                    all_reduce(t)
                rounds.append((time.perf_counter() - start) / spec["calls"])
            result[str(size)] = statistics.median(rounds)
        return result

    def handle(method: str, payload: bytes) -> bytes:
        spec = json.loads(payload)
        if method == "shm":
            return json.dumps(timed(ctx.comm.all_reduce, spec)).encode()
        if method == "gloo_init":
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(spec["port"])
            dist.init_process_group("gloo", rank=ctx.rank, world_size=ctx.world_size)
            return b""
        if method == "noop":
            return b""
        if method == "gloo":
            return json.dumps(timed(dist.all_reduce, spec)).encode()
        raise KeyError(f"unknown method {method!r}")

    try:
        ctx.serve(handle)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
