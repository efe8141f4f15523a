"""The project's exception hierarchy.

Every refusal names the field, the value received and what would work, e.g.
"decode tp_size=6 neither divides nor is a multiple of num_kv_heads=8; use 1, 2, 4, 8, 16".
"""


class KVBridgeError(Exception):
    """Root of every error kvbridge raises on purpose."""


class ConfigError(KVBridgeError):
    """A model configuration (config.json, GGUF) is unreadable or has a bad field, or an
    optional package a flag needs is not installed."""


class LayoutError(KVBridgeError):
    """An instance layout (tp, pp, block size, cache layout) is invalid for the model."""


class IncompatibleError(KVBridgeError):
    """A prefill/decode pair cannot exchange KV caches (different models, dtypes, ...)."""


class WorkerError(KVBridgeError):
    """A worker process (a tp worker of an engine, a transfer worker of the harness)
    failed, died or did not answer in time. `rank` names it when known;
    `traceback_text` carries its traceback when its code raised."""

    def __init__(self, message: str, rank: int | None = None, traceback_text: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback_text = traceback_text
