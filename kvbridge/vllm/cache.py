"""vLLM's registered KV caches, named in kvbridge's layout terms.

vLLM gives `register_kv_caches` one tensor per attention layer, views of one buffer,
each [num_blocks, num_kv_heads_per_rank, block_size, content] in the model's KV cache
layout (an order of L, B, H, N, C), and each layer's attention backend reads the
content its own way. `CacheFormat.of` reads both from vLLM; kvbridge.plan.backends
maps them to kvbridge's layout letters (vLLM's CPU pages included) and checks the
tensors are that allocation. A backend, layout or tensor kvbridge does not know is
refused at start-up naming it and what works.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvbridge.connector import CacheRegions, MemType
from kvbridge.errors import ConfigError, LayoutError
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
    """One worker's caches as kvbridge sees them."""

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


def describe_kv_caches(
    kv_caches: dict[str, Any],
    model: ModelKVSpec,
    tp_size: int,
    block_size: int,
    made_by: CacheFormat,
    pp_layers: tuple[int, ...] | None = None,
    pp_rank: int = 0,
) -> RegisteredCache:
    """The layout, regions and block count of one worker's `kv_caches` (vLLM's
    `register_kv_caches` argument) as `made_by` made them; ConfigError if they are not
    one cache per layer of `model` at `tp_size` and `block_size` in a backend's layout
    kvbridge knows (`kvbridge.plan.backends`). Under pipeline parallelism (`pp_layers`:
    vLLM's layers per stage, `pipeline_layers`) they are the layers of stage `pp_rank`
    only, and must be those layers."""
    names = sorted(kv_caches, key=layer_index)
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
    if len({t.dtype for t in tensors}) > 1 or any(t.is_cuda for t in tensors):
        raise ConfigError(
            f"vLLM KV caches are {sorted({str(t.dtype) for t in tensors})} on "
            f"{sorted({str(t.device) for t in tensors})}; KVBridgeConnector's vLLM glue "
            "serves CPU caches of one dtype for now: use vLLM's CPU build"
        )
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
    regions = CacheRegions(placed.addresses, placed.lengths, MemType.DRAM, 0)
    return RegisteredCache(layout, regions, placed.num_blocks)
