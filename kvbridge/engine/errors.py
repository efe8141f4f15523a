"""Errors the engine raises on purpose (all are `KVBridgeError`s)."""

from __future__ import annotations

from kvbridge.errors import ConfigError, KVBridgeError, WorkerError

__all__ = ["EngineError", "ModelLoadError", "OutOfBlocksError", "RequestError", "WorkerError"]


class EngineError(KVBridgeError):
    """The engine refused or failed a request, or a worker died."""


class ModelLoadError(ConfigError):
    """A model path, weight file or tokenizer cannot be used."""


class OutOfBlocksError(EngineError):
    """The paged KV cache has no free blocks for an allocation."""


class RequestError(EngineError):
    """A request is invalid (empty prompt, too long for the context, bad sampling params)."""
