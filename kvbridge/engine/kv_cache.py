"""One worker's paged KV cache: a single contiguous tensor, as the transfer layer expects.

Shape ``[num_local_layers, 2 (K, V), *region_shape(layout, num_blocks, local_heads, head_dim)]``
so region r = local_layer * 2 + kv is ``cache.view(-1, *region_shape)[r]`` (see
kvbridge.plan.layout). A token's slot is ``block_id * block_size + offset``:

    HND region: [num_blocks, heads, block_size, head_dim]   slot -> [block, :, offset, :]
    NHD region: [num_blocks, block_size, heads, head_dim]   slot -> [block, offset, :, :]

The tensor is allocated and zero-filled (touched) up front: copying into never-touched
pages runs at a tenth of the speed on this machine. Its memory comes from numpy, which
asks the kernel for transparent huge pages on large arrays (torch's CPU allocator does
not): NIXL reads a cache between processes page by page (UCX's CMA transport). Huge
pages made those reads 1.5x faster in `kvbridge bench transfer` (scattered 8 KiB runs
and one 256 MiB read alike), and a 1960-token prompt's KV pull in `kvbridge serve`
(prefill tp 1 -> decode tp 3, 90 MB) went from 67 to 57-59 ms (medians).
"""

from __future__ import annotations

import numpy as np
import torch

from kvbridge.plan.layout import CacheLayout, InstanceLayout, region_shape


class KVCache:
    """Owned by one worker's ModelRunner; only that worker's thread touches it."""

    def __init__(
        self,
        layout: InstanceLayout,
        num_layers: int,
        num_blocks: int,
        num_local_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.num_blocks = num_blocks
        self.is_hnd = layout.cache_layout is CacheLayout.HND
        self.region_shape = region_shape(layout, num_blocks, num_local_heads, head_dim)
        # numpy's unsigned integers of the same width, viewed as `dtype`; fill_ writes
        # every page (np.zeros may get lazily-mapped zero pages)
        raw = np.empty((num_layers, 2, *self.region_shape), dtype=f"u{dtype.itemsize}")
        self.tensor = torch.from_numpy(raw).view(dtype)
        self.tensor.fill_(0)
        self.num_local_heads = num_local_heads
        self.head_dim = head_dim

    @staticmethod
    def block_bytes(
        num_layers: int, num_local_heads: int, block_size: int, head_dim: int, itemsize: int
    ) -> int:
        """Bytes one block takes over all layers, K and V, of one worker."""
        return num_layers * 2 * num_local_heads * block_size * head_dim * itemsize

    def slot_index(self, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of each slot; computed once per step, used by every layer."""
        blocks = torch.div(slot_mapping, self.block_size, rounding_mode="floor")
        return blocks, slot_mapping - blocks * self.block_size

    def write(self, layer: int, kv: torch.Tensor, slots: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Store K and V (`kv`: [T, 2, heads, head_dim]) of T tokens at their (block, offset)
        slots, both in one indexed copy."""
        blocks, offsets = slots
        both = self.tensor[layer]  # [2, *region_shape]
        if self.is_hnd:
            # [2, blocks, heads, bs, dim][:, b, :, o]: advanced dims first -> [T, 2, heads, dim]
            both[:, blocks, :, offsets] = kv
        else:
            # [2, blocks, bs, heads, dim][:, b, o]: adjacent advanced dims -> [2, T, heads, dim]
            both[:, blocks, offsets] = kv.transpose(0, 1)

    def gather(
        self, layer: int, block_ids: torch.Tensor, context_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a sequence's first `context_len` tokens, each [heads, context_len, head_dim]."""
        blocks = self.tensor[layer].index_select(1, block_ids)  # K and V in one gather
        if self.is_hnd:  # [2, n, heads, bs, dim] -> [2, heads, n * bs, dim]
            x = blocks.transpose(1, 2).reshape(2, self.num_local_heads, -1, self.head_dim)
            x = x[:, :, :context_len]
        else:  # [2, n, bs, heads, dim] -> [2, n * bs, heads, dim] -> [2, heads, ctx, dim]
            x = blocks.reshape(2, -1, self.num_local_heads, self.head_dim)
            x = x[:, :context_len].transpose(1, 2)
        return x[0], x[1]
