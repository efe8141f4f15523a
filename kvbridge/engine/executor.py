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

from kvbridge.connector import ConnectorMetadata, ConnectorSpec, KVWorkerOutput
from kvbridge.connector.worker import KVConnectorWorker
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.cpu_share import thread_ids, yield_compute
from kvbridge.engine.errors import EngineError
from kvbridge.engine.model_runner import ModelRunner
from kvbridge.engine.parallel.base import SingleProcessCommunicator
from kvbridge.engine.step import RunnerInfo, StepBatch
from kvbridge.engine.weights import Progress


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

    def kv_step(self, metadata: ConnectorMetadata) -> list[KVWorkerOutput]:
        """Run `KVConnectorWorker.execute(metadata)` on every worker; reports in rank order."""
        raise EngineError("this engine was started without a KV connector")

    def kv_handshake_metadata(self) -> list[str]:
        """Every worker's `KVConnectorWorker.get_handshake_metadata()`, in rank order."""
        raise EngineError("this engine was started without a KV connector")

    def check_workers(self) -> None:  # noqa: B027 - optional hook
        """Raise WorkerError if a worker process has died (no wait); in-process: no-op."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop the workers; idempotent."""


def shares_kv(spec: ConnectorSpec | None) -> bool:
    """Whether a worker of `spec` allocates its KV cache in shared memory: a producer
    that exports it from a process of its own (`TransferConfig.kv_export`)."""
    return spec is not None and spec.exports_kv


def make_worker_connector(
    runner: ModelRunner, config: EngineConfig, rank: int, spec: ConnectorSpec | None
) -> KVConnectorWorker | None:
    """This worker's side of the KV connector over its cache, if the instance has one;
    then this process's compute threads, not the connector's, get their nice value
    raised by `config.cpu_nice` (`cpu_share.py`)."""
    compute = thread_ids() if config.cpu_nice else set()  # (/proc: Linux only)
    worker = None
    if spec is not None:
        model = runner.model_config.kv_spec(config.kv_dtype)
        worker = KVConnectorWorker(spec, model, config.layout(), rank)
        worker.register_kv_caches(
            runner.kv_cache.tensor, runner.kv_cache.num_blocks, segment=runner.kv_cache.segment
        )
    if config.cpu_nice:
        yield_compute(config.cpu_nice, keep=thread_ids() - compute)
    return worker


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
        torch.set_num_threads(config.torch_threads())
        self.runner = ModelRunner(
            model_path, config, SingleProcessCommunicator(), progress, shares_kv(connector)
        )
        self.info = self.runner.info()
        self.connector = make_worker_connector(self.runner, config, 0, connector)

    def execute(self, batch: StepBatch) -> np.ndarray:
        return self.runner.execute(batch)

    def kv_step(self, metadata: ConnectorMetadata) -> list[KVWorkerOutput]:
        if self.connector is None:
            return super().kv_step(metadata)
        return [self.connector.execute(metadata)]

    def kv_handshake_metadata(self) -> list[str]:
        if self.connector is None:
            return super().kv_handshake_metadata()
        return [self.connector.get_handshake_metadata()]

    def close(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
            self.connector = None

    @property
    def kv_cache(self) -> torch.Tensor:
        """The one KV-cache tensor (for registration with the transfer layer)."""
        return self.runner.kv_cache.tensor
