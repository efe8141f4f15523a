"""The KV connector: one contract between an engine and the transfer runtime, shaped like
vLLM's v1 KV connector (`vllm/distributed/kv_transfer/kv_connector/v1/base.py`).

Layer 3, above `kvbridge.transfer` and below any engine that hosts it: our engine
(`kvbridge.engine`) and vLLM both host the same connector. Its scheduler side
(`KVConnectorScheduler`, in the driver) owns each request's hand-over as explicit
`RequestState`s and sends typed `ConnectorMetadata` to its worker side
(`KVConnectorWorker`, one per worker process), which wraps the transfer layer's
`WorkerConnector`. `KVTransferParams` is a request's hand-over record. An instance
that plays several roles (a producer and a consumer) drives one of each per role
(`RoleSchedulers`, `RoleWorkers`); `stats.py` keeps a decode worker's pulls as figures;
`ConnectorSettings` is a connector's configuration as a config document names it.

The layers above (the engine, serve) reach the transfer runtime only through here: its
configuration (`TransferConfig`, `FanOut`, `KVExport`, `Integrity`), the shared-memory
segment an exported cache lives in (`SharedSegment`), reading the shared secret
(`load_token`) and a few helpers are re-exported here; `security.py` has the keys and
HMACs derived from the secret.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Pure modules load at once (the CLI's base install reads KVLoadFailure for its flags);
# the rest, which needs msgspec and the transfer runtime, on first use.
from kvbridge.connector.states import (
    TRANSITIONS,
    CapabilityRefused,
    ConnectorError,
    InvalidTransition,
    KVLoadFailure,
    RequestState,
)
from kvbridge.transfer.config import FanOut, KVExport, TransferConfig, is_loopback, load_token
from kvbridge.transfer.integrity import Integrity

if TYPE_CHECKING:
    from kvbridge.connector.metadata import (
        ConnectorMetadata,
        KVTransferParams,
        KVWorkerOutput,
        RemoteDecode,
        RemotePrefill,
    )
    from kvbridge.connector.roles import RoleSchedulers, RoleWorkers
    from kvbridge.connector.scheduler import KVConnectorConfig, KVConnectorScheduler, KVRequest
    from kvbridge.connector.settings import ConnectorSettings
    from kvbridge.transfer.connector import (
        BUSY_POLL_S,
        IDLE_POLL_S,
        ConnectorRole,
        ConnectorSpec,
        Pull,
    )
    from kvbridge.transfer.credential import Credential, RootKey
    from kvbridge.transfer.export import SharedSegment
    from kvbridge.transfer.identity import Identity
    from kvbridge.transfer.netdev import device_of as net_device_of
    from kvbridge.transfer.netdev import free_port
    from kvbridge.transfer.regions import CacheRegions, MemType, memory_of

_LAZY = {
    "Identity": "kvbridge.transfer.identity",
    **dict.fromkeys(["Credential", "RootKey"], "kvbridge.transfer.credential"),
    "SharedSegment": "kvbridge.transfer.export",
    "free_port": "kvbridge.transfer.netdev",
    **dict.fromkeys(["CacheRegions", "MemType", "memory_of"], "kvbridge.transfer.regions"),
    **dict.fromkeys(
        [
            "ConnectorMetadata",
            "KVTransferParams",
            "KVWorkerOutput",
            "RemoteDecode",
            "RemotePrefill",
        ],
        "kvbridge.connector.metadata",
    ),
    **dict.fromkeys(
        ["KVConnectorConfig", "KVConnectorScheduler", "KVRequest"], "kvbridge.connector.scheduler"
    ),
    **dict.fromkeys(["RoleSchedulers", "RoleWorkers"], "kvbridge.connector.roles"),
    "ConnectorSettings": "kvbridge.connector.settings",
    **dict.fromkeys(
        ["BUSY_POLL_S", "IDLE_POLL_S", "ConnectorRole", "ConnectorSpec", "Pull"],
        "kvbridge.transfer.connector",
    ),
}


def __getattr__(name: str) -> Any:
    if name == "net_device_of":
        return importlib.import_module("kvbridge.transfer.netdev").device_of
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvbridge.connector' has no attribute {name!r}")


__all__ = [
    "BUSY_POLL_S",
    "IDLE_POLL_S",
    "TRANSITIONS",
    "CacheRegions",
    "CapabilityRefused",
    "ConnectorError",
    "ConnectorMetadata",
    "ConnectorRole",
    "ConnectorSettings",
    "ConnectorSpec",
    "Credential",
    "FanOut",
    "Identity",
    "Integrity",
    "InvalidTransition",
    "KVConnectorConfig",
    "KVConnectorScheduler",
    "KVExport",
    "KVLoadFailure",
    "KVRequest",
    "KVTransferParams",
    "KVWorkerOutput",
    "MemType",
    "Pull",
    "RemoteDecode",
    "RemotePrefill",
    "RequestState",
    "RoleSchedulers",
    "RoleWorkers",
    "RootKey",
    "SharedSegment",
    "TransferConfig",
    "free_port",
    "is_loopback",
    "load_token",
    "memory_of",
    "net_device_of",
]
