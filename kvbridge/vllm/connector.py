"""`KVBridgeConnector`: vLLM's v1 KV connector API over kvbridge's planner and runtime.

vLLM builds it once per engine with role SCHEDULER (in the EngineCore process:
`scheduler.SchedulerSide`) and once per worker with role WORKER (`worker.WorkerSide`,
built when vLLM registers the KV caches). The scheduler side learns the workers'
side-channel endpoints through vLLM's handshake metadata and sends each step's orders
(`StepOrders`) to the workers as the connector metadata. Transfers are asynchronous:
loads complete between steps (`get_finished`); failed loads are reported as blocks
(`get_block_ids_with_load_errors`) so vLLM recomputes them or fails the request, as
its `kv_load_failure_policy` says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    CacheHitSource,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvbridge.plan.geometry import load_model_spec
from kvbridge.vllm.cache import describe_kv_caches
from kvbridge.vllm.scheduler import SchedulerSide, StepOrders
from kvbridge.vllm.settings import ConnectorSettings, check_vllm
from kvbridge.vllm.stats import KVBridgeConnectorStats, KVBridgePromMetrics
from kvbridge.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    """One step's orders from the scheduler side to every worker."""

    orders: StepOrders


@dataclass
class KVBridgeHandshake(KVConnectorHandshakeMetadata):
    """A worker's producer side channel ("" without one) and its consumer's `sibling`
    (base64; "" without one: the fan-out), for the scheduler side."""

    endpoint: str
    sibling: str = ""


class KVBridgeConnector(KVConnectorBase_V1):
    """kvbridge's connector for vLLM: any prefill/decode TP pair and block sizes the
    planner can map, pulled with NIXL, capabilities and leases (docs/vllm.md)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kv = vllm_config.kv_transfer_config
        assert kv is not None
        check_vllm(vllm_config)
        self.settings = ConnectorSettings.from_extra_config(dict(kv.kv_connector_extra_config))
        self.instance_id = self.settings.instance_id or str(kv.engine_id)
        if self.settings.identity is not None:  # every process reads the same key
            self.instance_id = self.settings.identity.bind(self.instance_id)
        self.kv_role = str(kv.kv_role)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self._load_errors: set[int] = set()  # blocks that failed to load, not reported yet
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(
                self.settings, self.instance_id, self.kv_role, self.block_size
            )

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        model = load_model_spec(self._vllm_config.model_config.model)
        cache = describe_kv_caches(kv_caches, model, self.tp_size, self.block_size)
        self.worker = WorkerSide(
            self.settings,
            self.instance_id,
            self.kv_role,
            model,
            cache,
            get_tensor_model_parallel_rank(),
        )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self.worker is None:
            return KVBridgeHandshake("")
        return KVBridgeHandshake(self.worker.endpoint, self.worker.sibling)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBridgeMetadata) and self.worker is not None
        self.worker.apply(meta.orders)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and asynchronous

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # a decode worker reads the prefill's blocks in place

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        wait_s = meta.orders.idle_wait_s if isinstance(meta, KVBridgeMetadata) else 0.0
        res = self.worker.collect(wait_s)
        self._load_errors |= res.failed_block_ids
        return res.finished_sending or None, res.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self.worker.take_observations() if self.worker is not None else None
        return KVBridgeConnectorStats(data=dict(data)) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVBridgeConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    # -- scheduler side ------------------------------------------------------------------
    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        assert self.scheduler is not None
        endpoints = [getattr(metadata[r], "endpoint", "") for r in sorted(metadata)]
        if all(endpoints):
            self.scheduler.set_endpoints(endpoints)
        siblings = [getattr(metadata[r], "sibling", "") for r in sorted(metadata)]
        if all(siblings):
            self.scheduler.set_siblings(siblings)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        self.scheduler.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return KVBridgeMetadata(
            self.scheduler.build_orders(scheduler_output.total_num_scheduled_tokens)
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        assert self.scheduler is not None
        ok = request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )
        ids = block_ids[0] if block_ids and isinstance(block_ids[0], list | tuple) else block_ids
        return self.scheduler.request_finished(request, list(ids), ok)
