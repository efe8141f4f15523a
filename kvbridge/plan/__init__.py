"""The pure planning layer: model KV geometry, instance layouts, transfer plans, copy lists.

Imports numpy only; knows nothing of processes, sockets or torch.
"""

from kvbridge.plan.geometry import (
    AttentionKind,
    ModelKVSpec,
    from_gguf,
    from_hf_config,
    load_model_spec,
)
from kvbridge.plan.layout import (
    CacheLayout,
    InstanceLayout,
    WorkerShard,
    cache_shape,
    cache_strides,
    kv_head_range,
    num_regions,
    region_nbytes,
    valid_tp_sizes,
)

__all__ = [
    "AttentionKind",
    "CacheLayout",
    "InstanceLayout",
    "ModelKVSpec",
    "WorkerShard",
    "cache_shape",
    "cache_strides",
    "from_gguf",
    "from_hf_config",
    "kv_head_range",
    "load_model_spec",
    "num_regions",
    "region_nbytes",
    "valid_tp_sizes",
]
