"""vLLM's side of the connector's settings, checked once at start-up:
`kv_connector_extra_config` is the contract's settings document
(`kvbridge.connector.settings`, `from_extra_config`), `kv_role` names the roles the
instance plays (`ROLES`), and vLLM settings the connector cannot serve are refused
(`check_vllm`), naming the field, the value and what would work, never at the first
request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvbridge.connector import ConnectorRole
from kvbridge.connector.settings import ConnectorSettings
from kvbridge.errors import ConfigError

#: kv_role -> the hand-over roles the instance plays
ROLES = {
    "kv_producer": (ConnectorRole.PRODUCER,),
    "kv_consumer": (ConnectorRole.CONSUMER,),
    "kv_both": (ConnectorRole.PRODUCER, ConnectorRole.CONSUMER),
}
#: vLLM's cache_config.cache_dtype values the connector serves: the model's dtype, or a
#: plain float cache (a decode of another float dtype casts what it pulls, `plan.cast`)
SERVED_CACHE_DTYPES = ("auto", "float16", "bfloat16")
#: vLLM's parallel_config sizes the connector serves at 1 only (pipeline parallelism is
#: served: each worker holds its stage's layers, `KVBridgeConnector.register_kv_caches`)
UNSERVED_PARALLELISM = (
    "decode_context_parallel_size",
    "prefill_context_parallel_size",
)


def from_extra_config(extra: Mapping[str, Any]) -> ConnectorSettings:
    """The connector's settings from vLLM's `kv_connector_extra_config` (every key
    optional)."""
    return ConnectorSettings.from_mapping(
        extra, "kv_connector_extra_config", "a KVBridgeConnector setting"
    )


def check_vllm(vllm_config: Any) -> None:
    """Refuse vLLM settings the connector does not serve (field, value, what works).
    MLA models are served: their caches are the MLA backends' latent
    (`kvbridge.plan.backends`), which every decode worker holds whole."""
    kv = vllm_config.kv_transfer_config
    if kv.kv_role not in ROLES:
        raise ConfigError(
            f"kv_transfer_config.kv_role={kv.kv_role!r} is not served by KVBridgeConnector; "
            f"use one of {', '.join(ROLES)}"
        )
    cache = getattr(vllm_config, "cache_config", None)
    cache_dtype = getattr(cache, "cache_dtype", "auto")
    if cache_dtype not in SERVED_CACHE_DTYPES:
        raise ConfigError(
            f"cache_config.cache_dtype={cache_dtype!r} (--kv-cache-dtype) is not served by "
            "KVBridgeConnector: vLLM scales or packs such a cache per layer, which moving "
            f"or casting its bytes does not carry; use one of {', '.join(SERVED_CACHE_DTYPES)}"
        )
    for name in UNSERVED_PARALLELISM:
        value = getattr(vllm_config.parallel_config, name, 1)
        if value != 1:
            raise ConfigError(
                f"parallel_config.{name}={value} is not supported by KVBridgeConnector yet; "
                "use 1 (a context-parallel cache splits each layer's tokens over workers)"
            )
