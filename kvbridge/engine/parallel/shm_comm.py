"""Collectives among the tp workers of one host through a shared-memory segment.

Each rank copies its tensor into its own slot, then the protocol in shm_sync.py (one
arrival flag per rank, two alternating buffers) makes every rank's slot readable to all;
the reading side of each collective is plain numpy over those slots.

Sums run in rank order 0, 1, ..., W-1 on every rank over the same bytes, so every rank
gets bit-identical results, the same on every run; half types accumulate in float32.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from kvbridge.engine.parallel.base import Communicator
from kvbridge.engine.parallel.errors import CommError, CommUsageError
from kvbridge.engine.parallel.shm_segment import SLOT_HEADER_BYTES, map_segment, unlink_segment
from kvbridge.engine.parallel.shm_sync import (
    OP_ALL_GATHER,
    OP_ALL_REDUCE,
    OP_BARRIER,
    OP_BROADCAST,
    OP_CONNECT,
    ShmArrivals,
)

#: dtype -> (code in slot headers, numpy dtype its bytes are moved as)
_DTYPES: dict[torch.dtype, tuple[int, type[np.generic]]] = {
    torch.float32: (1, np.float32),
    torch.bfloat16: (2, np.uint16),  # numpy has no bfloat16: move bits, sum in torch
    torch.float16: (3, np.float16),
    torch.int64: (4, np.int64),
    torch.int32: (5, np.int32),
    torch.uint8: (6, np.uint8),
}


class ShmCommunicator(Communicator):
    """Collectives over the `world_size` processes of one host, through `/dev/shm/<name>`.

    One instance per rank, created in that rank's process with the segment name its
    creator (`ShmSegment` or `make_communicator`) handed out. The constructor waits (up to
    `connect_timeout`) until every rank attached. Tensors: contiguous CPU tensors of
    float32, bfloat16, float16, int64, int32 or uint8, of any size: a tensor larger than
    `max_bytes` (the slot size the segment was made with) goes in slot-sized pieces, one
    collective each. Not thread-safe: one thread per rank calls the collectives.
    After any `CommError` the communicator (and the whole group) is unusable.
    """

    def __init__(
        self,
        name: str,
        rank: int,
        world_size: int,
        *,
        timeout: float = 60.0,
        connect_timeout: float | None = None,
        spin_iters: int | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise CommUsageError(f"rank={rank} is outside [0, world_size={world_size})")
        if timeout <= 0:
            raise CommUsageError(f"timeout={timeout} must be > 0 seconds")
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._mm, layout = map_segment(name, world_size)
        self.max_bytes = layout.slot_bytes
        self._sync = ShmArrivals(
            name, self._mm, layout, rank, timeout=timeout, spin_iters=spin_iters
        )
        self._slot_bytes = [
            [
                np.ndarray(
                    (layout.slot_bytes,),
                    dtype=np.uint8,
                    buffer=self._mm,
                    offset=layout.slot_offset(b, r) + SLOT_HEADER_BYTES,
                )
                for r in range(world_size)
            ]
            for b in range(2)
        ]
        self._typed: dict[tuple[int, torch.dtype], list[np.ndarray]] = {}
        # every rank's float32 slot of buffer b as one [W, floats] array: the common
        # all-reduce (a float32 tensor that fits a slot) is one copy and one numpy reduce
        self._f32_rows = [
            np.ndarray(
                (world_size, layout.slot_bytes // 4),
                dtype=np.float32,
                buffer=self._mm,
                offset=layout.slot_offset(b, 0) + SLOT_HEADER_BYTES,
                strides=(layout.slot_stride, 4),
            )
            for b in range(2)
        ]
        try:
            self._sync.arrive_and_wait(OP_CONNECT, 0, 0, connect_timeout or timeout)
        except BaseException:
            unlink_segment(name)  # the group cannot start: leave no file behind
            self.close()
            raise
        if rank == 0:
            unlink_segment(name)  # every rank has it mapped now

    # ---- public collectives -------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        code = self._check_tensor(tensor, "all_reduce")
        if tensor.dtype == torch.uint8:
            raise CommUsageError("all_reduce of uint8 would overflow; use int32 or int64")
        flat = _flat_numpy(tensor)
        if tensor.dtype == torch.float32 and flat.nbytes <= self.max_bytes:
            rows = self._f32_rows[self._sync.next_buffer][:, : flat.size]
            rows[self.rank] = flat
            self._sync.arrive_and_wait(OP_ALL_REDUCE, flat.nbytes, code)
            # reducing the outer axis adds row after row: rank order, like _sum_in_rank_order
            np.add.reduce(rows, axis=0, out=flat)
            return tensor
        for part in self._chunks(flat):
            views = self._views(tensor.dtype, part.size)
            np.copyto(views[self.rank], part)
            self._sync.arrive_and_wait(OP_ALL_REDUCE, part.nbytes, code)
            _sum_in_rank_order(views, part, tensor.dtype)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        code = self._check_tensor(tensor, "all_gather")
        if tensor.dim() == 0:
            raise CommUsageError("all_gather of a 0-d tensor: unsqueeze it first")
        flat = _flat_numpy(tensor)
        gathered = np.empty((self.world_size, flat.size), dtype=flat.dtype)  # [rank, element]
        start = 0
        for part in self._chunks(flat):
            views = self._views(tensor.dtype, part.size)
            np.copyto(views[self.rank], part)
            self._sync.arrive_and_wait(OP_ALL_GATHER, part.nbytes, code)
            for peer, view in enumerate(views):
                gathered[peer, start : start + part.size] = view
            start += part.size
        shape = tuple(tensor.shape)
        axis = dim % tensor.dim()
        if axis == 0:  # [rank, element] already is the concatenation along dim 0
            out = gathered.reshape((self.world_size * shape[0], *shape[1:]))
        else:
            out = np.concatenate([row.reshape(shape) for row in gathered], axis=axis)
        result = torch.from_numpy(out)
        return result.view(tensor.dtype) if tensor.dtype == torch.bfloat16 else result

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if not 0 <= src < self.world_size:
            raise CommUsageError(f"broadcast src={src} is outside [0, {self.world_size})")
        code = self._check_tensor(tensor, "broadcast")
        for part in self._chunks(_flat_numpy(tensor)):
            views = self._views(tensor.dtype, part.size)
            if self.rank == src:
                np.copyto(views[src], part)
            self._sync.arrive_and_wait(OP_BROADCAST, part.nbytes, code)
            if self.rank != src:
                np.copyto(part, views[src])
        return tensor

    def barrier(self, timeout: float | None = None) -> None:
        """Wait for every rank; `timeout` overrides the communicator's for this call
        (e.g. a barrier after loading weights, which may take long on some ranks)."""
        self._check_usable()
        self._sync.arrive_and_wait(OP_BARRIER, 0, 0, timeout)

    def abort(self, reason: str) -> None:
        """Give up on the group: every rank waiting in (or entering) a collective fails
        with a `PeerAbortedError` quoting `reason`. Call it when this rank will not make
        the collectives its peers expect (e.g. its handler raised). Idempotent."""
        self._sync.abort(reason)

    def close(self) -> None:
        if self._mm.closed:
            return
        # drop every view of the mapping first, or mmap.close() refuses
        self._sync.release()
        self._slot_bytes = []
        self._typed = {}
        self._f32_rows = []
        # BufferError: a caller still holds a view; the mapping goes with the last reference
        with contextlib.suppress(BufferError):
            self._mm.close()

    # ---- protocol -------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._sync.broken is not None:
            raise CommError(f"communicator rank {self.rank} is unusable: {self._sync.broken}")

    def _check_tensor(self, tensor: torch.Tensor, what: str) -> int:
        self._check_usable()
        spec = _DTYPES.get(tensor.dtype)
        if spec is None:
            raise CommUsageError(
                f"{what} of dtype {tensor.dtype} is not supported; use one of "
                f"{', '.join(str(d) for d in _DTYPES)}"
            )
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise CommUsageError(
                f"{what} needs a contiguous CPU tensor, got device={tensor.device} "
                f"contiguous={tensor.is_contiguous()}; call .contiguous() first"
            )
        return spec[0]

    def _views(self, dtype: torch.dtype, numel: int) -> list[np.ndarray]:
        """Every rank's slot in the next collective's buffer, as 1-D arrays of `numel`."""
        key = (self._sync.next_buffer, dtype)
        typed = self._typed.get(key)
        if typed is None:
            np_dtype = _DTYPES[dtype][1]
            typed = [slot.view(np_dtype) for slot in self._slot_bytes[key[0]]]
            self._typed[key] = typed
        return [t[:numel] for t in typed]

    def _chunks(self, flat: np.ndarray) -> list[np.ndarray]:
        """`flat` in slot-sized pieces (views); an empty tensor is one empty piece, so
        every rank still makes the collective."""
        per = self.max_bytes // flat.itemsize
        return [flat[start : start + per] for start in range(0, max(flat.size, 1), per)]


def _sum_in_rank_order(views: list[np.ndarray], out: np.ndarray, dtype: torch.dtype) -> None:
    """out = views[0] + views[1] + ... in this order (half types accumulate in float32)."""
    if dtype == torch.bfloat16:
        acc = torch.from_numpy(views[0]).view(torch.bfloat16).float()
        for view in views[1:]:
            acc.add_(torch.from_numpy(view).view(torch.bfloat16))
        torch.from_numpy(out).view(torch.bfloat16).copy_(acc)
    elif dtype == torch.float16:
        acc32 = views[0].astype(np.float32)
        for view in views[1:]:
            np.add(acc32, view, out=acc32)
        np.copyto(out, acc32, casting="same_kind")
    else:
        np.copyto(out, views[0])
        for view in views[1:]:
            np.add(out, view, out=out)


def _flat_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A 1-D numpy view of a contiguous CPU tensor (bfloat16 as its uint16 bits)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.uint16)
    return tensor.detach().numpy().reshape(-1)
