"""The no-communication floor of a tp decode step, for `kvbridge bench engine --floor`.

`tp` processes start together, each with one rank's shard of the model (the same
weights, KV cache and ops as an engine worker), and run decode steps whose collectives
return at once without exchanging anything (the numbers are wrong, the work is the
same). The slowest rank's time per step is what the tp step would take if the
collectives cost nothing: the share of the cores each rank gets, not communication.

With `leave_core`, each collective instead sleeps 10 microseconds: the rank gives up its
core, as a rank waiting for its peers must when ranks outnumber cores, but still waits
for nobody. That isolates what the switches alone cost on this machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import torch

from kvbridge.engine.parallel.base import Communicator
from kvbridge.engine.parallel.worker_group import worker_context

START_TIMEOUT_S = 600.0
LEAVE_CORE_S = 1e-5


class NoCommunicator(Communicator):
    """Rank `rank` of `world_size` whose collectives exchange nothing: all_reduce leaves
    the tensor as it is, all_gather repeats it (the shapes a real gather gives);
    `leave_core`: each of them first sleeps LEAVE_CORE_S."""

    def __init__(self, world_size: int, rank: int, leave_core: bool = False) -> None:
        self.world_size = world_size
        self.rank = rank
        self.leave_core = leave_core

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.leave_core:
            time.sleep(LEAVE_CORE_S)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.leave_core:
            time.sleep(LEAVE_CORE_S)
        return torch.cat([tensor] * self.world_size, dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        pass


@dataclass(frozen=True)
class FloorJob:
    model_path: Path
    config: Any  # EngineConfig
    rank: int
    context_tokens: int
    steps: int
    leave_core: bool


def _floor_rank(job: FloorJob, barrier: Barrier, out: Any) -> None:
    from kvbridge.engine.model_runner import ModelRunner
    from kvbridge.engine.step import StepBatch

    torch.set_num_threads(job.config.num_threads or 1)
    comm = NoCommunicator(job.config.tp_size, job.rank, job.leave_core)
    runner = ModelRunner(job.model_path, job.config, comm)
    bs = job.config.block_size
    table = list(range((job.context_tokens + job.steps) // bs + 1))

    def step(pos: int) -> StepBatch:
        return StepBatch(
            input_ids=[1],
            positions=[pos],
            slot_mapping=[pos],
            query_lens=[1],
            context_lens=[pos + 1],
            block_tables=[table],
            want_logits=[True],
        )

    runner.execute(step(job.context_tokens))  # warm-up
    barrier.wait(START_TIMEOUT_S)
    t0 = time.perf_counter()
    for i in range(job.steps):
        runner.execute(step(job.context_tokens + i))
    out.put((job.rank, (time.perf_counter() - t0) / job.steps))


def floor_step_s(
    model_path: Path, config: Any, context_tokens: int, steps: int, leave_core: bool = False
) -> float:
    """Seconds per decode step of the slowest of `config.tp_size` ranks computing their
    shards at the same time with free collectives (see the module doc for `leave_core`)."""
    ctx = worker_context()  # torch imported once, in the fork server
    tp = config.tp_size
    barrier = ctx.Barrier(tp)
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_floor_rank,
            args=(FloorJob(model_path, config, r, context_tokens, steps, leave_core), barrier, out),
            daemon=True,
        )
        for r in range(tp)
    ]
    for p in procs:
        p.start()
    try:
        times = [out.get(timeout=START_TIMEOUT_S)[1] for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return max(times)
