"""The connector's figures in vLLM's own metrics, as vLLM's connectors report theirs.

Each decode worker records its pulls as figures (`kvbridge.connector.stats`, through
`RoleWorkers.take_pulls`), and a prefill's scheduler side its exposures (the blocks
pinned for readers, the releases by cause: `ExposureTally`); vLLM collects both after
every step (`get_kv_connector_stats`, worker and scheduler side), sums them over the TP
workers (`aggregate`), logs a summary with its throughput line ("KV Transfer metrics:
...", `reduce`) and feeds its Prometheus registry (`KVBridgePromMetrics.observe`): a vLLM
deployment's /metrics carries `SERIES` (one observation per decode worker and pull),
`PINNED_BLOCKS` and `RELEASES` next to vLLM's own.
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

from kvbridge.connector.stats import (
    RELEASE_KEYS,
    has_figures,
    merge_figures,
    no_pulls,
    summarize_figures,
)


@dataclass
class KVBridgeConnectorStats(KVConnectorStats):
    """The figures of one interval, summed over the TP workers (`data` holds the
    contract's `Figures`, serializable as vLLM requires)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, list[float]] = no_pulls()

    def is_empty(self) -> bool:
        return not has_figures(self.data)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merge_figures(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return summarize_figures(self.data)


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


#: a prefill's pinned blocks (the latest count of each observation) as a gauge
PINNED_BLOCKS = (
    "vllm:kvbridge_kv_pinned_blocks",
    "Blocks this prefill instance's workers hold for decode readers with "
    "KVBridgeConnector (exposed, not yet released), summed over its TP workers.",
)
#: a prefill's exposed requests released, by cause (`RELEASE_KEYS`), as a counter
RELEASES = (
    "vllm:kvbridge_kv_releases",
    "Prefilled requests whose exposed KV blocks this prefill instance freed with "
    "KVBridgeConnector, by cause: completed (every decode worker pulled), aborted (the "
    "decode workers gave up or declined), lease_expired (nobody said within the lease), "
    "closed (shut down).",
)


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """`SERIES`, `PINNED_BLOCKS` and `RELEASES`, one child per vLLM engine (vLLM's
    `engine` label; `RELEASES` also per cause)."""

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
        pinned = self._gauge_cls(
            name=PINNED_BLOCKS[0], documentation=PINNED_BLOCKS[1], labelnames=labelnames
        )
        self.pinned_blocks = create_metric_per_engine(pinned, self.per_engine_labelvalues)
        releases = self._counter_cls(
            name=RELEASES[0], documentation=RELEASES[1], labelnames=[*labelnames, "cause"]
        )
        self.releases = {
            key: {
                engine: releases.labels(*values, cause)
                for engine, values in self.per_engine_labelvalues.items()
            }
            for cause, key in RELEASE_KEYS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, (_, _, buckets) in SERIES.items():
            child = self.series[key][engine_idx]
            record = child.observe if buckets else child.inc  # a failed pull's figure: 1
            for value in transfer_stats_data.get(key, []):
                record(value)
        if pinned := transfer_stats_data.get("pinned_blocks"):
            self.pinned_blocks[engine_idx].set(pinned[-1])
        for key, children in self.releases.items():
            if released := transfer_stats_data.get(key):
                children[engine_idx].inc(len(released))
