"""RMSNorm, replicated on every rank; the arithmetic order is transformers' (LlamaRMSNorm),
so that our hidden states match its float32 results bit for bit where possible."""

from __future__ import annotations

import torch


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight = weight
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))
