"""Column- and row-parallel linear layers (Megatron-style), on plain tensors.

A column-parallel layer holds rows [start, end) of W ([out, in]) and yields its slice of
the output features; a row-parallel layer holds columns [start, end) of W, consumes the
matching slice of its input features and all-reduces the partial sums. Shards are cut
at load time (`WeightSource.get` with a range), never materialized whole per worker.

These are plain classes, not nn.Modules: a decode step calls ~15 of them per layer and
Module.__call__'s hook machinery is measurable at that rate on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbridge.engine.parallel.base import Communicator
from kvbridge.engine.weights import WeightSource


def split_range(total: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """This rank's [start, end) of `total` items, balanced (sizes differ by at most one)."""
    return tp_rank * total // tp_size, (tp_rank + 1) * total // tp_size


class ColumnParallelLinear:
    """y_local = x @ W[start:end]^T (+ b[start:end]); output features stay sharded.

    Several logical weights may be fused into one (QKV, gate+up): `load` concatenates
    each one's row slice, and `split_sizes` tells the caller how to cut the output.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, split_sizes: list[int]
    ) -> None:
        assert weight.shape[0] == sum(split_sizes), (weight.shape, split_sizes)
        self.weight = weight
        self.bias = bias
        self.split_sizes = split_sizes

    @classmethod
    def load(
        cls,
        source: WeightSource,
        prefix_ranges: list[tuple[str, tuple[int, int]]],
        bias: bool = False,
    ) -> ColumnParallelLinear:
        """`prefix_ranges`: (tensor name without .weight, [start, end) rows) per fused part."""
        weights = [source.get(f"{p}.weight", 0, a, b) for p, (a, b) in prefix_ranges]
        biases = [source.get(f"{p}.bias", 0, a, b) for p, (a, b) in prefix_ranges] if bias else []
        weight = weights[0] if len(weights) == 1 else torch.cat(weights, 0)
        b = None if not biases else (biases[0] if len(biases) == 1 else torch.cat(biases, 0))
        return cls(weight.contiguous(), b, [w.shape[0] for w in weights])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear:
    """y = all_reduce(x_local @ W[:, start:end]^T); the output is whole on every rank."""

    def __init__(self, weight: torch.Tensor, comm: Communicator) -> None:
        self.weight = weight
        self.comm = comm

    @classmethod
    def load(
        cls, source: WeightSource, prefix: str, cols: tuple[int, int], comm: Communicator
    ) -> RowParallelLinear:
        return cls(source.get(f"{prefix}.weight", 1, *cols).contiguous(), comm)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.comm.world_size > 1:
            self.comm.all_reduce(y)
        return y
