"""Sampling parameters and the sampler (driver side, on the gathered float32 logits).

Greedy is argmax (ties to the lowest id, like torch.argmax and transformers), also for a
temperature below `GREEDY_BELOW` (dividing logits by it would overflow float32 and turn
the probabilities into NaN). Otherwise:
logits / temperature, then top-k, then top-p (smallest set whose probability reaches p),
then one draw from the request's own seeded torch.Generator, so a seed reproduces a
completion whatever else is batched with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvbridge.engine.errors import RequestError

#: Temperatures below this sample greedily (vLLM's threshold too).
GREEDY_BELOW = 1e-5
#: The seeds torch.Generator.manual_seed takes (negative ones are mapped to positive).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise RequestError(f"max_tokens={self.max_tokens!r} must be a positive integer")
        if not self.temperature >= 0:  # NaN too
            raise RequestError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise RequestError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must be non-empty")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise RequestError(
                f"seed={self.seed} is outside [{SEED_MIN}, {SEED_MAX}]; use a 64-bit seed"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


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
