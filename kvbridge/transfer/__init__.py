"""The transfer runtime: move a request's KV blocks between worker processes with NIXL.

One `WorkerConnector` per worker process that owns a KV cache, driven with typed
requests (`GetEndpoint`, `SetEndpoints`, `Expose`, `Pull`, `Poll`); the connector layer
(`kvbridge.connector`, what an engine hosts: docs/embedding.md) wraps it in its
`KVConnectorWorker` and folds the workers' events into one outcome per request on the
driver. Underneath (mirrors vLLM's KV-connector lifecycle):
  * prefill worker: `KVProducer.expose(request_id, block_ids, num_tokens)`, then call
    `poll()` from its loop; `on_release` hands the blocks back once every expected
    decode worker notified completion (or the lease expired).
  * decode worker: `KVConsumer.pull(request_id, endpoint, producer_block_ids,
    local_block_ids, num_tokens)` returns at once; `poll()` reports each request once
    as DONE or FAILED with its reason.
Both take a `Transport` (`NixlTransport`: one NIXL agent per process, cache regions
registered once) and a `TransferConfig`. Modules importing NIXL, ZMQ or msgspec are
imported lazily by their users; this package itself imports none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbridge.transfer.agent import NixlTransport, Transport, XferState
    from kvbridge.transfer.config import TransferConfig, load_token
    from kvbridge.transfer.connector import (
        Cancel,
        Connect,
        ConnectorEvent,
        ConnectorReply,
        ConnectorRequest,
        ConnectorRole,
        ConnectorSpec,
        Expose,
        GetEndpoint,
        Poll,
        Pull,
        SetEndpoints,
        SetSiblings,
        WorkerConnector,
    )
    from kvbridge.transfer.consumer import KVConsumer
    from kvbridge.transfer.errors import AuthError, HandshakeError, ProtocolError, TransferError
    from kvbridge.transfer.producer import KVProducer, Release, ReleaseCause
    from kvbridge.transfer.pull import TransferResult, TransferState
    from kvbridge.transfer.regions import CacheRegions, MemType

_EXPORTS = {
    "NixlTransport": "agent",
    "Transport": "agent",
    "XferState": "agent",
    "Cancel": "connector",
    "Decline": "connector",
    "Connect": "connector",
    "ConnectorEvent": "connector",
    "ConnectorReply": "connector",
    "ConnectorRequest": "connector",
    "ConnectorRole": "connector",
    "ConnectorSpec": "connector",
    "Expose": "connector",
    "GetEndpoint": "connector",
    "Poll": "connector",
    "Pull": "connector",
    "SetEndpoints": "connector",
    "SetSiblings": "connector",
    "WorkerConnector": "connector",
    "TransferConfig": "config",
    "load_token": "config",
    "KVConsumer": "consumer",
    "AuthError": "errors",
    "HandshakeError": "errors",
    "ProtocolError": "errors",
    "TransferError": "errors",
    "KVProducer": "producer",
    "Release": "producer",
    "ReleaseCause": "producer",
    "TransferResult": "pull",
    "TransferState": "pull",
    "CacheRegions": "regions",
    "MemType": "regions",
}
__all__ = [
    "AuthError",
    "CacheRegions",
    "Cancel",
    "Connect",
    "ConnectorEvent",
    "ConnectorReply",
    "ConnectorRequest",
    "ConnectorRole",
    "ConnectorSpec",
    "Decline",
    "Expose",
    "GetEndpoint",
    "HandshakeError",
    "KVConsumer",
    "KVProducer",
    "MemType",
    "NixlTransport",
    "Poll",
    "ProtocolError",
    "Pull",
    "Release",
    "ReleaseCause",
    "SetEndpoints",
    "SetSiblings",
    "TransferConfig",
    "TransferError",
    "TransferResult",
    "TransferState",
    "Transport",
    "WorkerConnector",
    "XferState",
    "load_token",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"kvbridge.transfer.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'kvbridge.transfer' has no attribute {name!r}")
