"""The pure planning layer: model KV geometry, instance layouts, transfer plans, copy lists.

Imports numpy only; knows nothing of processes, sockets or torch.
"""

from kvbridge.plan.copylist import CopyList, copy_lists
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
from kvbridge.plan.planner import Read, TransferPlan, make_plan
from kvbridge.plan.verifier import VerificationError, verify_plan

__all__ = [
    "AttentionKind",
    "CacheLayout",
    "CopyList",
    "InstanceLayout",
    "ModelKVSpec",
    "Read",
    "TransferPlan",
    "VerificationError",
    "WorkerShard",
    "cache_shape",
    "cache_strides",
    "copy_lists",
    "from_gguf",
    "from_hf_config",
    "kv_head_range",
    "load_model_spec",
    "make_plan",
    "num_regions",
    "region_nbytes",
    "valid_tp_sizes",
    "verify_plan",
]
