"""kvbridge as a vLLM v1 KV connector.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {...}}'

vLLM's `KVConnectorFactory` imports this module and takes `KVBridgeConnector`; vLLM is
imported only then (`connector.py` and `stats.py` subclass vLLM's classes; the other
modules need none of it: `models.py` makes model folders, `settings.py` reads the extra
config, `cache.py` names vLLM's caches in kvbridge's layout terms, `scheduler.py` reads
its requests by their attributes). docs/vllm.md says what it supports and how to switch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVBridgeConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVBridgeConnector":
        from kvbridge.vllm.connector import KVBridgeConnector

        return KVBridgeConnector
    raise AttributeError(f"module 'kvbridge.vllm' has no attribute {name!r}")
