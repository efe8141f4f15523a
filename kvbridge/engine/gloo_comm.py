"""A `Communicator` over torch.distributed's default (gloo) process group.

The engine's stop-gap for tp > 1 until kvbridge.engine.parallel's shared-memory and
torch.distributed communicators are merged; same interface, so the swap is one line.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kvbridge.engine.parallel.base import Communicator


class GlooCommunicator(Communicator):
    """`Communicator` over the default torch.distributed process group."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor)
        return torch.cat(parts, dim)

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
