"""One worker's paged KV cache: a single contiguous tensor in the instance's cache layout.

The tensor's axes follow `InstanceLayout.cache_layout` (`kvbridge.plan.layout.CacheLayout`:
B block, L layer, K K/V, H head, N token within block, C channel), so the transfer layer
can register it as the planner's regions. Attention never depends on the order: it
works on one strided view of the same memory,

    heads = tensor.permute(...)    [L, K (2), H, B, N, C]
    heads[layer]                   [2, H, B, N, C]   slot -> [:, :, block, offset, :]

Gathering a sequence's blocks along B of that view yields [2, H, blocks, N, C], already
each head's tokens in order (a free reshape to [2, H, tokens, C]). index_select gathers
from the strided view in one pass; selecting along B of a [2, B, H, N, C] view and then
transposing was several times slower, most for the cross-layer layouts
(docs/benchmarks.md).

A token's slot is ``block_id * block_size + offset``.

The cache keeps K and V in its own dtype (`EngineConfig.kv_dtype`, as vLLM's
kv_cache_dtype): the model computes in its dtype, `write` casts what it stores and
attention casts what `gather` returns back.

The tensor is allocated and zero-filled (touched) up front: copying into never-touched
pages is several times slower (docs/benchmarks.md). Its memory comes from numpy, which
asks the kernel for transparent huge pages on large arrays (torch's CPU allocator does
not): NIXL reads a cache between processes page by page (UCX's CMA transport), and
huge pages make those reads faster (docs/benchmarks.md). With `shared`, the memory is a
shared-memory segment instead (the transfer runtime's `SharedSegment`, reached through
`kvbridge.connector`), which a KV export process maps read-only so that peers never read
this worker's own memory; it gets no huge pages where the host keeps them off shared
memory (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvbridge.plan.layout import InstanceLayout

if TYPE_CHECKING:
    from kvbridge.connector import SharedSegment


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
        shared: bool = False,
    ) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.num_blocks = num_blocks
        order = layout.cache_layout
        shape = order.shape(
            {
                "B": num_blocks,
                "L": num_layers,
                "K": 2,
                "H": num_local_heads,
                "N": layout.block_size,
                "C": head_dim,
            }
        )
        self.segment: SharedSegment | None = None
        if shared:
            from kvbridge.connector import SharedSegment

            nbytes = int(np.prod(shape)) * dtype.itemsize
            self.segment = SharedSegment(nbytes)  # zero-filled, every page touched
            raw = self.segment.array.view(f"u{dtype.itemsize}").reshape(shape)
            self.tensor = torch.from_numpy(raw).view(dtype)
        else:
            # numpy's unsigned integers of the same width, viewed as `dtype`; fill_
            # writes every page (np.zeros may get lazily-mapped zero pages)
            raw = np.empty(shape, dtype=f"u{dtype.itemsize}")
            self.tensor = torch.from_numpy(raw).view(dtype)
            self.tensor.fill_(0)
        self.heads = self.tensor.permute(order.permutation("LKHBNC"))  # strided view
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
        slots, both in one indexed copy, cast to the cache's dtype (round to nearest even)
        where it differs from the model's."""
        blocks, offsets = slots
        # [2, heads, B, bs, dim][:, :, b, o]: adjacent advanced dims -> [2, heads, T, dim]
        self.heads[layer][:, :, blocks, offsets] = kv.permute(1, 2, 0, 3).to(self.tensor.dtype)

    def gather(
        self, layer: int, block_ids: torch.Tensor, context_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a sequence's first `context_len` tokens, each [heads, context_len, head_dim]."""
        blocks = self.heads[layer].index_select(2, block_ids)  # [2, heads, n, bs, dim]
        x = blocks.view(2, self.num_local_heads, -1, self.head_dim)[:, :, :context_len]
        return x[0], x[1]
