"""An engine's attention-backend caches in kvbridge's layout letters (`CacheLayout`).

vLLM gives every attention layer's cache one logical shape, [B, H, N, C] (block, KV
head, token within block, and C a token's whole content for one head), and lays all of
them out in one physical order for the model, its KV cache layout: the order of L, B, H,
N, C outermost first (`VLLM_ORDERS`), a dense allocation of one buffer (L-first orders
give each layer its own stretch; B-first ones put every layer's page inside each block).
What C holds is the attention backend's reading, so the backend and the order together
name the layout (`backend_layout`):

    content    backends (vLLM names)               C holds                  kvbridge order
    KV         FLASH_ATTN, FLASHINFER, TRITON_ATTN,  K's head_dim channels,   K before C:
               FLEX_ATTENTION                        then V's                 LBNHC -> LBNHKC
    LATENT     CPU_MLA, TRITON_MLA, FLASHMLA, ...    MLA's latent alone       the same, K of
                                                     (kv_lora_rank + rope)    extent 1
    CPU_PAGE   CPU_ATTN                              nothing alone: a (block, K before N, K
                                                     head) page [N][C] is     channel-major:
                                                     [K/V][N][head_dim]       LBHNC -> LBHKNC:K=CN

vLLM's letters are not kvbridge's five-letter names: its C is K and V together, so its
LBNHC is kvbridge's LBNHKC, not kvbridge's LBNHC (= LKBNHC, K outermost within a layer).

vLLM's CPU attention backend (layout LBHNC only) views a layer's [.., block_size,
2*head_dim] pages as [.., 2*block_size, head_dim]: K, then V. Measured with the kernel
that writes the cache (`cpu_attn_reshape_and_cache`), the V half is [token][channel]
but the K half is [channel][token]: in kvbridge's letters LBHKNC:K=CN (`CPU_LAYOUT`),
one region per layer. The planner cuts K and V apart where their orders differ, so any
pair of block sizes and partial pulls move exactly the prompt's tokens.

`place_layers` checks the tensors an engine registered are that dense allocation (shape,
strides, the layers' addresses) and returns the regions kvbridge registers: one per
combination of the axes before B (a layer, or a layer and head; B-first: the buffer);
`place_cache` does so for one worker's caches of a model and names their
`InstanceLayout`. Any backend, order or tensor it does not know is refused naming it
and what works.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from kvbridge.errors import ConfigError, LayoutError
from kvbridge.plan.geometry import ModelKVSpec, normalize_dtype
from kvbridge.plan.layout import CacheLayout, InstanceLayout

#: vLLM's KV cache layouts (`KVCacheLayout`), over its logical axes L, B, H, N, C
VLLM_ORDERS = ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


class Content(Enum):
    """What a backend keeps in C, a token's content for one head (module docstring)."""

    KV = "K then V"
    LATENT = "MLA latent"
    CPU_PAGE = "a page of K/V halves, K channel-major"

    @property
    def num_kv_tensors(self) -> int:
        return 1 if self is Content.LATENT else 2


#: Each known backend's content; a backend not named here is refused.
BACKEND_CONTENT = {
    "CPU_ATTN": Content.CPU_PAGE,
    "FLASH_ATTN": Content.KV,
    "FLASHINFER": Content.KV,
    "TRITON_ATTN": Content.KV,
    "FLEX_ATTENTION": Content.KV,
    "CPU_MLA": Content.LATENT,
    "TRITON_MLA": Content.LATENT,
    "FLASHMLA": Content.LATENT,
    "FLASHINFER_MLA": Content.LATENT,
    "CUTLASS_MLA": Content.LATENT,
    "FLASH_ATTN_MLA": Content.LATENT,
}


def _what_works() -> str:
    return (
        f"KVBridgeConnector reads the backends {', '.join(BACKEND_CONTENT)} under the KV "
        f"cache layouts {', '.join(VLLM_ORDERS)} (CPU_ATTN: those ending in NC)"
    )


def backend_layout(backend: str, order: str) -> CacheLayout:
    """kvbridge's layout of the caches `backend` reads under the engine's `order`."""
    content = BACKEND_CONTENT.get(backend)
    if content is None or order not in VLLM_ORDERS:
        what = f"attention backend {backend}" if content is None else f"KV cache layout {order}"
        raise LayoutError(f"{what} is not one kvbridge knows; {_what_works()}")
    if content is Content.CPU_PAGE:
        if not order.endswith("NC"):
            raise LayoutError(
                f"attention backend {backend} under KV cache layout {order}: its pages "
                f"need N and C innermost; {_what_works()}"
            )
        return CacheLayout(order[:-2] + "KNC", k_inner="CN")
    return CacheLayout(order[:-1] + "KC")


#: vLLM's CPU cache, per layer: [block][head][K then V][...], K's page half
#: [channel][token] (channel-major), V's [token][channel]
CPU_LAYOUT = backend_layout("CPU_ATTN", "LBHNC")


def dense_strides(order: str, extents: Mapping[str, int]) -> dict[str, int]:
    """Element strides of a dense array whose axes lie in `order`, outermost first."""
    out, step = {}, 1
    for axis in reversed(order):
        out[axis] = step
        step *= extents[axis]
    return out


@dataclass(frozen=True)
class LayerTensor:
    """One layer's cache as the engine registered it: the attention backend that reads
    it ("" if none does), logical [B, H, N, C] shape and strides in elements, address
    and element size in bytes, element type (torch's name or kvbridge's)."""

    name: str
    backend: str
    address: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    dtype: str


@dataclass(frozen=True)
class PlacedCache:
    """A worker's layer tensors as kvbridge registers them: the layout, one address
    and length per region (region axes' combinations, outermost first), the blocks."""

    layout: CacheLayout
    addresses: tuple[int, ...]
    lengths: tuple[int, ...]
    num_blocks: int


def place_layers(
    order: str,
    layers: Sequence[LayerTensor],
    num_heads: int,
    block_size: int,
    head_dim: int,
    num_kv_tensors: int,
) -> PlacedCache:
    """Check `layers` (in layer order, every layer's tensor) are their backends' caches
    under `order` for `num_heads` KV heads of `head_dim`, `block_size` tokens a block;
    LayoutError naming the backend, the tensor and what works if not.

    Every layer's backend must read its cache as the first layer's does. Each tensor
    must be [num_blocks, num_heads, block_size, num_kv_tensors * head_dim] with the
    strides of one dense buffer in `order`; B-first orders also need layer l at layer
    0's address plus l layer strides (L-first: each layer anywhere)."""
    backend = layers[0].backend
    for t in layers:
        if t.backend not in BACKEND_CONTENT:
            raise LayoutError(
                f"KV cache {t.name!r}: attention backend {t.backend or '(none)'} is not one "
                f"kvbridge knows; {_what_works()}"
            )
        if backend_layout(t.backend, order) != backend_layout(backend, order):
            raise LayoutError(
                f"KV caches {layers[0].name!r} ({backend}) and {t.name!r} ({t.backend}) "
                "are read differently; kvbridge needs one layout for every layer"
            )
    layout = backend_layout(backend, order)
    content = BACKEND_CONTENT[backend]
    if content.num_kv_tensors != num_kv_tensors:
        raise LayoutError(
            f"attention backend {backend} keeps {content.value} in its caches but the model "
            f"has {num_kv_tensors} KV tensor(s) per layer; an MLA model needs an MLA "
            f"backend, any other model one that keeps K and V; {_what_works()}"
        )
    first = layers[0]
    ext = {"L": len(layers), "B": first.shape[0], "H": num_heads, "N": block_size}
    ext["C"] = num_kv_tensors * head_dim
    strides = dense_strides(order, ext)
    want = tuple(ext[a] for a in "BHNC"), tuple(strides[a] for a in "BHNC")
    for i, t in enumerate(layers):
        at = first.address + i * strides["L"] * first.itemsize
        # (an axis of extent 1 has no stride to keep)
        same = t.shape == want[0] and all(
            n == 1 or s == w for n, s, w in zip(t.shape, t.strides, want[1], strict=True)
        )
        if not same or t.itemsize != first.itemsize or (order[0] != "L" and t.address != at):
            raise LayoutError(
                f"KV cache {t.name!r} of attention backend {backend} under layout {order} "
                f"has shape {t.shape}, strides {t.strides}, {t.itemsize}-byte elements"
                f"{'' if order[0] == 'L' or t.address == at else ' at a separate address'}; "
                f"kvbridge reads it as one dense buffer in {order}: shape {want[0]} "
                f"[num_blocks, kv_heads_per_rank, block_size, {num_kv_tensors}*head_dim], "
                f"strides {want[1]}, every layer one dtype"
                + ("" if order[0] == "L" else ", layer l at layer 0's address + l layer strides")
            )
    byte = {a: s * first.itemsize for a, s in strides.items()}
    region_axes = layout.region_axes  # L, H, both (LHBNC) or none (B-first: the buffer)
    addresses = []
    for combo in itertools.product(*(range(ext[a]) for a in region_axes)):
        idx = dict(zip(region_axes, combo, strict=True))
        addresses.append(layers[idx.get("L", 0)].address + idx.get("H", 0) * byte["H"])
    length = ext["B"] * byte["B"]  # a region is dense, B outermost
    return PlacedCache(layout, tuple(addresses), (length,) * len(addresses), ext["B"])


def place_cache(
    order: str,
    layers: Sequence[LayerTensor],
    model: ModelKVSpec,
    tp_size: int,
    block_size: int,
    pp_layers: tuple[int, ...] | None = None,
    pp_rank: int = 0,
) -> tuple[InstanceLayout, PlacedCache]:
    """One worker's caches of `model` at `tp_size` and `block_size` (every layer's of
    its pipeline stage `pp_rank`, in layer order; `pp_layers`: the layers per stage,
    None without pipeline parallelism) placed (`place_layers`), and the instance layout
    they make; ConfigError if they are not one per layer of the stage or the layout
    does not serve `model`."""
    pp_size = len(pp_layers) if pp_layers else 1
    stages = InstanceLayout(tp_size=tp_size, pp_size=pp_size, pp_layers=pp_layers)
    start, end = stages.layer_ranges(model)[pp_rank]
    if len(layers) != end - start:
        where = f" (pipeline stage {pp_rank} of {pp_size} holds layers [{start}, {end}))"
        raise ConfigError(
            f"vLLM registered {len(layers)} KV caches; {model.name} has "
            f"{model.num_layers} layers{where if pp_size > 1 else ''} (KVBridgeConnector "
            "needs one cache per layer: no hybrid caches)"
        )
    # a worker holds H/tp heads, or one replicated head when tp > H (`kv_head_range`)
    num_heads = model.num_kv_heads // tp_size if tp_size <= model.num_kv_heads else 1
    placed = place_layers(
        order, layers, num_heads, block_size, model.head_dim, model.num_kv_tensors
    )
    layout = InstanceLayout(
        tp_size=tp_size,
        pp_size=pp_size,
        block_size=block_size,
        cache_layout=placed.layout,
        dtype=normalize_dtype(layers[0].dtype),
        pp_layers=pp_layers,
    )
    layout.check(model)
    return layout, placed
