"""The Ray Serve LLM P/D application, as plain dicts (no Ray import).

`pd_serving_args(cfg)` is what `ray.serve.llm.build_pd_openai_app` takes: a prefill and a
decode `LLMConfig` (as dicts Ray validates) and the ingress's deployment options. Each
LLM deployment

- runs vLLM's CPU build (`accelerator_config` kind cpu: one CPU bundle per TP worker),
- is pinned to the nodes that offer its custom resource (every bundle of its placement
  group asks for one unit: `ray start --resources '{"NAME": N}'` on those nodes),
- selects KVBridgeConnector in `engine_kwargs.kv_transfer_config` with the deployment's
  kv_role (prefill kv_producer, decode kv_consumer) and the shared secret as a file
  path (`token_file`); the replica's own credential comes from a pool of credentials
  enrolled for that role (`experimental_configs`, read by the connector backend,
  `backend.py`, which also binds the side channel to the replica's node address).

No secret is in these dicts, and none is in an environment variable: Ray Serve prints
`runtime_env` and deployment configs in its logs. Secrets are paths to files the nodes
can read (0600).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.vllm.launch import KV_ROLES, LOADED_HOST_SETTINGS, kv_transfer_config

#: the `experimental_configs` key naming a deployment's credential pool (`enrollment.py`)
POOL_KEY = "kvbridge_credential_pool"
#: vLLM's CPU build on a small shared host (the same as `kvbridge.vllm.launch`'s
#: command-line settings): float32 (the tokens compared), a short context, a small cache
SMALL_HOST_ENGINE_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 1024,
    "max_num_seqs": 4,
    "seed": 0,
    "enforce_eager": True,
    "num_gpu_blocks_override": 128,
}
#: the replicas' environment: nothing secret (Serve logs it)
REPLICA_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # more workers than cores here
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "900",
    "NIXL_LOG_LEVEL": "WARN",
    "TOKENIZERS_PARALLELISM": "false",
}


class Side(Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class Deployment:
    """One LLM deployment of the application: its tp_size, block_size, replicas, the
    custom resource of the nodes it runs on, and its credential pool (a directory on
    those nodes)."""

    tp_size: int
    node_resource: str
    credential_pool: str
    block_size: int = 32
    num_replicas: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ConfigError(f"tp_size={self.tp_size}: use 1 or more")
        if self.block_size <= 0 or self.block_size % 32:
            raise ConfigError(
                f"block_size={self.block_size}: vLLM's CPU build takes multiples of 32"
            )
        if self.num_replicas < 1:
            raise ConfigError(f"num_replicas={self.num_replicas}: use 1 or more")
        if not self.node_resource:
            raise ConfigError("node_resource is empty: name the custom resource of its nodes")


@dataclass(frozen=True)
class RayPDConfig:
    """The application: a model folder every node can read (vLLM loads it locally), the
    id clients name it by, the two deployments, the ingress's node resource, the shared
    secret's file, vLLM's `kv_load_failure_policy` and the connector's `lease_s` (how
    long a prefill keeps blocks no decode said it read; None: `LOADED_HOST_SETTINGS`')."""

    model: str
    prefill: Deployment
    decode: Deployment
    token_file: str
    ingress_resource: str
    model_id: str = "smollm2"
    failure_policy: str = "fail"
    lease_s: float | None = None

    def __post_init__(self) -> None:
        if self.failure_policy not in ("fail", "recompute"):
            raise ConfigError(f"failure_policy={self.failure_policy!r}: use 'fail' or 'recompute'")
        if self.lease_s is not None and not self.lease_s > 0:
            raise ConfigError(f"lease_s={self.lease_s!r}: use a positive number of seconds")
        if not self.token_file:
            raise ConfigError(
                "token_file is empty: replicas on different nodes need a shared secret"
            )

    def deployment(self, side: Side) -> Deployment:
        return self.prefill if side is Side.PREFILL else self.decode


def llm_config(cfg: RayPDConfig, side: Side) -> dict[str, Any]:
    """One side's `LLMConfig`, as a dict."""
    dep = cfg.deployment(side)
    extra = {**LOADED_HOST_SETTINGS, "token_file": cfg.token_file}
    if cfg.lease_s is not None:
        extra["lease_s"] = cfg.lease_s
    kv = json.loads(kv_transfer_config(KV_ROLES[side.value], extra, cfg.failure_policy))
    return {
        "model_loading_config": {"model_id": cfg.model_id, "model_source": cfg.model},
        "accelerator_config": {"kind": "cpu"},
        "engine_kwargs": {
            **SMALL_HOST_ENGINE_KWARGS,
            "tensor_parallel_size": dep.tp_size,
            "block_size": dep.block_size,
            "kv_transfer_config": kv,
        },
        # every worker's bundle on a node with the deployment's resource; STRICT_PACK:
        # one node per replica (its workers share memory, as one vLLM instance's do)
        "placement_group_config": {
            "bundle_per_worker": {"CPU": 1, dep.node_resource: 1},
            "strategy": "STRICT_PACK",
        },
        "deployment_config": {"num_replicas": dep.num_replicas},
        "runtime_env": {"env_vars": dict(REPLICA_ENV)},
        "experimental_configs": {POOL_KEY: dep.credential_pool},
    }


def pd_serving_args(cfg: RayPDConfig) -> dict[str, Any]:
    """`build_pd_openai_app`'s argument: both LLM configs and the ingress pinned to the
    nodes offering `ingress_resource`."""
    return {
        "prefill_config": llm_config(cfg, Side.PREFILL),
        "decode_config": llm_config(cfg, Side.DECODE),
        "ingress_deployment_config": {
            "ray_actor_options": {"num_cpus": 1, "resources": {cfg.ingress_resource: 1}},
        },
    }
