"""Sampling parameters and the sampler (driver side, on the gathered float32 logits).

Greedy is argmax (ties to the lowest id, like torch.argmax and transformers), also for a
temperature below `GREEDY_BELOW` (dividing logits by it would overflow float32 and turn
the probabilities into NaN). Otherwise:
logits / temperature, then top-k, then top-p (smallest set whose probability reaches p),
then one draw from the request's own seeded torch.Generator, so a seed reproduces a
completion whatever else is batched with it.
"""

from __future__ import annotations

import numpy as np
import torch

from kvbridge.engine.sampling_params import GREEDY_BELOW, SEED_MAX, SEED_MIN, SamplingParams

__all__ = ["GREEDY_BELOW", "SEED_MAX", "SEED_MIN", "SamplingParams", "make_generator", "sample"]


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.is_greedy:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed if params.seed is not None else int(torch.seed() % 2**63))
    return g


def sample(logits: np.ndarray, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from one row of logits ([vocab] float32)."""
    if params.is_greedy:
        return int(np.argmax(logits))
    x = torch.from_numpy(np.array(logits, dtype=np.float32)) / params.temperature
    if params.top_k and params.top_k < x.shape[0]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, -1)
        # Keep a token if the mass before it is < top_p (the first one always stays).
        drop = (torch.cumsum(probs, -1) - probs) >= params.top_p
        x = x.index_fill(0, order[drop], float("-inf"))
    probs = torch.softmax(x, -1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
