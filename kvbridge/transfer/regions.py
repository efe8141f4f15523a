"""The cache regions one worker registers with its transport.

A worker's cache is an array in its layout's axis order; the axes before B split it
into regions (`kvbridge.plan.layout.CacheLayout`): none for BHLNC (the whole cache is
one region), one per layer and K/V for LBHNC. Region r is `lengths[r]` bytes at
`addresses[r]`. An engine may allocate the whole cache as one tensor (`from_tensor`,
`from_array`) or its regions apart (vLLM-style per-layer tensors); the wire format and
the transport never assume either, they take one address per region.
"""

from __future__ import annotations

import ctypes
import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.plan.layout import InstanceLayout, WorkerShard, num_regions, region_nbytes
from kvbridge.plan.planner import TransferPlan
from kvbridge.plan.slots import SlotBox, token_slots
from kvbridge.transfer.errors import TransferError


class MemType(enum.Enum):
    DRAM = "DRAM"  # host memory
    VRAM = "VRAM"  # GPU device memory (CUDA; ROCm's HIP devices, which torch names cuda)


def memory_of(device: Any) -> tuple[MemType, int]:
    """NIXL's memory type and device id for memory on torch `device` (its `type` and
    `index`): host memory (cpu) is DRAM 0, a GPU (cuda, ROCm included) VRAM of its
    index; TransferError for any other kind of device."""
    if device.type == "cpu":
        return MemType.DRAM, 0
    if device.type == "cuda":
        return MemType.VRAM, int(device.index or 0)
    raise TransferError(
        f"memory on device {device} cannot be registered with NIXL here; use host memory "
        "(cpu) or a GPU (cuda, ROCm's devices included)"
    )


@dataclass(frozen=True)
class CacheRegions:
    """Addresses and byte lengths of one worker's cache regions, in region order."""

    addresses: tuple[int, ...]
    lengths: tuple[int, ...]
    mem_type: MemType = MemType.DRAM
    device_id: int = 0

    def __post_init__(self) -> None:
        if len(self.addresses) != len(self.lengths) or not self.addresses:
            raise TransferError(
                f"cache regions: {len(self.addresses)} addresses and {len(self.lengths)} "
                "lengths; give one (address, length) per region, at least one"
            )
        if any(n <= 0 for n in self.lengths) or any(a <= 0 for a in self.addresses):
            raise TransferError("cache regions need positive addresses and lengths")

    @property
    def num_regions(self) -> int:
        return len(self.addresses)

    def as_array(self) -> np.ndarray:
        """Nx3 uint64 rows (address, length, device id), NIXL's descriptor form."""
        out = np.empty((self.num_regions, 3), dtype=np.uint64)
        out[:, 0] = self.addresses
        out[:, 1] = self.lengths
        out[:, 2] = self.device_id
        return out

    @classmethod
    def from_array(cls, cache: np.ndarray, num_regions: int = 1) -> CacheRegions:
        """`num_regions` equal regions of a C-contiguous host array (the whole cache)."""
        if not cache.flags.c_contiguous:
            raise TransferError("cache array must be C-contiguous to be registered")
        n = num_regions
        step = cache.nbytes // n
        base = cache.ctypes.data
        return cls(tuple(base + r * step for r in range(n)), (step,) * n, MemType.DRAM, 0)

    @classmethod
    def from_tensor(cls, cache: Any, num_regions: int = 1) -> CacheRegions:
        """`num_regions` equal regions of a contiguous torch tensor holding a worker's
        whole cache (CPU -> DRAM, CUDA -> VRAM on its device)."""
        if not cache.is_contiguous():
            raise TransferError("cache tensor must be contiguous to be registered")
        n = num_regions
        step = cache.numel() * cache.element_size() // n
        base = int(cache.data_ptr())
        mem, dev = memory_of(cache.device)
        return cls(tuple(base + r * step for r in range(n)), (step,) * n, mem, dev)


def worker_shard_checked(
    model: ModelKVSpec,
    layout: InstanceLayout,
    side: str,
    rank: int,
    regions: CacheRegions,
    num_blocks: int,
) -> WorkerShard:
    """Worker `rank`'s shard of its instance, after checking its registered regions have
    the number and size the layout needs (TransferError naming both otherwise)."""
    shard = layout.workers(model, side)[rank]
    want_n = num_regions(model, layout, shard)
    want_len = region_nbytes(model, layout, shard, num_blocks)
    if regions.num_regions != want_n or set(regions.lengths) != {want_len}:
        raise TransferError(
            f"{side} worker {rank} registered {regions.num_regions} regions of "
            f"{sorted(set(regions.lengths))} bytes; its layout "
            f"{layout.cache_layout.name} needs {want_n} regions of {want_len} bytes "
            f"({num_blocks} blocks)"
        )
    return shard


def clear_slots(regions: CacheRegions, boxes: list[SlotBox]) -> None:
    """Zero `boxes` (`kvbridge.plan.slots.token_slots`) of host-memory `regions`, one
    numpy assignment per box; TransferError for device memory, which this process
    cannot write directly, or a box outside its region (an internal bug)."""
    if regions.mem_type is not MemType.DRAM:
        raise TransferError(f"cannot clear slots of a {regions.mem_type.value} cache")
    for box in boxes:
        if box.offset < 0 or box.offset + box.span > regions.lengths[box.region]:
            raise TransferError(
                f"slots at offset {box.offset} (+{box.span} bytes) lie outside region "
                f"{box.region} of {regions.lengths[box.region]} bytes"
            )
        buf = _host_bytes(regions.addresses[box.region], regions.lengths[box.region])
        np.ndarray(box.shape, np.uint8, buf, box.offset, box.strides)[...] = 0


@functools.lru_cache(maxsize=1024)
def _host_bytes(address: int, length: int) -> np.ndarray:
    """The `length` bytes of host memory at `address` as a writable uint8 array (made
    once per region: a pull's tail is dozens of boxes, one per region and half)."""
    raw = (ctypes.c_uint8 * length).from_address(address)
    return np.frombuffer(memoryview(raw).cast("B"), dtype=np.uint8)


def read_end(plan: TransferPlan, num_tokens: int, producer: MemType, consumer: MemType) -> int:
    """Where a decode worker's pull of `num_tokens` tokens stops reading from a producer
    whose cache is in `producer` memory into its own in `consumer` memory:
    `plan.read_end` (the last block whole) from host memory into host memory without a
    cast, the decode worker zeroing its slots past the last token once the bytes are in
    (`tail_slots`); exactly `num_tokens` otherwise (a device cache is not written from
    here, a cast would convert the slots too)."""
    whole = producer is MemType.DRAM and consumer is MemType.DRAM and plan.cast is None
    return plan.read_end(num_tokens) if whole else num_tokens


def tail_slots(
    model: ModelKVSpec,
    layout: InstanceLayout,
    shard: WorkerShard,
    block_ids: Sequence[int] | np.ndarray,
    first_token: int,
    num_tokens: int,
    end: int,
) -> list[SlotBox]:
    """The boxes of slots [num_tokens, end) of a request's last block in `shard`'s cache
    (`block_ids` hold its tokens from the block of `first_token` on); [] where the
    prompt ends on a block boundary or `end` is `num_tokens`."""
    bs = layout.block_size
    last = (num_tokens - 1) // bs - first_token // bs  # index in block_ids
    stop = min(end - (num_tokens - 1) // bs * bs, bs)
    if num_tokens % bs == 0 or end <= num_tokens or not 0 <= last < len(block_ids):
        return []
    return token_slots(model, layout, shard, int(block_ids[last]), num_tokens % bs, stop)
