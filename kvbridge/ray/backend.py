"""The connector backend Ray Serve LLM runs in each replica before vLLM starts.

Ray Serve LLM asks `KVConnectorBackendFactory` for the backend registered under the
`kv_connector` name (the driver registers this one, `register`), builds it with the
replica's own copy of the `LLMConfig` and calls `setup()` in the replica's process,
before it builds vLLM's engine from `engine_kwargs`. Ray gives a replica no address or
identity of its own in the config, so `setup()` completes the replica's
`kv_connector_extra_config`:

- `host`: the node's address in the Ray cluster (`ray.util.get_node_ip_address()`), where
  the prefill workers' side channels listen and decode workers find them;
- `credential_file`: a credential claimed from the deployment's pool
  (`enrollment.claim`; the pool is `experimental_configs[POOL_KEY]`), never one another
  replica holds or held.

The request shaping is Ray's default P/D protocol (prefill with `do_remote_decode` and one
token, decode with the prefill's `kv_transfer_params`), which is vLLM's own.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import ray
from ray.llm._internal.serve.engines.vllm.kv_transfer.base import (
    BaseConnectorBackend,
    DefaultPDProtocolMixin,
)

from kvbridge.errors import ConfigError
from kvbridge.ray.app import POOL_KEY
from kvbridge.ray.enrollment import claim

#: the `kv_connector` name the backend is registered under (vLLM's connector class)
CONNECTOR = "KVBridgeConnector"
#: where the factory imports it from in every Ray process (lazy: a string)
BACKEND_PATH = "kvbridge.ray.backend:KVBridgeConnectorBackend"


class KVBridgeConnectorBackend(DefaultPDProtocolMixin, BaseConnectorBackend):
    """Per replica: binds the side channel to the node's address and claims the
    replica's credential (module docstring). Owned by Ray Serve LLM; `setup()` runs
    once, in the replica's process."""

    def setup(self) -> None:
        pool = self.llm_config.experimental_configs.get(POOL_KEY)
        if not pool:
            raise ConfigError(
                f"experimental_configs.{POOL_KEY} is not set: name the deployment's "
                "credential pool (kvbridge.ray.app.llm_config does)"
            )
        extra: dict[str, Any] = self.kv_transfer_config.setdefault("kv_connector_extra_config", {})
        if "credential_file" in extra:
            raise ConfigError(
                "kv_connector_extra_config.credential_file is set for every replica of the "
                "deployment; leave it out: each replica claims its own from the pool"
            )
        node = ray.util.get_node_ip_address()
        claimer = {
            "role": self.kv_transfer_config.get("kv_role"),
            "node": node,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
        }
        path = claim(pool, claimer)
        extra.setdefault("host", node)
        extra["credential_file"] = str(path)


def register() -> None:
    """Register the backend cluster-wide (Ray's internal KV; once per cluster: later
    calls find it there). Call in the driver, after `ray.init`."""
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import (
        KVConnectorBackendFactory,
    )

    if not KVConnectorBackendFactory.is_registered(CONNECTOR):
        KVConnectorBackendFactory.register_backend(CONNECTOR, BACKEND_PATH)
