"""Rotary position embedding in the "rotate halves" (NeoX / transformers) convention.

cos/sin are precomputed for every position with transformers' formula
(freqs = position * inv_freq in float32, emb = cat(freqs, freqs)), then indexed.
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
        self.cos = emb.cos()  # [max_position, head_dim]
        self.sin = emb.sin()
        self.half = head_dim // 2

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions`, each [T, 1, head_dim]; looked up once per step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def __call__(
        self, cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim] -> rotated copies."""
        cos, sin = cos_sin
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin

    def _rotate_half(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., self.half :], x[..., : self.half]), dim=-1)
