"""The tensor-parallel executor of one host: tp worker processes in a `WorkerGroup`,
collectives through shared memory (kvbridge.engine.parallel).

    driver ── "step" (StepBatch msgpack) ──▶ every worker: ModelRunner.execute
       ▲                                      (shm all-reduce / all-gather between them)
       └──────────── rank 0: StepResult (logits) ◀──┘
    driver ── "kv" (ConnectorMetadata) ──▶ every worker's KVConnectorWorker.execute
       ◀──────────── KVWorkerOutput from every worker ──┘

Each worker's KV connector progresses its transfers in its own thread, also while the
worker computes a step. A connector error comes back inside its `KVWorkerOutput` and
leaves the group usable; a failed step breaks the group (WorkerError).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import msgspec
import numpy as np

from kvbridge.connector import ConnectorMetadata, ConnectorSpec, KVWorkerOutput
from kvbridge.connector.metadata import encode, metadata_decoder, output_decoder
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.errors import WorkerError
from kvbridge.engine.executor import Executor, make_worker_connector, shares_kv
from kvbridge.engine.model_runner import ModelRunner
from kvbridge.engine.parallel import ParallelError, WorkerContext, WorkerGroup
from kvbridge.engine.step import StepBatch, StepResult, info_decoder, result_decoder, step_decoder
from kvbridge.engine.step import encode as encode_msg
from kvbridge.engine.weights import Progress


class WorkerInit(msgspec.Struct, frozen=True):
    model_path: str
    config: dict[str, object]
    connector: ConnectorSpec | None = None


_init_decoder = msgspec.msgpack.Decoder(WorkerInit)


def config_fields(config: EngineConfig) -> dict[str, object]:
    fields: dict[str, object] = {f: getattr(config, f) for f in config.__dataclass_fields__}
    fields["cache_layout"] = config.cache_layout.name
    return fields


def worker_entry(ctx: WorkerContext) -> None:
    """A tp worker: load this rank's shard, attach the KV connector, serve calls."""
    init = _init_decoder.decode(ctx.init_payload)
    config = EngineConfig(**init.config)  # type: ignore[arg-type]

    def progress(stage: str, done: int, total: int) -> None:
        if total and (done == total or done % max(1, total // 5) == 0):
            ctx.report_progress(f"{stage} {done}/{total}")

    runner = ModelRunner(
        Path(init.model_path), config, ctx.comm, progress, shares_kv(init.connector)
    )
    connector = make_worker_connector(runner, config, ctx.rank, init.connector)

    def handle(method: str, payload: bytes) -> bytes:
        if method == "step":
            logits = runner.execute(step_decoder.decode(payload))
            return encode_msg(StepResult.from_array(logits)) if ctx.rank == 0 else b""
        if method == "info":
            return encode_msg(runner.info())
        if method == "kv":
            if connector is None:
                return encode(KVWorkerOutput(error="this engine has no KV connector"))
            return encode(connector.execute(metadata_decoder.decode(payload)))
        if method == "kv_endpoint":
            return connector.get_handshake_metadata().encode() if connector else b""
        raise ValueError(f"unknown worker method {method!r}")

    try:
        ctx.serve(handle)  # the connector's progress thread polls NIXL meanwhile
    finally:
        if connector is not None:
            connector.shutdown()


class ShmExecutor(Executor):
    """tp_size workers on this host (spawned processes, shared-memory collectives).

    Owned by one LLMEngine; called from its loop thread only. Every call is bounded by
    `config.worker_timeout_s`; a worker that fails or dies raises WorkerError naming it.
    """

    connector_polls_itself = True  # each worker's connector runs its progress thread

    def __init__(
        self,
        model_path: Path,
        config: EngineConfig,
        progress: Progress | None = None,
        connector: ConnectorSpec | None = None,
    ) -> None:
        init = WorkerInit(str(model_path), config_fields(config), connector)

        def on_progress(rank: int, text: str) -> None:
            if progress is not None and rank == 0:
                progress(f"tp worker 0: {text}", 0, 0)

        try:
            self.group = WorkerGroup(
                config.tp_size,
                "kvbridge.engine.shm_executor:worker_entry",
                msgspec.msgpack.encode(init),
                start_timeout=config.worker_timeout_s,
                call_timeout=config.worker_timeout_s,
                num_threads=config.torch_threads(),
                on_progress=on_progress,
            )
            infos = [info_decoder.decode(r) for r in self.group.call("info")]
        except (ParallelError, WorkerError) as exc:
            raise _worker_error(f"tp workers failed to start: {exc}", exc) from None
        self.info = infos[0]
        if any(i.num_blocks != self.info.num_blocks for i in infos):
            self.close()
            raise WorkerError(f"workers disagree on num_blocks: {[i.num_blocks for i in infos]}")

    def execute(self, batch: StepBatch) -> np.ndarray:
        try:
            (reply,) = self.group.call("step", encode_msg(batch), ranks=[0])
        except (ParallelError, WorkerError) as exc:
            raise _worker_error(f"tp step failed: {exc}", exc) from None
        return result_decoder.decode(reply).array()

    def kv_step(self, metadata: ConnectorMetadata) -> list[KVWorkerOutput]:
        try:
            replies = self.group.call("kv", encode(metadata))
        except (ParallelError, WorkerError) as exc:
            raise _worker_error(f"KV connector step failed: {exc}", exc) from None
        return [output_decoder.decode(r) for r in replies]

    def kv_handshake_metadata(self) -> list[str]:
        try:
            replies = self.group.call("kv_endpoint", b"")
        except (ParallelError, WorkerError) as exc:
            raise _worker_error(f"KV connector start-up failed: {exc}", exc) from None
        return [r.decode() for r in replies]

    def check_workers(self) -> None:
        try:
            self.group.check_alive()
        except (ParallelError, WorkerError) as exc:
            raise _worker_error(f"tp worker check failed: {exc}", exc) from None

    def close(self) -> None:
        group = getattr(self, "group", None)
        if group is not None:
            with contextlib.suppress(Exception):
                group.close()


def _worker_error(message: str, cause: Exception) -> WorkerError:
    """The engine's report of a tp worker failure, keeping the failed rank and traceback."""
    return WorkerError(message, getattr(cause, "rank", None), getattr(cause, "traceback_text", ""))
