"""Vocab-parallel input embedding and LM head.

The vocabulary is cut into `tp_size` equal partitions of ceil(V / tp) rows (the last one
zero-padded) so that the LM head's all-gather sees equal shapes on every rank:

    rank:        0            1                tp-1
    rows:  [0, P)       [P, 2P)   ...   [(tp-1)P, V) + padding      P = ceil(V / tp)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbridge.engine.parallel.base import Communicator
from kvbridge.engine.weights import WeightSource


def vocab_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """[start, end) of the real (unpadded) vocabulary rows `tp_rank` holds."""
    per = -(-vocab_size // tp_size)
    return min(tp_rank * per, vocab_size), min((tp_rank + 1) * per, vocab_size)


class VocabParallelEmbedding:
    """Embedding lookup of this rank's vocabulary rows; all-reduce assembles the rest.

    Exact: every token's row comes from exactly one rank, the others add zeros.
    """

    def __init__(self, weight: torch.Tensor, vocab_size: int, comm: Communicator) -> None:
        self.comm = comm
        self.vocab_size = vocab_size
        self.start, self.end = vocab_range(vocab_size, comm.world_size, comm.rank)
        per = -(-vocab_size // comm.world_size)
        # Padded to the partition size; padding rows are zeros and never looked up.
        self.weight = torch.zeros(per, weight.shape[1], dtype=weight.dtype)
        self.weight[: weight.shape[0]] = weight

    @classmethod
    def load(
        cls, source: WeightSource, name: str, vocab_size: int, comm: Communicator
    ) -> VocabParallelEmbedding:
        start, end = vocab_range(vocab_size, comm.world_size, comm.rank)
        return cls(source.get(name, 0, start, end), vocab_size, comm)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.start) | (input_ids >= self.end)
        local = (input_ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.comm.all_reduce(out)


class ParallelLMHead:
    """logits = all_gather(h @ W_local^T)[:, :V]; may share the embedding's weight (tied)."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, comm: Communicator) -> None:
        self.weight = weight  # [ceil(V / tp), hidden], padded like VocabParallelEmbedding
        self.vocab_size = vocab_size
        self.comm = comm

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.comm.world_size > 1:
            logits = self.comm.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]
