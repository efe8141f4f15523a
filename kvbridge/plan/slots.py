"""The bytes of some token slots of one block in a worker's cache, as strided boxes.

A worker's cache is an array in its layout's axis order (`CacheLayout`); the axes
before B split it into regions. The slots [first, last) of block `block_id` are, in each
region and K/V half, one box over the region's other axes with N cut to those slots:

    LBHKNC:K=CN (vLLM CPU), one region per layer, slots [16, 32) of block 5:
        K half: offset 5*stride_B + 0*stride_K + 16*stride_N, shape H x 1 x C x 16 x itemsize
        V half: offset 5*stride_B + 1*stride_K + 16*stride_N, shape H x 1 x 16 x C x itemsize

A box's last axis is one element's bytes (stride 1), so a box is dtype-agnostic: an
engine, or the transfer runtime over registered memory, sets it with one numpy
assignment per region and half (`kvbridge.transfer.regions.clear_slots`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvbridge.errors import LayoutError
from kvbridge.plan.geometry import DTYPE_SIZES, ModelKVSpec
from kvbridge.plan.layout import InstanceLayout, WorkerShard, cache_extents, cache_strides


@dataclass(frozen=True)
class SlotBox:
    """A strided box of bytes in region `region`: `shape` and byte `strides` from byte
    `offset` (the last axis: one element's bytes, stride 1)."""

    region: int
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def span(self) -> int:
        """Bytes from `offset` to the box's last byte, inclusive."""
        return 1 + sum((n - 1) * s for n, s in zip(self.shape, self.strides, strict=True))


def token_slots(
    model: ModelKVSpec,
    layout: InstanceLayout,
    shard: WorkerShard,
    block_id: int,
    first: int,
    last: int,
) -> list[SlotBox]:
    """The boxes holding slots [first, last) of block `block_id` in `shard`'s cache: every
    layer, head, K/V half and channel it holds; one box per region and half."""
    if not 0 <= first < last <= layout.block_size or block_id < 0:
        raise LayoutError(
            f"slots [{first}, {last}) of block {block_id}: need a block id >= 0 and "
            f"0 <= first < last <= block_size={layout.block_size}"
        )
    ext = cache_extents(model, shard, layout.block_size, 1)
    itemsize = DTYPE_SIZES[layout.kv_dtype(model)]
    boxes = []
    for kv in range(model.num_kv_tensors):
        strides = cache_strides(model, layout, shard, kv)
        order = layout.cache_layout.axis_order(kv)
        cut = order.index("B")
        outer, inner = order[:cut], order[cut + 1 :]
        pick = {"N": (first, last - first), "K": (kv, 1)}  # axis -> (first index, extent)
        shape = (*(pick.get(a, (0, ext[a]))[1] for a in inner), itemsize)
        steps = (*(strides[a][1] for a in inner), 1)
        offset = block_id * strides["B"][1] + sum(
            pick[a][0] * strides[a][1] for a in inner if a in pick
        )
        # every region of this half: its region axes' indices, K's fixed at the half
        ranges = [[kv] if a == "K" else range(ext[a]) for a in outer]
        for idx in itertools.product(*ranges):
            region = sum(i * strides[a][0] for a, i in zip(outer, idx, strict=True))
            boxes.append(SlotBox(region, offset, shape, steps))
    return boxes
