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
    kv_head_range,
    region_index,
    region_shape,
    valid_tp_sizes,
)

__all__ = [
    "AttentionKind",
    "CacheLayout",
    "InstanceLayout",
    "ModelKVSpec",
    "WorkerShard",
    "from_gguf",
    "from_hf_config",
    "kv_head_range",
    "load_model_spec",
    "region_index",
    "region_shape",
    "valid_tp_sizes",
]
