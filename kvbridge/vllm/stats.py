"""The connector's figures in vLLM's own metrics, as vLLM's connectors report theirs.

Each decode worker records its pulls as figures (`kvbridge.connector.stats`, through
`RoleWorkers.take_pulls`); vLLM collects them after every step
(`get_kv_connector_stats`), sums them over the TP workers (`aggregate`), logs a summary
with its throughput line ("KV Transfer metrics: ...", `reduce`) and feeds its Prometheus
registry (`KVBridgePromMetrics.observe`), so a
vLLM deployment's /metrics carries, next to vLLM's own series:

    vllm:kvbridge_pull_time_seconds   histogram: one decode worker's pull, from the
                                      order to every byte in place (a first pull
                                      includes the handshake with the producer)
    vllm:kvbridge_pull_bytes          histogram: the bytes one decode worker pulled
    vllm:kvbridge_failed_pulls_total  counter: pulls that failed (reported to vLLM as
                                      load errors: recomputed or failed by its policy)

All values in one observation list are per decode worker and pull.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvbridge.connector.stats import has_pulls, merge_pulls, no_pulls, summarize_pulls


@dataclass
class KVBridgeConnectorStats(KVConnectorStats):
    """The pulls of one interval, summed over the TP workers (`data` holds the
    contract's `PullFigures`, serializable as vLLM requires)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, list[float]] = no_pulls()

    def clone_and_reset(self) -> KVBridgeConnectorStats:
        old = copy.copy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        return not has_pulls(self.data)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merge_pulls(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return summarize_pulls(self.data)


#: seconds: a pull on one host takes milliseconds; a first pull on a loaded host, minutes
_TIME_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0]
#: bytes: 2 KiB to 8 GiB in steps of 4
_BYTE_BUCKETS = [float(2 ** (11 + 2 * i)) for i in range(12)]


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """The series above, one child per vLLM engine (vLLM's `engine` label)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def histogram(name: str, doc: str, buckets: list[float]) -> dict[int, Any]:
            metric = self._histogram_cls(
                name=name, documentation=doc, buckets=buckets, labelnames=labelnames
            )
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        self.pull_time = histogram(
            "vllm:kvbridge_pull_time_seconds",
            "One decode worker's KV pull with KVBridgeConnector, from the order to every "
            "byte in place.",
            _TIME_BUCKETS,
        )
        self.pull_bytes = histogram(
            "vllm:kvbridge_pull_bytes",
            "Bytes one decode worker pulled with KVBridgeConnector.",
            _BYTE_BUCKETS,
        )
        failed = self._counter_cls(
            name="vllm:kvbridge_failed_pulls",
            documentation="KV pulls with KVBridgeConnector that failed (reported to vLLM as "
            "load errors).",
            labelnames=labelnames,
        )
        self.failed_pulls = create_metric_per_engine(failed, self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for seconds in transfer_stats_data.get("pull_seconds", []):
            self.pull_time[engine_idx].observe(seconds)
        for nbytes in transfer_stats_data.get("pull_bytes", []):
            self.pull_bytes[engine_idx].observe(nbytes)
        failed = len(transfer_stats_data.get("failed_pulls", []))
        if failed:
            self.failed_pulls[engine_idx].inc(failed)
