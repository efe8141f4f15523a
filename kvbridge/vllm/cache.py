"""vLLM's registered KV caches, named in kvbridge's layout terms.

vLLM gives `register_kv_caches` one tensor per attention layer, views of one buffer,
each [num_blocks, num_kv_heads_per_rank, block_size, content] in the model's KV cache
layout (an order of L, B, H, N, C), and each layer's attention backend reads the
content its own way. `CacheFormat.of` reads both from vLLM; kvbridge.plan.backends
maps them to kvbridge's layout letters (vLLM's CPU pages included) and checks the
tensors are that allocation. A backend, layout or tensor kvbridge does not know is
refused at start-up naming it and what works. A worker's caches lie in host memory
(vLLM's CPU build) or on its one GPU (CUDA, ROCm), registered as that device's memory
(`cache_memory`).

With vLLM's hybrid KV cache manager a model's layers fall into KV cache groups (e.g.
sliding-window and full attention), each with its own block table over one pool of
block ids, and one layer of each group shares one tensor with a layer of every other
group: block ids never collide, so a block's bytes belong to one group at a time.
kvbridge registers each shared tensor once, as one layer of its cache (`slots`); a
request's group g moves its own blocks over every such layer, which are exactly its
layers' KV. vLLM pads a group that has fewer layers than the others; such a model is
refused (it would move the padding's bytes).

An SSM hybrid's state layers (Mamba: a conv and an SSM state per request) are groups of
their own: vLLM pads their page to the attention page and gives the connector each as
bytes, [num_blocks, 1, 1, state bytes], over a shared tensor's pages
(`check_state_layers`). A request's state is one such page, moved whole: its bytes are
the page of the attention layer sharing the tensor.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvbridge.connector import CacheRegions, MemType, memory_of
from kvbridge.errors import ConfigError, KVBridgeError, LayoutError
from kvbridge.plan.backends import LayerTensor, place_cache
from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.plan.layout import InstanceLayout

_LAYER = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class CacheFormat:
    """What made a worker's caches: each layer's attention backend (vLLM's name) and
    the model's KV cache layout (vLLM's `KVCacheLayout` name)."""

    backends: dict[str, str]
    order: str

    @classmethod
    def of(cls, vllm_config: Any, names: Iterable[str]) -> CacheFormat:
        """Read from vLLM, in the worker process once the caches are allocated."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, names)
        backends = {name: layer.get_attn_backend().get_name() for name, layer in layers.items()}
        order = vllm_config.cache_config.get_resolved_kv_cache_layout().name
        return cls(backends, order)


@dataclass(frozen=True)
class RegisteredCache:
    """One worker's caches as kvbridge sees them: the model it moves (a layer per
    tensor), the layout, the regions, the blocks."""

    model: ModelKVSpec
    layout: InstanceLayout
    regions: CacheRegions
    num_blocks: int


def pipeline_layers(num_layers: int, pp_size: int) -> tuple[int, ...] | None:
    """The layers of each pipeline stage as vLLM splits them (its `get_pp_indices`,
    VLLM_PP_LAYER_PARTITION included); None at pp_size 1."""
    if pp_size == 1:
        return None
    from vllm.distributed.utils import get_pp_indices

    ranges = [get_pp_indices(num_layers, rank, pp_size) for rank in range(pp_size)]
    return tuple(end - start for start, end in ranges)


def layer_index(name: str) -> int:
    """The layer number in a vLLM layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    found = _LAYER.findall(f".{name}.")
    if not found:
        raise ConfigError(
            f"KV cache layer name {name!r} carries no layer number; KVBridgeConnector "
            "serves decoder models whose layers are named model.layers.N"
        )
    return int(found[-1])


def slots(kv_caches: dict[str, Any]) -> list[list[str]]:
    """The layers of `kv_caches` by the tensor they share (layer order): one list per
    layer without the hybrid KV cache manager, one per shared tensor with it."""
    by_tensor: dict[tuple[int, tuple[int, ...], tuple[int, ...]], list[str]] = {}
    for name in sorted(kv_caches, key=layer_index):
        t = kv_caches[name]
        by_tensor.setdefault((t.data_ptr(), tuple(t.shape), t.stride()), []).append(name)
    return list(by_tensor.values())


def check_state_layers(
    kv_caches: dict[str, Any], state_layers: frozenset[str], made_by: CacheFormat
) -> dict[int, list[str]]:
    """The SSM state layers of `kv_caches` by the address of the attention tensor whose
    pages they share; ConfigError for a state layer that is not vLLM's byte view of
    whole pages of one (its first byte a page's first, a page apart, no larger), naming
    the layer, its shape and what works."""
    attention = {t.data_ptr(): t for name, t in kv_caches.items() if name not in state_layers}
    by_page: dict[int, list[str]] = {}
    for name in sorted(state_layers & kv_caches.keys(), key=layer_index):
        t = kv_caches[name]
        backend = made_by.backends.get(name, "?")
        if not hasattr(t, "data_ptr"):
            raise ConfigError(
                f"vLLM's cache of SSM layer {name!r} (backend {backend}) is {len(t)} state "
                "tensors; KVBridgeConnector moves an SSM layer's state as the byte view of "
                "the pages it shares with attention layers, as vLLM 0.32 registers it"
            )
        page = attention.get(t.data_ptr())
        page_bytes = page.stride(0) * page.element_size() if page is not None else 0
        if (
            page is None
            or t.dim() != 4
            or t.element_size() != 1
            or t.shape[0] != page.shape[0]
            or t.stride(0) != page_bytes
            or t.shape[1] * t.shape[2] * t.shape[3] > page_bytes
        ):
            raise ConfigError(
                f"vLLM's cache of SSM layer {name!r} (backend {backend}) is "
                f"{tuple(t.shape)} {t.dtype} with strides {t.stride()}; KVBridgeConnector "
                "moves an SSM layer's state as whole pages of an attention layer's "
                "tensor (vLLM's hybrid KV cache manager on, one page size)"
            )
        by_page.setdefault(t.data_ptr(), []).append(name)
    return by_page


def check_groups(groups: list[list[str]], shared: list[list[str]]) -> None:
    """ConfigError unless each KV cache group (its layer names) has one layer in every
    shared tensor (`shared`, from `slots`): a group vLLM padded would move bytes no
    layer of it holds."""
    slot_of = {name: i for i, names in enumerate(shared) for name in names}
    for g, names in enumerate(groups):
        held = sorted(slot_of[n] for n in names if n in slot_of)
        if held != list(range(len(shared))):
            raise ConfigError(
                f"KV cache group {g} ({len(names)} layers: {', '.join(names[:4])}"
                f"{', ...' if len(names) > 4 else ''}) holds {len(held)} of the "
                f"{len(shared)} shared KV cache tensors; KVBridgeConnector moves hybrid "
                "models whose KV cache groups have equal numbers of layers (vLLM pads "
                "the others), or run with --disable-hybrid-kv-cache-manager"
            )


def cache_memory(kv_caches: dict[str, Any]) -> tuple[MemType, int]:
    """Where one worker's `kv_caches` lie, as NIXL registers it: host memory (vLLM's CPU
    build) as DRAM, one GPU (CUDA or ROCm) as VRAM of its index; ConfigError for caches
    on several devices (host and GPU, two GPUs) or on a kind of device NIXL is not given
    here, naming the device of each and what works."""
    on: dict[str, list[str]] = {}
    for name in sorted(kv_caches, key=layer_index):
        on.setdefault(str(kv_caches[name].device), []).append(name)
    if len(on) > 1:
        where = "; ".join(
            f"{device}: {', '.join(names[:2])}{', ...' if len(names) > 2 else ''}"
            for device, names in on.items()
        )
        raise ConfigError(
            f"vLLM KV caches of one worker lie on {len(on)} devices ({where}); "
            "KVBridgeConnector registers a worker's caches on one device: all in host "
            "memory (vLLM's CPU build) or all on the worker's own GPU (one CUDA or ROCm "
            "device per worker)"
        )
    device = kv_caches[next(iter(kv_caches))].device
    try:
        return memory_of(device)
    except KVBridgeError as exc:
        raise ConfigError(f"vLLM's KV caches: {exc}") from None


def describe_kv_caches(
    kv_caches: dict[str, Any],
    model: ModelKVSpec,
    tp_size: int,
    block_size: int,
    made_by: CacheFormat,
    groups: list[list[str]] | None = None,
    pp_layers: tuple[int, ...] | None = None,
    pp_rank: int = 0,
    state_layers: frozenset[str] = frozenset(),
) -> RegisteredCache:
    """The layout, regions and block count of one worker's `kv_caches` (vLLM's
    `register_kv_caches` argument) as `made_by` made them, and the model kvbridge moves:
    one layer per tensor (`slots`: a hybrid model's KV cache `groups`, each group's
    layer names, share them); ConfigError if they are not one cache per layer of
    `model` (per shared tensor) at `tp_size` and `block_size` in a backend's layout
    kvbridge knows (`kvbridge.plan.backends`). Under pipeline parallelism (`pp_layers`:
    vLLM's layers per stage, `pipeline_layers`) they are the layers of stage `pp_rank`
    only, and must be those layers. `state_layers`: the SSM layers (their KV cache
    groups' layer names), each over the pages of a tensor it shares with attention
    layers (`check_state_layers`)."""
    for name, t in kv_caches.items():
        if not hasattr(t, "data_ptr") and name not in state_layers:
            raise ConfigError(
                f"vLLM's cache of layer {name!r} (backend {made_by.backends.get(name, '?')}) "
                f"is {len(t)} state tensors, not an attention KV cache, and no KV cache "
                "group names it an SSM layer; KVBridgeConnector moves attention layers' KV "
                "and the state of vLLM's Mamba KV cache groups"
            )
    on_pages = check_state_layers(kv_caches, state_layers, made_by)
    attention = {n: t for n, t in kv_caches.items() if n not in state_layers}
    shared = slots(attention)
    for on_tensor in shared:  # each shared tensor's SSM layers too, for the group check
        on_tensor += on_pages.pop(attention[on_tensor[0]].data_ptr(), [])
    if len(shared) < len(kv_caches):
        if pp_layers is not None:
            raise ConfigError(
                f"parallel_config.pipeline_parallel_size={len(pp_layers)} with a hybrid "
                f"model's {len(groups or [])} KV cache groups is not served by "
                "KVBridgeConnector; use pipeline_parallel_size 1 for hybrid models, or "
                "--disable-hybrid-kv-cache-manager"
            )
        check_groups(groups or [list(kv_caches)], shared)
        model = dataclasses.replace(model, num_layers=len(shared))
    names = [next(n for n in on_tensor if n in attention) for on_tensor in shared]
    if pp_layers is not None:
        start = sum(pp_layers[:pp_rank])
        held = [layer_index(name) for name in names]
        if held != list(range(start, start + pp_layers[pp_rank])):
            raise ConfigError(
                f"vLLM registered KV caches of layers {held} on pipeline stage {pp_rank}; "
                f"its layer split {list(pp_layers)} gives that stage layers "
                f"[{start}, {start + pp_layers[pp_rank]}) (KVBridgeConnector needs each "
                "stage's own layers, one cache per layer)"
            )
    tensors = [kv_caches[name] for name in names]
    if len({t.dtype for t in tensors}) > 1:
        raise ConfigError(
            f"vLLM KV caches are {sorted({str(t.dtype) for t in tensors})}; "
            "KVBridgeConnector's vLLM glue serves caches of one dtype per worker"
        )
    mem_type, device_id = cache_memory(kv_caches)
    layers = [
        LayerTensor(
            name,
            made_by.backends.get(name, ""),
            t.data_ptr(),
            tuple(t.shape),
            t.stride(),
            t.element_size(),
            str(t.dtype),
        )
        for name, t in zip(names, tensors, strict=True)
    ]
    try:
        layout, placed = place_cache(
            made_by.order, layers, model, tp_size, block_size, pp_layers, pp_rank
        )
    except LayoutError as exc:
        raise ConfigError(f"vLLM's KV caches: {exc}") from None
    regions = CacheRegions(placed.addresses, placed.lengths, mem_type, device_id)
    return RegisteredCache(model, layout, regions, placed.num_blocks)
