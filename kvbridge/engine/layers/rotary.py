"""Rotary position embedding in the "rotate halves" (NeoX / transformers) convention.

cos/sin are precomputed for every position with transformers' formula
(freqs = position * inv_freq in float32, emb = cat(freqs, freqs)), then indexed.

transformers computes ``x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = cat(-x2, x1)``. We compute ``x * cos + roll(x, half) * sin_signed``
with ``roll(x, half) = cat(x2, x1)`` and ``sin_signed = cat(-sin1, sin2)``: negating a
factor negates the product exactly in IEEE arithmetic, so the results are bit-identical
with two ops fewer, and q and k heads are rotated in one pass.
"""

from __future__ import annotations

import torch


class RotaryEmbedding:
    def __init__(self, head_dim: int, theta: float, max_position: int) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (theta**exponents)
        positions = torch.arange(max_position, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq  # [max_position, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.half = head_dim // 2
        self.cos = emb.cos()  # [max_position, head_dim]
        sin = emb.sin()
        self.sin_signed = torch.cat((-sin[:, : self.half], sin[:, self.half :]), dim=-1)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for `positions`, each [T, 1, head_dim]; looked up once per step."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    def __call__(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] (any heads, e.g. q and k side by side) -> a rotated copy."""
        cos, sin_signed = cos_sin
        return x * cos + x.roll(self.half, dims=-1) * sin_signed
