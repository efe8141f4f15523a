"""The seam between the driver and its workers.

An `Executor` runs one `StepBatch` on every tp worker and returns rank 0's logits. The
driver never knows whether the runners live in its own process (tp_size 1,
`InProcessExecutor`), in processes it spawned (`shm_executor.ShmExecutor`: a
`WorkerGroup` with shared-memory collectives) or in processes torchrun started
(`torchrun.DistributedExecutor`).
"""

from __future__ import annotations

import abc
from pathlib import Path

import numpy as np
import torch

from kvbridge.engine.config import EngineConfig
from kvbridge.engine.errors import EngineError
from kvbridge.engine.model_runner import ModelRunner
from kvbridge.engine.parallel.base import SingleProcessCommunicator
from kvbridge.engine.step import RunnerInfo, StepBatch
from kvbridge.engine.weights import Progress
from kvbridge.plan.layout import num_regions
from kvbridge.transfer.connector import (
    ConnectorReply,
    ConnectorRequest,
    ConnectorSpec,
    WorkerConnector,
)


class Executor(abc.ABC):
    """Owned by one LLMEngine; `execute` is called from the engine loop only."""

    info: RunnerInfo
    #: True when the workers progress their KV connector by themselves (each
    #: `WorkerConnector` runs its progress thread); otherwise the driver must send
    #: `Poll` now and then (an idle producer answers handshakes and runs leases only
    #: when polled).
    connector_polls_itself: bool = False

    @abc.abstractmethod
    def execute(self, batch: StepBatch) -> np.ndarray:
        """Logits [sum(batch.want_logits), vocab] float32; raises WorkerError on failure."""

    def connector_call(self, request: ConnectorRequest) -> list[ConnectorReply]:
        """Run `WorkerConnector.handle(request)` on every worker; replies in rank order."""
        raise EngineError("this engine was started without a KV connector")

    def check_workers(self) -> None:  # noqa: B027 - optional hook
        """Raise WorkerError if a worker process has died (no wait); in-process: no-op."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop the workers; idempotent."""


def make_worker_connector(
    runner: ModelRunner, config: EngineConfig, rank: int, spec: ConnectorSpec | None
) -> WorkerConnector | None:
    """The transfer runtime over this worker's KV cache, if the instance has one: the
    cache tensor, in the layout's axis order, cut into the planner's regions."""
    if spec is None:
        return None
    model = runner.model_config.kv_spec(config.kv_dtype)
    layout = config.layout()
    regions = num_regions(model, layout, layout.workers(model)[rank])
    from kvbridge.transfer.regions import CacheRegions

    return WorkerConnector(
        spec,
        model,
        layout,
        rank,
        CacheRegions.from_tensor(runner.kv_cache.tensor, regions),
        runner.kv_cache.num_blocks,
    )


class InProcessExecutor(Executor):
    """tp_size 1: the runner lives in the driver's process (its KV connector's
    progress thread too)."""

    connector_polls_itself = True

    def __init__(
        self,
        model_path: Path,
        config: EngineConfig,
        progress: Progress | None = None,
        connector: ConnectorSpec | None = None,
    ) -> None:
        torch.set_num_threads(config.num_threads or 2)
        self.runner = ModelRunner(model_path, config, SingleProcessCommunicator(), progress)
        self.info = self.runner.info()
        self.connector = make_worker_connector(self.runner, config, 0, connector)

    def execute(self, batch: StepBatch) -> np.ndarray:
        return self.runner.execute(batch)

    def connector_call(self, request: ConnectorRequest) -> list[ConnectorReply]:
        if self.connector is None:
            return super().connector_call(request)
        return [self.connector.handle(request)]

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()
            self.connector = None

    @property
    def kv_cache(self) -> torch.Tensor:
        """The one KV-cache tensor (for registration with the transfer layer)."""
        return self.runner.kv_cache.tensor
