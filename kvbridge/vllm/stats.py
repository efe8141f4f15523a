"""The connector's figures in vLLM's own metrics, as vLLM's connectors report theirs.

Each decode worker records its pulls as figures (`kvbridge.connector.stats`, through
`RoleWorkers.take_pulls`); vLLM collects them after every step
(`get_kv_connector_stats`), sums them over the TP workers (`aggregate`), logs a summary
with its throughput line ("KV Transfer metrics: ...", `reduce`) and feeds its Prometheus
registry (`KVBridgePromMetrics.observe`): a vLLM deployment's /metrics carries `SERIES`
next to vLLM's own, one observation per decode worker and pull.
"""

from __future__ import annotations

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


#: each of the contract's pull figures (`PULL_KEYS`) as a series of vLLM's /metrics:
#: (name, help, buckets of a histogram; None: a counter, `_total`, of the pulls)
SERIES: dict[str, tuple[str, str, list[float] | None]] = {
    # a first pull includes the handshake with the producer
    "pull_seconds": (
        "vllm:kvbridge_pull_time_seconds",
        "One decode worker's KV pull with KVBridgeConnector, from the order to every "
        "byte in place.",
        _TIME_BUCKETS,
    ),
    "pull_bytes": (
        "vllm:kvbridge_pull_bytes",
        "Bytes one decode worker pulled with KVBridgeConnector.",
        _BYTE_BUCKETS,
    ),
    # reported to vLLM as load errors too: recomputed or failed by its policy
    "failed_pulls": (
        "vllm:kvbridge_failed_pulls",
        "KV pulls with KVBridgeConnector that failed (reported to vLLM as load errors).",
        None,
    ),
}


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """`SERIES`, one child per vLLM engine (vLLM's `engine` label)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.series: dict[str, dict[int, Any]] = {}
        for key, (name, doc, buckets) in SERIES.items():
            metric = (
                self._histogram_cls(
                    name=name, documentation=doc, buckets=buckets, labelnames=labelnames
                )
                if buckets
                else self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            )
            self.series[key] = create_metric_per_engine(metric, self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, (_, _, buckets) in SERIES.items():
            child = self.series[key][engine_idx]
            record = child.observe if buckets else child.inc  # a failed pull's figure: 1
            for value in transfer_stats_data.get(key, []):
                record(value)
