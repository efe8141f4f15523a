"""How one instance splits a model's KV cache over its workers.

All ranges are half-open, ``[start, end)``.

Head ownership (the one rule the engine and the planner share, `kv_head_range`):
  * tp_size <= num_kv_heads (tp divides H): worker r holds heads [r*H/tp, (r+1)*H/tp).
  * tp_size >  num_kv_heads (tp a multiple of H): worker r holds the single head
    floor(r*H/tp); tp/H consecutive workers replicate each head.
  * MLA: every worker holds the whole latent, logical head [0, 1).

Layer ownership: pp stages get contiguous layer ranges whose sizes differ by at most one;
the default split is vLLM's (the spare layers go to the stages before the last, which
also carries the LM head). Global worker rank = pp_rank * tp_size + tp_rank.

Cache regions of one worker (the unit that is registered with the transfer engine):
region index ``local_layer * num_kv_tensors + kv`` (kv 0 = K, 1 = V; MLA has only 0),
each a dense array of ``num_blocks`` blocks:

    HND: [num_blocks, local_kv_heads, block_size, head_dim]   a head's tokens together
    NHD: [num_blocks, block_size, local_kv_heads, head_dim]   a token's heads together
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

from kvbridge.errors import LayoutError
from kvbridge.plan.geometry import ModelKVSpec, normalize_dtype


class CacheLayout(enum.Enum):
    HND = "HND"
    NHD = "NHD"

    @classmethod
    def parse(cls, value: str | CacheLayout) -> CacheLayout:
        if isinstance(value, CacheLayout):
            return value
        try:
            return cls(str(value).upper())
        except ValueError:
            raise LayoutError(f"cache layout={value!r} is not known; use HND or NHD") from None


def kv_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Global KV heads [start, end) held by `tp_rank` of `tp_size` (see module docstring).

    The caller has validated the pair (`valid_tp_sizes`); this only asserts it.
    """
    assert 0 <= tp_rank < tp_size, (tp_rank, tp_size)
    if tp_size <= num_kv_heads:
        assert num_kv_heads % tp_size == 0, (num_kv_heads, tp_size)
        per = num_kv_heads // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    assert tp_size % num_kv_heads == 0, (num_kv_heads, tp_size)
    head = tp_rank * num_kv_heads // tp_size
    return head, head + 1


def valid_tp_sizes(model: ModelKVSpec) -> list[int]:
    """Every tp_size the model allows: divides the query heads and, unless MLA,
    divides the KV heads or is a multiple of them."""
    out = []
    for tp in range(1, model.num_attention_heads + 1):
        if model.num_attention_heads % tp:
            continue
        if model.is_mla or model.num_kv_heads % tp == 0 or tp % model.num_kv_heads == 0:
            out.append(tp)
    return out


def check_tp_size(model: ModelKVSpec, tp_size: int, side: str = "") -> None:
    """Raise LayoutError naming the rule `tp_size` breaks and the sizes that would work."""
    who = f"{side} " if side else ""
    _check_positive(f"{who}tp_size", tp_size)
    valid = ", ".join(map(str, valid_tp_sizes(model)))
    if model.num_attention_heads % tp_size:
        raise LayoutError(
            f"{who}tp_size={tp_size} does not divide num_attention_heads="
            f"{model.num_attention_heads} of {model.name}; use one of {valid}"
        )
    if not model.is_mla and model.num_kv_heads % tp_size and tp_size % model.num_kv_heads:
        raise LayoutError(
            f"{who}tp_size={tp_size} neither divides nor is a multiple of num_kv_heads="
            f"{model.num_kv_heads} of {model.name}; use one of {valid}"
        )


def default_pp_split(num_layers: int, pp_size: int) -> tuple[int, ...]:
    """Layers per pp stage, vLLM's default: equal shares, spare layers to the stages
    before the last (e.g. 30 layers, pp 4 -> (7, 8, 8, 7))."""
    assert 1 <= pp_size <= num_layers
    sizes = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        sizes[-i] += 1
    return tuple(sizes)


def _check_positive(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LayoutError(f"{field}={value!r} must be a positive integer")
    return value


@dataclass(frozen=True)
class InstanceLayout:
    """How one instance (all its workers) parallelizes and stores the KV cache.

    `pp_layers` optionally fixes the layers per pp stage; by default `default_pp_split`.
    The layout is checked against a model by `workers()` / `check(model)`, since the
    same layout object may describe instances of different models.
    """

    tp_size: int = 1
    pp_size: int = 1
    block_size: int = 16
    cache_layout: CacheLayout = CacheLayout.HND
    dtype: str | None = None  # None: the model's dtype
    pp_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check_positive("tp_size", self.tp_size)
        _check_positive("pp_size", self.pp_size)
        _check_positive("block_size", self.block_size)
        object.__setattr__(self, "cache_layout", CacheLayout.parse(self.cache_layout))
        if self.dtype is not None:
            object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if self.pp_layers is not None:
            object.__setattr__(self, "pp_layers", tuple(self.pp_layers))
            assert self.pp_layers is not None
            if len(self.pp_layers) != self.pp_size:
                raise LayoutError(
                    f"pp_layers={list(self.pp_layers)} has {len(self.pp_layers)} entries "
                    f"but pp_size={self.pp_size}; give one layer count per stage"
                )
            for n in self.pp_layers:
                _check_positive("pp_layers entry", n)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def kv_dtype(self, model: ModelKVSpec) -> str:
        return self.dtype or model.dtype

    def layer_ranges(self, model: ModelKVSpec, side: str = "") -> list[tuple[int, int]]:
        """The [start, end) layers of each pp stage."""
        who = f"{side} " if side else ""
        if self.pp_layers is not None:
            if sum(self.pp_layers) != model.num_layers:
                raise LayoutError(
                    f"{who}pp_layers={list(self.pp_layers)} sums to {sum(self.pp_layers)} but "
                    f"{model.name} has num_layers={model.num_layers}; the counts must add up"
                )
            sizes = self.pp_layers
        else:
            if self.pp_size > model.num_layers:
                raise LayoutError(
                    f"{who}pp_size={self.pp_size} exceeds num_layers={model.num_layers} of "
                    f"{model.name}; use pp_size <= {model.num_layers}"
                )
            sizes = default_pp_split(model.num_layers, self.pp_size)
        bounds = [0]
        for n in sizes:
            bounds.append(bounds[-1] + n)
        return list(itertools.pairwise(bounds))

    def check(self, model: ModelKVSpec, side: str = "") -> None:
        check_tp_size(model, self.tp_size, side)
        self.layer_ranges(model, side)

    def workers(self, model: ModelKVSpec, side: str = "") -> list[WorkerShard]:
        """Every worker of the instance, in global rank order."""
        self.check(model, side)
        out = []
        for pp_rank, layers in enumerate(self.layer_ranges(model, side)):
            for tp_rank in range(self.tp_size):
                heads = (
                    (0, 1)
                    if model.is_mla
                    else kv_head_range(model.num_kv_heads, self.tp_size, tp_rank)
                )
                out.append(
                    WorkerShard(
                        rank=pp_rank * self.tp_size + tp_rank,
                        tp_rank=tp_rank,
                        pp_rank=pp_rank,
                        kv_heads=heads,
                        layers=layers,
                    )
                )
        return out

    def describe(self) -> str:
        pp = f" pp{self.pp_size}" if self.pp_size > 1 else ""
        return f"tp{self.tp_size}{pp} block {self.block_size} {self.cache_layout.value}"


@dataclass(frozen=True)
class WorkerShard:
    """The slice of the KV cache one worker holds: global heads and layers, half-open."""

    rank: int
    tp_rank: int
    pp_rank: int
    kv_heads: tuple[int, int]
    layers: tuple[int, int]

    @property
    def num_local_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def num_local_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    def holds(self, layers: tuple[int, int], heads: tuple[int, int]) -> bool:
        return (
            self.layers[0] <= layers[0]
            and layers[1] <= self.layers[1]
            and self.kv_heads[0] <= heads[0]
            and heads[1] <= self.kv_heads[1]
        )


def region_shape(
    layout: InstanceLayout, num_blocks: int, num_local_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """Shape of one cache region (one layer's K, V or latent) in elements."""
    if layout.cache_layout is CacheLayout.HND:
        return (num_blocks, num_local_heads, layout.block_size, head_dim)
    return (num_blocks, layout.block_size, num_local_heads, head_dim)


def num_regions(model: ModelKVSpec, shard: WorkerShard) -> int:
    return shard.num_local_layers * model.num_kv_tensors


def region_index(model: ModelKVSpec, shard: WorkerShard, layer: int, kv: int) -> int:
    """Region holding global `layer`'s tensor `kv` (0 = K or latent, 1 = V) on `shard`."""
    assert shard.layers[0] <= layer < shard.layers[1] and 0 <= kv < model.num_kv_tensors
    return (layer - shard.layers[0]) * model.num_kv_tensors + kv
