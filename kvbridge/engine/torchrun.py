"""Running the engine under torchrun: rank 0 drives, every rank holds a shard.

`kvbridge generate --tp N` started by ``torchrun --nproc-per-node N`` (or
``python -m torch.distributed.run``): rank 0 builds the LLMEngine with a
`DistributedExecutor`, which broadcasts each StepBatch (msgspec bytes in a uint8 tensor)
before running its own shard; ranks > 0 run `serve_worker`. The empty message stops them.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from kvbridge.engine.config import EngineConfig
from kvbridge.engine.errors import WorkerError
from kvbridge.engine.executor import Executor
from kvbridge.engine.model_runner import ModelRunner
from kvbridge.engine.parallel.torch_dist import TorchDistCommunicator
from kvbridge.engine.step import StepBatch, encode, step_decoder
from kvbridge.engine.weights import Progress

#: Largest step message accepted (a 4096-token prefill is ~100 KiB).
MAX_MESSAGE_BYTES = 64 << 20


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


class DistributedExecutor(Executor):
    """torchrun rank 0's executor: broadcasts each StepBatch, runs its own shard.

    Ranks > 0 run `serve_worker`. Their failures surface as a gloo timeout or error here.
    """

    def __init__(
        self, model_path: Path, config: EngineConfig, progress: Progress | None = None
    ) -> None:
        _init_from_env(config)
        self.comm = TorchDistCommunicator()
        self.runner = ModelRunner(model_path, config, self.comm, progress)
        self.info = self.runner.info()

    def execute(self, batch: StepBatch) -> np.ndarray:
        _broadcast_bytes(encode(batch))
        return self.runner.execute(batch)

    def close(self) -> None:
        if dist.is_initialized():
            _broadcast_bytes(b"")
            self.comm.close()


def serve_worker(model_path: Path, config: EngineConfig) -> None:
    """torchrun ranks > 0: follow rank 0's steps until it broadcasts the empty message."""
    _init_from_env(config)
    comm = TorchDistCommunicator()
    runner = ModelRunner(model_path, config, comm)
    while True:
        data = _broadcast_bytes(None)
        if not data:
            break
        runner.execute(step_decoder.decode(data))
    comm.close()


def _init_from_env(config: EngineConfig) -> None:
    world = int(os.environ["WORLD_SIZE"])
    if world != config.tp_size:
        raise WorkerError(
            f"torchrun WORLD_SIZE={world} but tp_size={config.tp_size}; "
            f"pass --tp {world} or --nproc-per-node {config.tp_size}"
        )
    torch.set_num_threads(config.torch_threads())
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=config.worker_timeout_s))


def _broadcast_bytes(data: bytes | None) -> bytes:
    """Rank 0 sends `data`; every rank returns it (length first, then a uint8 tensor)."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, 0)
    n = int(size.item())
    if n == 0:
        return b""
    if n > MAX_MESSAGE_BYTES:
        raise WorkerError(f"step message of {n} bytes exceeds {MAX_MESSAGE_BYTES}")
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data is not None
        else torch.empty(n, dtype=torch.uint8)
    )
    dist.broadcast(buf, 0)
    return bytes(buf.numpy()) if data is None else data
