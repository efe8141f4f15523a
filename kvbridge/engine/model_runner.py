"""The per-worker half of the engine: one model shard and its KV cache.

`ModelRunner.execute(batch)` is the same code on every tp rank (SPMD); ranks meet only in
the `Communicator` collectives inside the model. The driver (LLMEngine + Scheduler) owns
block allocation and sampling and talks to runners through an `Executor`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvbridge.engine.config import EngineConfig
from kvbridge.engine.errors import EngineError
from kvbridge.engine.kv_cache import KVCache
from kvbridge.engine.layers.attention import AttentionMetadata, SeqSlice
from kvbridge.engine.models.llama import LlamaForCausalLM
from kvbridge.engine.parallel.base import Communicator
from kvbridge.engine.step import STEP_VERSION, RunnerInfo, StepBatch
from kvbridge.engine.weights import Progress, open_weights
from kvbridge.plan.geometry import DTYPE_SIZES


class ModelRunner:
    """Owned by one worker process (or the driver itself when tp_size == 1)."""

    def __init__(
        self,
        model_path: Path,
        config: EngineConfig,
        comm: Communicator,
        progress: Progress | None = None,
        shared_kv: bool = False,
    ) -> None:
        source = open_weights(model_path, progress if comm.rank == 0 else None)
        self.model_config = source.config
        config.check(self.model_config)
        if comm.world_size != config.tp_size:
            raise EngineError(
                f"communicator world_size={comm.world_size} but "
                f"tp_size={config.tp_size}; start one worker per tp rank"
            )
        self.comm = comm
        self.model = LlamaForCausalLM(self.model_config, source, comm)
        mc = self.model_config
        heads = self.model.num_local_kv_heads
        block_bytes = KVCache.block_bytes(
            mc.num_layers, heads, config.block_size, mc.head_dim, DTYPE_SIZES[config.kv_dtype]
        )
        dtype = getattr(torch, config.kv_dtype)  # EngineConfig checked it is one we store
        self.kv_cache = KVCache(
            config.layout(),
            mc.num_layers,
            config.blocks(mc, block_bytes),
            heads,
            mc.head_dim,
            dtype,
            shared=shared_kv,
        )

    def info(self) -> RunnerInfo:
        return RunnerInfo(
            num_blocks=self.kv_cache.num_blocks,
            num_local_kv_heads=self.kv_cache.num_local_heads,
            kv_cache_shape=list(self.kv_cache.tensor.shape),
            vocab_size=self.model_config.vocab_size,
        )

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> np.ndarray:
        """Run one step; logits [sum(want_logits), vocab] (identical on every rank)."""
        if batch.version != STEP_VERSION:
            raise EngineError(f"step version={batch.version}; this worker speaks {STEP_VERSION}")
        input_ids = torch.tensor(batch.input_ids, dtype=torch.int64)
        positions = torch.tensor(batch.positions, dtype=torch.int64)
        seqs = []
        start = 0
        for qlen, ctx, table in zip(
            batch.query_lens, batch.context_lens, batch.block_tables, strict=True
        ):
            seqs.append(SeqSlice(start, qlen, ctx, torch.tensor(table, dtype=torch.int64)))
            start += qlen
        slots = self.kv_cache.slot_index(torch.tensor(batch.slot_mapping, dtype=torch.int64))
        meta = AttentionMetadata(slots, seqs)
        hidden = self.model.forward(input_ids, positions, self.kv_cache, meta)
        rows = [
            s.query_start + s.query_len - 1
            for s, want in zip(seqs, batch.want_logits, strict=True)
            if want
        ]
        if not rows:
            return np.zeros((0, self.model_config.vocab_size), dtype=np.float32)
        logits = self.model.compute_logits(hidden[rows])
        return logits.numpy()
