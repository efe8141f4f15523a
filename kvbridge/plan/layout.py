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

Cache: each worker stores its heads x layers as one array whose axis order is the
instance's `CacheLayout` (see there); the axes before B split it into regions.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from kvbridge.errors import LayoutError
from kvbridge.plan.geometry import DTYPE_SIZES, ModelKVSpec, normalize_dtype

AXES = "BLKHNC"
AXIS_WORDS = {
    "B": "block",
    "L": "layer",
    "K": "K/V",
    "H": "KV head",
    "N": "token within block",
    "C": "channel",
}
#: Named orders, in vLLM's letters (K, absent from those names, follows L).
NAMED_LAYOUTS = ("BHLNC", "BLHNC", "BLNHC", "LBHNC", "LBNHC")
_ALIASES = {"HND": "LBHNC", "NHD": "LBNHC"}
#: How a K or V half keeps tokens (N) and channels (C): token-major or channel-major.
INNER_ORDERS = ("NC", "CN")


def _accepted() -> str:
    return (
        f"use HND, NHD, {', '.join(NAMED_LAYOUTS)}, or any order of the axes "
        + ", ".join(f"{a} ({w})" for a, w in AXIS_WORDS.items())
        + " with C last (without K, K follows L); a channel-major half after a colon, "
        "e.g. LBHKNC:K=CN"
    )


@dataclass(frozen=True)
class CacheLayout:
    """The order of a worker cache's axes, outermost first: a permutation of `AXES`,
    and the order of tokens and channels within each of the K and V halves.

    Axes: B block, L layer, K K/V (MLA: the latent alone, extent 1), H KV head,
    N token within block, C channel (head_dim). C is innermost, so one head's entry
    for one token (a *row*) is contiguous, unless a half is channel-major (below).
    Addresses follow from strides:

        offset(b, l, k, h, n, c) = sum over axes of index * stride,
        stride of an axis = itemsize * product of the extents of the axes after it

    The axes before B are *region axes*: every combination of them is one region, a
    dense array over the remaining axes whose offsets do not depend on the number of
    blocks (B is its outermost axis). An engine may allocate its regions apart (vLLM
    per-layer tensors) or as one tensor; the transfer layer takes one address per region.

        HND = LBHNC = LKBHNC   per layer and K/V: [block][head][token][channel]
        NHD = LBNHC = LKBNHC   per layer and K/V: [block][token][head][channel]
        BHLNC = BHLKNC         cross-layer, heads outermost: one region; a head range
                               of a block is one contiguous run over all layers

    `k_inner` and `v_inner` say how the K half and the V half (the elements of K index
    0 and 1) keep N and C: "NC" token-major (the order as written, C innermost), or
    "CN" channel-major: that half's N and C trade places in the order, so its
    tokens are innermost. Each half stays a dense array of the same size at the same
    place (K precedes N and C; N is a block axis), so only the strides of the axes
    after K differ between halves (`axis_order(kv)`). Spelled with a suffix:

        LBHKNC:K=CN   vLLM's CPU cache per layer: [block][head][K/V][...] with K
                      [channel][token] and V [token][channel] (kvbridge.vllm.cache)
    """

    order: str
    k_inner: str = "NC"
    v_inner: str = "NC"

    HND: ClassVar[CacheLayout]
    NHD: ClassVar[CacheLayout]
    BHLNC: ClassVar[CacheLayout]

    def __post_init__(self) -> None:
        order = self.order
        if sorted(order) != sorted(AXES) or order[-1] != "C":
            raise LayoutError(f"cache layout order={order!r} is not valid; {_accepted()}")
        for half, inner in (("k_inner", self.k_inner), ("v_inner", self.v_inner)):
            if inner not in INNER_ORDERS:
                raise LayoutError(
                    f'cache layout {half}={inner!r} is not valid; use "NC" (token-major: '
                    '[token][channel]) or "CN" (channel-major: [channel][token])'
                )
        if self.is_channel_major and not (
            order.index("B") < order.index("N") and order.index("K") < order.index("N")
        ):
            raise LayoutError(
                f"cache layout {self.name!r} keeps a half channel-major, which needs N "
                f"(token) after both B (block) and K (K/V) in the order; order={order!r} "
                "does not: e.g. LBHKNC:K=CN or LBHNC:K=CN"
            )

    @classmethod
    def parse(cls, value: str | CacheLayout) -> CacheLayout:
        """A layout from its name: an alias (HND, NHD), a vLLM-style five-letter order
        (K inserted after L) or a six-letter order, optionally followed by the halves
        kept channel-major (":K=CN", ":V=CN", ":K=CN,V=CN"); case-insensitive."""
        if isinstance(value, CacheLayout):
            return value
        text = str(value).strip().upper()
        text, colon, suffix = text.partition(":")
        order = _ALIASES.get(text, text)
        if len(order) == 5 and "K" not in order and "L" in order:
            order = order.replace("L", "LK")
        why = ""
        if not order or set(order) - set(AXES):
            why = f"letters other than {AXES}"
        elif len(set(order)) != len(order):
            why = "an axis repeated"
        elif len(order) != len(AXES):
            why = "axes missing: " + "".join(a for a in AXES if a not in order)
        elif order[-1] != "C":
            why = "C (channel) not innermost"
        if why:
            raise LayoutError(
                f"cache layout={value!r} is not a valid axis order ({why}); {_accepted()}"
            )
        inner = {"K": "NC", "V": "NC"}
        said: set[str] = set()
        for item in suffix.split(",") if colon else []:
            half, eq, val = item.strip().partition("=")
            if half in said:
                raise LayoutError(
                    f"cache layout={value!r} says how half {half} is kept twice; name "
                    "each half once, e.g. LBHKNC:K=CN"
                )
            said.add(half)
            if not (eq and half in inner and val in INNER_ORDERS):
                raise LayoutError(
                    f"cache layout={value!r}: {item.strip()!r} does not say how a half "
                    "keeps tokens and channels; after the order write K=CN, V=CN or "
                    "K=CN,V=CN (a channel-major half; NC, token-major, is the default), "
                    "e.g. LBHKNC:K=CN"
                )
            inner[half] = val
        return cls(order, inner["K"], inner["V"])

    @property
    def is_channel_major(self) -> bool:
        """Whether either half keeps its tokens innermost."""
        return "CN" in (self.k_inner, self.v_inner)

    @property
    def name(self) -> str:
        """The short name: five letters when K follows L (vLLM's), else all six; then
        ":K=CN", ":V=CN" or ":K=CN,V=CN" for channel-major halves."""
        base = self.order.replace("LK", "L") if "LK" in self.order else self.order
        halves = [f"{h}=CN" for h, i in (("K", self.k_inner), ("V", self.v_inner)) if i == "CN"]
        return f"{base}:{','.join(halves)}" if halves else base

    @property
    def value(self) -> str:
        return self.name

    @property
    def region_axes(self) -> str:
        """The axes before B (one region per combination of them)."""
        return self.order[: self.order.index("B")]

    @property
    def block_axes(self) -> str:
        """The axes of one region, B first."""
        return self.order[self.order.index("B") :]

    def axis_order(self, kv: int) -> str:
        """The order the elements of half `kv` (0: K, 1: V) lie in: `order`, with N and
        C trading places if that half is channel-major."""
        if (self.k_inner, self.v_inner)[kv] == "NC":
            return self.order
        return self.order.translate(str.maketrans("NC", "CN"))

    def shape(self, extents: Mapping[str, int]) -> tuple[int, ...]:
        """The cache's shape in elements, given every axis' extent, in this order (a
        channel-major half lies in the same elements, `axis_order`)."""
        return tuple(extents[a] for a in self.order)

    def permutation(self, to: str = "LKBHNC") -> tuple[int, ...]:
        """Dims that permute an array in this order into the order `to` (numpy
        `transpose` / torch `permute` argument; token-major halves only)."""
        return tuple(self.order.index(a) for a in to)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        halves = "".join(
            f", {f}={i!r}"
            for f, i in (("k_inner", self.k_inner), ("v_inner", self.v_inner))
            if i != "NC"
        )
        return f"CacheLayout({self.order!r}{halves})"


#: The layout every command uses unless told otherwise: cross-layer, heads outermost,
#: so a head range of a block is one run over all layers for any TP pair.
DEFAULT_LAYOUT = "BHLNC"
#: Tokens per KV block unless configured: the one declaration every layer and flag uses.
DEFAULT_BLOCK_SIZE = 16
LAYOUT_HELP = (
    "cache layout, the order of the axes B (block), L (layer), K (K/V), H (KV head), "
    "N (token in block), C (channel), outermost first with C last: BHLNC (cross-layer, "
    "heads outermost; default), BLHNC, BLNHC, LBHNC (= HND, per layer), LBNHC (= NHD); "
    "without K, K follows L; a channel-major K and/or V half after a colon, e.g. "
    "LBHKNC:K=CN (vLLM's CPU pages)"
)

CacheLayout.HND = CacheLayout("LKBHNC")
CacheLayout.NHD = CacheLayout("LKBNHC")
CacheLayout.BHLNC = CacheLayout("BHLKNC")


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
    block_size: int = DEFAULT_BLOCK_SIZE
    cache_layout: CacheLayout = CacheLayout.BHLNC
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
        return f"tp{self.tp_size}{pp} block {self.block_size} {self.cache_layout.name}"


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


def cache_extents(
    model: ModelKVSpec, shard: WorkerShard, block_size: int, num_blocks: int
) -> dict[str, int]:
    """The extent of every axis of `shard`'s cache with `num_blocks` blocks."""
    return {
        "B": num_blocks,
        "L": shard.num_local_layers,
        "K": model.num_kv_tensors,
        "H": shard.num_local_heads,
        "N": block_size,
        "C": model.head_dim,
    }


def cache_shape(
    model: ModelKVSpec, layout: InstanceLayout, shard: WorkerShard, num_blocks: int
) -> tuple[int, ...]:
    """Shape of `shard`'s whole cache in elements, axes in the layout's order."""
    return layout.cache_layout.shape(cache_extents(model, shard, layout.block_size, num_blocks))


def num_regions(model: ModelKVSpec, layout: InstanceLayout, shard: WorkerShard) -> int:
    """Regions of `shard`'s cache: the product of the region axes' extents."""
    ext = cache_extents(model, shard, layout.block_size, 1)
    return math.prod(ext[a] for a in layout.cache_layout.region_axes)


def region_nbytes(
    model: ModelKVSpec, layout: InstanceLayout, shard: WorkerShard, num_blocks: int
) -> int:
    """Bytes of one region of `shard`'s cache with `num_blocks` blocks."""
    ext = cache_extents(model, shard, layout.block_size, num_blocks)
    n = math.prod(ext[a] for a in layout.cache_layout.block_axes)
    return n * DTYPE_SIZES[layout.kv_dtype(model)]


def cache_strides(
    model: ModelKVSpec, layout: InstanceLayout, shard: WorkerShard, kv: int = 0
) -> dict[str, tuple[int, int]]:
    """Per axis, (region stride, byte stride) within half `kv` (0: K, 1: V): moving one
    step along a region axis moves `region stride` regions; along any other axis,
    `byte stride` bytes within a region. Neither depends on the number of blocks. The
    halves differ only where one is channel-major (`CacheLayout.axis_order`): there N
    and C trade strides (and so may the axes between them).

        LBHKNC:K=CN, 2 heads, block 32, head_dim 64, fp32     B      H     K     N     C
        K half (axis order LBHKCN)                          32768  16384  8192   4   128
        V half (axis order LBHKNC)                          32768  16384  8192  256    4
    """
    ext = cache_extents(model, shard, layout.block_size, 1)
    order = layout.cache_layout.axis_order(kv)
    cut = order.index("B")
    out: dict[str, tuple[int, int]] = {}
    step = DTYPE_SIZES[layout.kv_dtype(model)]
    for axis in reversed(order[cut:]):
        out[axis] = (0, step)
        step *= ext[axis]
    step = 1
    for axis in reversed(order[:cut]):
        out[axis] = (step, 0)
        step *= ext[axis]
    return out
