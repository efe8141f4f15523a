"""`KVBridgeConnector`: vLLM's v1 KV connector API, translated onto kvbridge's hand-over
contract (`kvbridge.connector`).

vLLM builds it once per engine with role SCHEDULER (in the EngineCore process:
`scheduler.SchedulerSide`) and once per worker with role WORKER (the contract's
`RoleWorkers` over the caches vLLM registers, `cache.describe_kv_caches`). Each side
holds the contract's own objects, one per role the instance plays: the scheduler side's
orders reach the workers as the connector metadata, the workers' reports come back as
the connector worker metadata. A worker carries out a step's orders when vLLM binds
them, before the forward (`bind_connector_metadata`). A first pull from a producer is
asynchronous (it completes between steps, `get_finished`); the next ones go in step
(vLLM takes the request in the step that allocated its blocks, the workers end the
pull before that step's forward: `SchedulerSide`). Failed loads are reported as blocks
(`get_block_ids_with_load_errors`; with several KV cache groups, whose block ids vLLM
cannot map back, as failed requests of asynchronous loads: `get_transfer_results`) so
vLLM recomputes them or fails the request, as its `kv_load_failure_policy` says; each
pull's figures, and a prefill's pinned blocks and releases, feed vLLM's metrics
(`stats.py`). It supports vLLM's hybrid KV cache
manager (`SupportsHMA`): a hybrid model's KV cache groups each move their own blocks,
a sliding-window group only those still inside its window (`cache.py`, `scheduler.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    CacheHitSource,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvbridge.connector import ConnectorRole, RoleWorkers
from kvbridge.connector.roles import decode_reports, encode_reports
from kvbridge.connector.stats import ExposureTally
from kvbridge.errors import ConfigError
from kvbridge.plan.geometry import load_model_spec
from kvbridge.vllm.cache import CacheFormat, describe_kv_caches, pipeline_layers
from kvbridge.vllm.scheduler import Orders, SchedulerSide, log
from kvbridge.vllm.settings import ROLES, check_vllm, from_extra_config
from kvbridge.vllm.stats import KVBridgeConnectorStats, KVBridgePromMetrics

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    """One step's orders from the scheduler side to every worker, per role, and the
    requests (vLLM's ids) whose pulls end before the step's forward (in step)."""

    orders: Orders
    in_step: list[str] = field(default_factory=list)


@dataclass
class KVBridgeWorkerMeta(KVConnectorWorkerMetadata):
    """The workers' reports of one step (`encode_reports`), gathered over the TP
    workers by vLLM for the scheduler side."""

    reports: list[tuple[ConnectorRole, bytes]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVBridgeWorkerMeta)
        self.reports += other.reports
        return self


@dataclass
class KVBridgeHandshake(KVConnectorHandshakeMetadata):
    """A worker's producer side channel ("" without one) and its consumer's `sibling`
    (base64; "" without one: the fan-out), for the scheduler side."""

    endpoint: str
    sibling: str = ""


def state_groups(kv_cache_config: KVCacheConfig | None) -> frozenset[int]:
    """The KV cache groups of SSM layers (vLLM's `MambaSpec`: a conv and an SSM state per
    request, no token axis), whose running state is a request's last block; ConfigError
    for a group where it is not: Mamba cache mode "align" (a state per block of tokens,
    vLLM's prefix caching of SSM hybrids) or speculative decoding's scratch blocks."""
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    found = [g for g, group in enumerate(groups) if isinstance(group.kv_cache_spec, MambaSpec)]
    for g in found:
        spec, layers = groups[g].kv_cache_spec, ", ".join(groups[g].layer_names)
        if spec.mamba_cache_mode != "none":
            raise ConfigError(
                f"cache_config.mamba_cache_mode={spec.mamba_cache_mode!r} (KV cache group {g}: "
                f"{layers}) is not served by KVBridgeConnector: it moves an SSM layer's "
                "state as a request's one running block; use --no-enable-prefix-caching "
                "(mamba_cache_mode 'none')"
            )
        if spec.num_speculative_blocks:
            raise ConfigError(
                f"speculative decoding with an SSM hybrid (KV cache group {g}: {layers} keeps "
                f"num_speculative_blocks={spec.num_speculative_blocks} scratch blocks) is not "
                "served by KVBridgeConnector; run the SSM hybrid without a speculative config"
            )
    return frozenset(found)


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """kvbridge's connector for vLLM: any prefill/decode TP pair and block sizes the
    planner can map, hybrid models' KV cache groups, pulled with NIXL, capabilities and
    leases (docs/vllm.md)."""

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
        #: the SSM layers' KV cache groups (refused settings at start-up, in every process)
        self.state_groups = state_groups(kv_cache_config)
        settings = from_extra_config(dict(kv.kv_connector_extra_config))
        instance_id = settings.bound_instance_id(str(kv.engine_id))
        self.configs = settings.configs(instance_id, ROLES[str(kv.kv_role)])  # one per role
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.pp_size = int(vllm_config.parallel_config.pipeline_parallel_size)
        self.scheduler: SchedulerSide | None = None
        self.worker: RoleWorkers | None = None
        self._report = KVBridgeWorkerMeta()  # this step's, until vLLM takes it
        self._exposures = ExposureTally()  # scheduler side: what vLLM's stats have seen
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else [None]
        #: vLLM maps failed blocks back to requests for one KV cache group only
        self.reports_failed_requests = len(groups) > 1
        self._failed_recving: set[str] = set()
        self._in_step: set[str] = set()  # worker: in-step pulls whose end vLLM is not told
        # an in-step pull (its producer met: no handshake) ends, done or failed, within
        # its transfer timeout; the wait for it outlasts that by the liveness bound
        t = settings.transfer
        self._in_step_wait_s = t.transfer_timeout_s + t.liveness_timeout_s
        if role == KVConnectorRole.SCHEDULER:
            world_size = self.tp_size * self.pp_size  # every worker reports
            # a failed request is taken from asynchronous loads only
            self.scheduler = SchedulerSide(
                self.configs,
                self.block_size,
                world_size,
                log,
                self.state_groups,
                in_step_pulls=not self.reports_failed_requests,
            )

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Under pipeline parallelism vLLM gives each worker its stage's layers only;
        the worker is named by its rank in the instance, pp_rank * tp_size + tp_rank
        (kvbridge's and vLLM's order)."""
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        model = load_model_spec(self._vllm_config.model_config.model)
        made_by = CacheFormat.of(self._vllm_config, kv_caches)
        pp_rank, tp_rank = get_pp_group().rank_in_group, get_tp_group().rank_in_group
        pp_layers = pipeline_layers(model.num_layers, self.pp_size)
        config = self._kv_cache_config
        groups = [list(g.layer_names) for g in config.kv_cache_groups] if config else None
        state_layers = frozenset(name for g in self.state_groups for name in (groups or [])[g])
        cache = describe_kv_caches(
            kv_caches,
            model,
            self.tp_size,
            self.block_size,
            made_by,
            groups,
            pp_layers,
            pp_rank,
            state_layers,
        )
        rank = pp_rank * self.tp_size + tp_rank
        self.worker = RoleWorkers(self.configs, cache.model, cache.layout, rank, log)
        # a prefill cache moves into shared memory where its KV is exported (`adopt`)
        self.worker.register_regions(cache.regions, cache.num_blocks, adopt=True)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self.worker is None:
            return KVBridgeHandshake("")
        return KVBridgeHandshake(*self.worker.get_handshake_metadata())

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Carry out the step's orders now, before vLLM's forward: start the pulls and
        expose the prefills that finished in an earlier step (their KV is complete).
        vLLM would call `start_load_kv` (for asynchronous loads) and `wait_for_save`
        after the forward: a prefill's exposure, and with it the pull waiting for it,
        would wait for the prefill instance's next forward (seconds with other prompts
        in it), a pull would start only once the decode's forward ended. In-step pulls
        end here (vLLM's forward computes over their blocks next)."""
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KVBridgeMetadata) and self.worker is not None
        self.worker.start_load_kv(connector_metadata.orders)
        self.worker.wait_for_save()
        in_step = connector_metadata.in_step
        if not in_step:
            return
        self._in_step.update(in_step)
        late = self.worker.wait_for_pulls(in_step, self._in_step_wait_s)
        if late:
            raise RuntimeError(
                f"KVBridgeConnector: the in-step pulls of {sorted(late)} neither ended nor "
                f"failed within {self._in_step_wait_s} s (transfer_timeout_s + "
                "liveness_timeout_s); the step cannot compute over their blocks"
            )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return  # started when the orders were bound

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and asynchronous

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # a decode worker reads the prefill's blocks in place

    def wait_for_save(self) -> None:
        return  # exposed when the orders were bound

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        res = self.worker.get_finished()
        self._report.reports += encode_reports(res.reports)
        if self.reports_failed_requests:
            self._failed_recving |= {
                ev.request_id
                for out in res.reports.values()
                for ev in out.finished_recving
                if not ev.ok
            }
        # vLLM took an in-step pull's request already: it hears of a failed one as load
        # errors (`get_block_ids_with_load_errors`), of none as finished receiving
        recving = res.finished_recving - self._in_step
        self._in_step -= res.finished_recving
        return res.finished_sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        failed, self._failed_recving = self._failed_recving, set()
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), failed)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        out, self._report = self._report, KVBridgeWorkerMeta()
        return out if out.reports else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        blocks = self.worker.get_block_ids_with_load_errors() if self.worker is not None else set()
        return set() if self.reports_failed_requests else blocks  # (then: failed requests)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """A worker's pulls, or (scheduler side, a prefill) its exposures (`ExposureTally`)."""
        if self.worker is not None:
            data = self.worker.take_pulls()
        elif self.scheduler is not None and (producer := self.scheduler.producer) is not None:
            data = self._exposures.take(producer.pinned_blocks, producer.releases)
        else:
            data = None
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
            self.worker.shutdown()
            self.worker = None

    # -- scheduler side ------------------------------------------------------------------
    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """Every worker's entry, keyed (pp_rank, tp_rank) by vLLM: in rank order."""
        assert self.scheduler is not None
        ranks = sorted(metadata)
        self.scheduler.set_worker_endpoints(
            [getattr(metadata[r], "endpoint", "") for r in ranks],
            [getattr(metadata[r], "sibling", "") for r in ranks],
        )

    def on_new_request(self, request: Request) -> None:
        assert self.scheduler is not None
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # a pull fills every group's blocks (vLLM need not zero them)
        config = self._kv_cache_config
        return tuple(range(len(config.kv_cache_groups))) if config is not None else (0,)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        self.scheduler.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        orders, in_step = self.scheduler.build_orders(scheduler_output.total_num_scheduled_tokens)
        return KVBridgeMetadata(orders, in_step)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KVBridgeWorkerMeta):
            return
        self.scheduler.update_connector_output(decode_reports(meta.reports))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        assert self.scheduler is not None
        ok = request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )
        return self.scheduler.request_finished(request, block_ids, ok)
