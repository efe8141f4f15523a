"""The seam between the driver and its workers.

An `Executor` runs one `StepBatch` on every tp worker and returns rank 0's logits. The
driver never knows whether the runners live in its own process (tp_size 1), in processes
it spawned (`tp_launcher.ProcessExecutor`, or the shared-memory `WorkerGroup` that will
replace it) or in processes torchrun started.
"""

from __future__ import annotations

import abc
from pathlib import Path

import numpy as np
import torch

from kvbridge.engine.config import EngineConfig
from kvbridge.engine.model_runner import ModelRunner
from kvbridge.engine.parallel.base import SingleProcessCommunicator
from kvbridge.engine.step import RunnerInfo, StepBatch
from kvbridge.engine.weights import Progress


class Executor(abc.ABC):
    """Owned by one LLMEngine; `execute` is called from the engine loop only."""

    info: RunnerInfo

    @abc.abstractmethod
    def execute(self, batch: StepBatch) -> np.ndarray:
        """Logits [sum(batch.want_logits), vocab] float32; raises WorkerError on failure."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop the workers; idempotent."""


class InProcessExecutor(Executor):
    """tp_size 1: the runner lives in the driver's process."""

    def __init__(
        self, model_path: Path, config: EngineConfig, progress: Progress | None = None
    ) -> None:
        torch.set_num_threads(config.num_threads or 2)
        self.runner = ModelRunner(model_path, config, SingleProcessCommunicator(), progress)
        self.info = self.runner.info()

    def execute(self, batch: StepBatch) -> np.ndarray:
        return self.runner.execute(batch)

    @property
    def kv_cache(self) -> torch.Tensor:
        """The one KV-cache tensor (for registration with the transfer layer)."""
        return self.runner.kv_cache.tensor
