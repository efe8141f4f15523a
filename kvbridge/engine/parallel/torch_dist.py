"""Collectives through torch.distributed (gloo on CPU, NCCL on CUDA), for tp groups that
span hosts or run under torchrun; and `make_communicator`, which picks the right kind."""

from __future__ import annotations

import datetime
import enum
import os

import torch
import torch.distributed as dist

from kvbridge.engine.parallel.base import Communicator, SingleProcessCommunicator
from kvbridge.engine.parallel.errors import CommError, CommUsageError
from kvbridge.engine.parallel.shm_comm import ShmCommunicator
from kvbridge.engine.parallel.shm_segment import (
    DEFAULT_MAX_BYTES,
    create_segment_file,
    unlink_segment,
)

_NAME_BYTES = 128


class CommKind(enum.Enum):
    AUTO = "auto"  # shared memory when every rank is on this host (and on CPU), else torch
    SHM = "shm"
    TORCH = "torch"


class TorchDistCommunicator(Communicator):
    """A `Communicator` over the default torch.distributed process group.

    Initialises the group from the environment (`env://`: MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE, as torchrun sets them) unless one is already initialised; destroys it on
    `close()` only if it created it. Collective failures surface as `CommError`; the
    wait bound is the process group's timeout.
    """

    def __init__(
        self,
        *,
        backend: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        timeout: float = 60.0,
    ) -> None:
        self._owns_group = False
        if not dist.is_initialized():
            backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
            try:
                dist.init_process_group(
                    backend,
                    init_method="env://",
                    rank=-1 if rank is None else rank,
                    world_size=-1 if world_size is None else world_size,
                    timeout=datetime.timedelta(seconds=timeout),
                )
            except (RuntimeError, ValueError) as exc:
                raise CommError(
                    f"torch.distributed init ({backend}) failed: {exc}; set MASTER_ADDR, "
                    "MASTER_PORT, RANK and WORLD_SIZE (torchrun does)"
                ) from exc
            self._owns_group = True
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            dist.all_reduce(tensor)
        except RuntimeError as exc:
            raise CommError(f"rank {self.rank}: all_reduce failed: {exc}") from exc
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        try:
            dist.all_gather(parts, tensor.contiguous())
        except RuntimeError as exc:
            raise CommError(f"rank {self.rank}: all_gather failed: {exc}") from exc
        return torch.cat(parts, dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        try:
            dist.broadcast(tensor, src)
        except RuntimeError as exc:
            raise CommError(f"rank {self.rank}: broadcast failed: {exc}") from exc
        return tensor

    def barrier(self) -> None:
        try:
            dist.barrier()
        except RuntimeError as exc:
            raise CommError(f"rank {self.rank}: barrier failed: {exc}") from exc

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise CommUsageError(f"environment variable {name}={value!r} is not an integer") from None


def make_communicator(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    kind: CommKind = CommKind.AUTO,
    shm_name: str | None = None,
    timeout: float = 60.0,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Communicator:
    """The communicator of this process's tp group.

    - world_size 1: `SingleProcessCommunicator`.
    - `shm_name` given (a `ShmSegment` made by a driver, as `WorkerGroup` does): attach.
    - otherwise rank/world_size default to RANK/WORLD_SIZE (torchrun). With kind AUTO,
      shared memory is used when LOCAL_WORLD_SIZE == WORLD_SIZE and no GPU is present:
      torch.distributed (gloo) only carries the segment's name from rank 0, then is
      torn down. Else a `TorchDistCommunicator`.
    """
    rank = _env_int("RANK") if rank is None else rank
    world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
    rank, world_size = rank or 0, world_size or 1
    if world_size == 1:
        return SingleProcessCommunicator()
    if shm_name is not None:
        return ShmCommunicator(shm_name, rank, world_size, timeout=timeout)
    if kind == CommKind.AUTO:
        local = _env_int("LOCAL_WORLD_SIZE") == world_size
        kind = CommKind.SHM if local and not torch.cuda.is_available() else CommKind.TORCH
    if kind == CommKind.TORCH:
        return TorchDistCommunicator(rank=rank, world_size=world_size, timeout=timeout)
    return _shm_via_torch_rendezvous(rank, world_size, timeout, max_bytes)


def _shm_via_torch_rendezvous(
    rank: int, world_size: int, timeout: float, max_bytes: int
) -> ShmCommunicator:
    rendezvous = TorchDistCommunicator(
        backend="gloo", rank=rank, world_size=world_size, timeout=timeout
    )
    name = create_segment_file(world_size, max_bytes) if rank == 0 else ""
    try:
        # the name travels as raw bytes in a tensor: nothing is pickled
        raw = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
        raw[: len(name)] = torch.tensor(list(name.encode()), dtype=torch.uint8)
        rendezvous.broadcast(raw, src=0)
        name = bytes(raw.tolist()).rstrip(b"\0").decode()
        return ShmCommunicator(name, rank, world_size, timeout=timeout)
    finally:
        if rank == 0:
            unlink_segment(name)  # normally done already once every rank attached
        rendezvous.close()
