"""Attention over paged KV blocks.

Each step writes the new tokens' K/V into the cache at `slot_mapping`, then attends every
sequence's queries over its own context gathered from its block table. Sequences are
attended one at a time with torch's SDPA and no padding mask, exactly the call
transformers makes for one sequence (causal for a fresh prompt, unmasked for one query
token), so a batch gives the same numbers as its members run alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbridge.engine.kv_cache import KVCache


@dataclass
class SeqSlice:
    """One sequence's part of a step: queries [query_start, query_start + query_len) of the
    flattened batch; after this step it has `context_len` tokens in blocks `block_ids`."""

    query_start: int
    query_len: int
    context_len: int
    block_ids: torch.Tensor  # int64, the blocks covering [0, context_len)


@dataclass
class AttentionMetadata:
    slots: tuple[torch.Tensor, torch.Tensor]  # (block, offset) [num_tokens] of each new token
    seqs: list[SeqSlice]


class PagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.gqa = num_heads != num_kv_heads

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        kv: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, heads, dim], kv [T, 2 (K, V), kv_heads, dim] -> [T, heads * dim]."""
        cache.write(layer, kv, meta.slots)
        outs = []
        for s in meta.seqs:
            qs = q[s.query_start : s.query_start + s.query_len].transpose(0, 1)  # [h, q, d]
            if s.query_len == s.context_len:
                # A whole prompt: attend to this step's K/V directly (the cache holds a
                # copy, in its own dtype): a prompt's first chunk never depends on it.
                kvs = kv[s.query_start : s.query_start + s.query_len].permute(1, 2, 0, 3)
                ks, vs = kvs[0], kvs[1]  # [kv_heads, q, d]
            else:
                ks, vs = cache.gather(layer, s.block_ids, s.context_len)
                ks, vs = ks.to(q.dtype), vs.to(q.dtype)  # the cache's dtype may be narrower
            mask = None
            causal = s.query_len > 1
            if causal and s.context_len > s.query_len:
                # A later prefill chunk: query i sits at position context_len - query_len + i.
                past = s.context_len - s.query_len
                rows = torch.arange(s.query_len).unsqueeze(1) + past
                mask = torch.arange(s.context_len).unsqueeze(0) <= rows
                causal = False
            o = F.scaled_dot_product_attention(
                qs.unsqueeze(0),
                ks.unsqueeze(0),
                vs.unsqueeze(0),
                attn_mask=mask,
                is_causal=causal,
                scale=self.scale,
                enable_gqa=self.gqa,
            )  # [1, h, q, d]
            outs.append(o[0].transpose(0, 1).reshape(s.query_len, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)
