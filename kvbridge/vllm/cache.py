"""vLLM's registered KV caches, named in kvbridge's layout terms.

vLLM's CPU attention backend gives `register_kv_caches` one tensor per attention
layer, views of one buffer, each of shape

    [num_blocks, num_kv_heads_per_rank, block_size, 2 * head_dim]

whose page (one block, one head) holds the block's K, then its V (the kernel views it
as [.., 2 * block_size, head_dim] and splits dim 2 in two). Measured with the kernel
that writes the cache (`cpu_attn_reshape_and_cache`), the V half is [token][channel]
but the K half is [channel][token]. In kvbridge's axis letters that is, per layer,
B H K N C with a channel-major K half: the layout LBHKNC:K=CN, one region per layer
(its tensor) at its own address. The planner cuts K and V apart where their orders
differ, so any pair of block sizes and partial pulls (a prompt's last block, a start
inside a block) move exactly the prompt's tokens. This module checks the tensors are
that shape, dense and consistent, and returns the layout, the regions and the block
count; any other shape is refused with what it is and what would work.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvbridge.connector import CacheRegions, MemType
from kvbridge.errors import ConfigError
from kvbridge.plan.geometry import ModelKVSpec, normalize_dtype
from kvbridge.plan.layout import CacheLayout, InstanceLayout

#: vLLM's CPU cache, per layer: [block][head][K then V][...], K's page half
#: [channel][token] (channel-major), V's [token][channel]
CPU_LAYOUT = CacheLayout("LBHKNC", k_inner="CN")
_LAYER = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class RegisteredCache:
    """One worker's caches as kvbridge sees them."""

    layout: InstanceLayout
    regions: CacheRegions
    num_blocks: int


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
    kv_caches: dict[str, Any], model: ModelKVSpec, tp_size: int, block_size: int
) -> RegisteredCache:
    """The layout, regions and block count of one worker's `kv_caches` (vLLM's
    `register_kv_caches` argument); ConfigError if they are not vLLM's CPU layout for
    `model` at `tp_size` and `block_size`."""
    names = sorted(kv_caches, key=layer_index)
    if len(names) != model.num_layers:
        raise ConfigError(
            f"vLLM registered {len(names)} KV caches; {model.name} has "
            f"{model.num_layers} layers (KVBridgeConnector needs one cache per layer: "
            "no pipeline parallelism, no cross-layer or hybrid caches)"
        )
    first = kv_caches[names[0]]
    heads = model.num_kv_heads // tp_size if tp_size <= model.num_kv_heads else 1
    want = (first.shape[0], heads, block_size, 2 * model.head_dim)
    addresses, lengths = [], []
    for name in names:
        t = kv_caches[name]
        if tuple(t.shape) != want or not t.is_contiguous() or t.dtype != first.dtype:
            raise ConfigError(
                f"vLLM KV cache {name!r} is {tuple(t.shape)} {t.dtype}"
                f"{'' if t.is_contiguous() else ' (strided)'}; KVBridgeConnector serves "
                f"vLLM's CPU layout [num_blocks, kv_heads_per_rank, block_size, "
                f"2*head_dim] = {want}, dense, one dtype: use the CPU attention backend"
            )
        if t.is_cuda:
            raise ConfigError(
                f"vLLM KV cache {name!r} is on {t.device}; KVBridgeConnector's vLLM glue "
                "serves CPU caches for now: use vLLM's CPU build"
            )
        addresses.append(int(t.data_ptr()))
        lengths.append(t.numel() * t.element_size())
    dtype = normalize_dtype(str(first.dtype).removeprefix("torch."))
    layout = InstanceLayout(
        tp_size=tp_size, block_size=block_size, cache_layout=CPU_LAYOUT, dtype=dtype
    )
    layout.check(model)
    regions = CacheRegions(tuple(addresses), tuple(lengths), MemType.DRAM, 0)
    return RegisteredCache(layout, regions, int(first.shape[0]))
