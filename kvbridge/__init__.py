"""kvbridge: move paged KV caches between prefill and decode instances of any layout.

The planning API (numpy only; what `pip install kvbridge` gives):

    model = kvbridge.load_model_spec("config.json")      # or ModelKVSpec(...)
    plan = kvbridge.make_plan(model, kvbridge.InstanceLayout(tp_size=2),
                              kvbridge.InstanceLayout(tp_size=4, cache_layout="LBHNC"))
    lists = kvbridge.copy_lists(plan, decode_rank, prefill_block_ids, decode_block_ids, n)
    kvbridge.verify_plan(plan, num_tokens=100)          # byte-exact on numpy buffers

An engine hosts the runtime (`kvbridge.transfer`, extra `transfer`: NIXL, ZMQ, msgspec)
through the connector contract, `kvbridge.connector`; see docs/embedding.md.
"""

from kvbridge.errors import (
    ConfigError,
    IncompatibleError,
    KVBridgeError,
    LayoutError,
    WorkerError,
)
from kvbridge.plan.copylist import CopyList, copy_lists
from kvbridge.plan.geometry import AttentionKind, ModelKVSpec, load_model_spec
from kvbridge.plan.layout import CacheLayout, InstanceLayout, WorkerShard
from kvbridge.plan.planner import Read, TransferPlan, make_plan
from kvbridge.plan.verifier import VerificationError, verify_plan

__all__ = [
    "AttentionKind",
    "CacheLayout",
    "ConfigError",
    "CopyList",
    "IncompatibleError",
    "InstanceLayout",
    "KVBridgeError",
    "LayoutError",
    "ModelKVSpec",
    "Read",
    "TransferPlan",
    "VerificationError",
    "WorkerError",
    "WorkerShard",
    "copy_lists",
    "load_model_spec",
    "make_plan",
    "verify_plan",
]
__version__ = "0.1.0"
