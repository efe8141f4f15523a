"""The connector's worker side in vLLM: one per worker (TP rank), in the worker process.

It only translates: vLLM's registered caches (`cache.describe_kv_caches`) are handed to
the hand-over contract's worker sides (`kvbridge.connector.RoleWorkers`), one per role
the instance plays, each with its own NIXL agent and progress thread. Their reports go
back to vLLM three ways: its finished sets and load-error blocks (which vLLM acts on),
the reports themselves (for the scheduler side's request states, through vLLM's
connector worker metadata), and figures per pull for vLLM's metrics (`stats.py`).
Nothing here imports vLLM.
"""

from __future__ import annotations

import logging

from kvbridge.connector import ConnectorRole, RoleWorkers
from kvbridge.connector.settings import ConnectorSettings
from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.vllm.cache import RegisteredCache

#: under vLLM's "vllm" logger, so vLLM's handlers print it
log = logging.getLogger("vllm.kvbridge")


def worker_side(
    settings: ConnectorSettings,
    instance_id: str,
    roles: tuple[ConnectorRole, ...],
    model: ModelKVSpec,
    cache: RegisteredCache,
    rank: int,
) -> RoleWorkers:
    """One TP rank's hand-over workers over vLLM's cache (`register_kv_caches`); a
    prefill cache is moved into shared memory where its KV is exported (`adopt`)."""
    specs = [c.spec for c in settings.configs(instance_id, roles)]
    workers = RoleWorkers(specs, model, cache.layout, rank, log)
    workers.register_regions(cache.regions, cache.num_blocks, adopt=True)
    return workers
