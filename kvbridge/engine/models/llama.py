"""Llama-family decoder (llama, mistral, qwen2, smollm2), one tensor-parallel worker's shard.

Per layer, on rank r of tp:
  * QKV: column-parallel over heads. Query heads [r*nh/tp, (r+1)*nh/tp); KV heads from
    `kv_head_range` (the planner's rule), replicated when tp > num_kv_heads.
  * o_proj: row-parallel over the same query heads, then all-reduce.
  * gate/up: column-parallel over intermediate features (balanced split), down_proj
    row-parallel over them, then all-reduce.
Embedding and LM head are vocab-parallel; norms are replicated.
The residual/norm order is transformers' LlamaDecoderLayer's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbridge.engine.config import ModelConfig
from kvbridge.engine.kv_cache import KVCache
from kvbridge.engine.layers.attention import AttentionMetadata, PagedAttention
from kvbridge.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding, vocab_range
from kvbridge.engine.layers.linear import ColumnParallelLinear, RowParallelLinear, split_range
from kvbridge.engine.layers.norm import RMSNorm
from kvbridge.engine.layers.rotary import RotaryEmbedding
from kvbridge.engine.parallel.base import Communicator
from kvbridge.engine.weights import WeightSource
from kvbridge.plan.layout import kv_head_range


class LlamaDecoderLayer:
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        source: WeightSource,
        comm: Communicator,
        rotary: RotaryEmbedding,
    ) -> None:
        tp, rank, d = comm.world_size, comm.rank, config.head_dim
        p = f"model.layers.{layer}"
        q0, q1 = split_range(config.num_attention_heads, tp, rank)
        k0, k1 = kv_head_range(config.num_kv_heads, tp, rank)
        self.num_heads, self.num_kv_heads, self.head_dim = q1 - q0, k1 - k0, d
        self.qkv_proj = ColumnParallelLinear.load(
            source,
            [
                (f"{p}.self_attn.q_proj", (q0 * d, q1 * d)),
                (f"{p}.self_attn.k_proj", (k0 * d, k1 * d)),
                (f"{p}.self_attn.v_proj", (k0 * d, k1 * d)),
            ],
            bias=config.attention_bias,
        )
        self.o_proj = RowParallelLinear.load(
            source, f"{p}.self_attn.o_proj", (q0 * d, q1 * d), comm
        )
        i0, i1 = split_range(config.intermediate_size, tp, rank)
        self.gate_up_proj = ColumnParallelLinear.load(
            source,
            [
                (f"{p}.mlp.gate_proj", (i0, i1)),
                (f"{p}.mlp.up_proj", (i0, i1)),
            ],
        )
        self.down_proj = RowParallelLinear.load(source, f"{p}.mlp.down_proj", (i0, i1), comm)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(source.get(f"{p}.input_layernorm.weight"), eps)
        self.post_attention_layernorm = RMSNorm(
            source.get(f"{p}.post_attention_layernorm.weight"), eps
        )
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d)
        self.layer = layer
        self.local_intermediate = i1 - i0

    def __call__(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
        meta: AttentionMetadata,
        local_layer: int,
    ) -> torch.Tensor:
        n = x.shape[0]
        residual = x
        h = self.input_layernorm(x)
        nq, nkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(h).view(n, nq + 2 * nkv, self.head_dim)
        # rotate q and k heads together, and put the rotated k back beside v, so that
        # k and v go to the cache as one [T, 2, kv_heads, head_dim] tensor
        qk = self.rotary(cos_sin, qkv[:, : nq + nkv])
        qkv[:, nq : nq + nkv] = qk[:, nq:]
        kv = qkv[:, nq:].view(n, 2, nkv, self.head_dim)
        h = self.o_proj(self.attn(local_layer, qk[:, :nq], kv, cache, meta))
        x = residual + h
        residual = x
        h = self.post_attention_layernorm(x)
        gate, up = self.gate_up_proj(h).split(self.local_intermediate, dim=-1)
        h = self.down_proj(F.silu(gate) * up)
        return residual + h


class LlamaForCausalLM:
    """One worker's shard of the whole model (pp is not implemented: all layers)."""

    def __init__(self, config: ModelConfig, source: WeightSource, comm: Communicator) -> None:
        self.config = config
        self.comm = comm
        self.embed_tokens = VocabParallelEmbedding.load(
            source, "model.embed_tokens.weight", config.vocab_size, comm
        )
        self.rotary = rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.max_position
        )
        self.layers = [
            LlamaDecoderLayer(config, i, source, comm, rotary) for i in range(config.num_layers)
        ]
        self.norm = RMSNorm(source.get("model.norm.weight"), config.rms_norm_eps)
        if config.tie_word_embeddings or not source.has("lm_head.weight"):
            head = self.embed_tokens.weight
        else:
            start, end = vocab_range(config.vocab_size, comm.world_size, comm.rank)
            rows = source.get("lm_head.weight", 0, start, end)
            head = torch.zeros_like(self.embed_tokens.weight)
            head[: rows.shape[0]] = rows
        self.lm_head = ParallelLMHead(head, config.vocab_size, comm)

    @property
    def num_local_kv_heads(self) -> int:
        return self.layers[0].num_kv_heads

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every input token."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos_sin, cache, meta, i)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, hidden] -> [B, vocab] float32, whole on every rank."""
        return self.lm_head(hidden)
