"""The collective interface the model layers call.

One `Communicator` per worker process; all workers of a tp group call each collective
in the same order (SPMD). Implementations: a shared-memory one among the workers of
one host (fast on CPU), torch.distributed across hosts, and the trivial one for tp=1.
"""

from __future__ import annotations

import abc

import torch


class Communicator(abc.ABC):
    """Collectives over the `world_size` tensor-parallel workers of one instance.

    Contract: every call is collective (all ranks make it, in the same order, with
    tensors of the same shape and dtype); a call that cannot complete (a peer died)
    raises a `KVBridgeError` subclass within the communicator's timeout, never hangs.
    """

    rank: int
    world_size: int

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` (contiguous, CPU) over all ranks, in place; returns it."""

    @abc.abstractmethod
    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim`, in rank order (a new tensor)."""

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `tensor` on every rank with rank `src`'s, in place; returns it.

        This default goes through `all_gather`; implementations override it."""
        gathered = self.all_gather(tensor.unsqueeze(0), dim=0)
        tensor.copy_(gathered[src])
        return tensor

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release shared resources; idempotent."""


class SingleProcessCommunicator(Communicator):
    """tp_size == 1: every collective is the identity."""

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        return None
