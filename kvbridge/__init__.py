"""kvbridge: move paged KV caches between prefill and decode instances of any layout."""

from kvbridge.errors import KVBridgeError

__all__ = ["KVBridgeError"]
__version__ = "0.1.0"
