"""KVBridgeConnector's figures in vLLM's metrics: the workers' pulls summed as vLLM sums
them, its log summary, and the Prometheus series a deployment's /metrics shows (the
end-to-end cases in test_pd.py read them from a real decode instance)."""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvbridge.serve.metrics import metric_value
from kvbridge.vllm.connector import KVBridgeConnector
from kvbridge.vllm.stats import KVBridgeConnectorStats, KVBridgePromMetrics


def test_workers_pulls_are_summed_and_reduced_as_vllm_logs_them() -> None:
    rank0 = {"pull_seconds": [0.010, 0.030], "pull_bytes": [1 << 20, 3 << 20], "failed_pulls": []}
    rank1 = {"pull_seconds": [0.020], "pull_bytes": [2 << 20], "failed_pulls": [1.0]}
    stats = KVBridgeConnector.build_kv_connector_stats(rank0)
    assert isinstance(stats, KVBridgeConnectorStats)
    stats = stats.aggregate(KVBridgeConnectorStats(data=rank1))
    summary = stats.reduce()
    assert summary["Num pulls"] == 3 and summary["Num failed pulls"] == 1
    assert summary["Avg pull time (ms)"] == 20.0
    assert summary["Avg MB per pull"] == 2.0
    assert summary["Throughput (MB/s)"] == 100.0  # 6 MiB in 60 ms
    assert not stats.is_empty()
    stats.reset()
    assert stats.is_empty()
    assert KVBridgeConnector.build_kv_connector_stats(None).is_empty()  # type: ignore[union-attr]


def test_prometheus_series_count_every_pull_and_failure() -> None:
    class Config:
        kv_transfer_config = None

    registry = CollectorRegistry()  # vLLM passes its metric classes; ours register here
    types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    prom = KVBridgePromMetrics(
        Config(),  # type: ignore[arg-type]
        types,  # type: ignore[arg-type]
        ["model_name", "engine"],
        {0: ["m", "0"]},
    )
    prom.observe({"pull_seconds": [0.5, 0.25], "pull_bytes": [4096, 8192], "failed_pulls": [1.0]})
    text = generate_latest(registry).decode()
    assert metric_value(text, "kvbridge_pull_time_seconds_count", prefix="vllm:") == 2
    assert metric_value(text, "kvbridge_pull_time_seconds_sum", prefix="vllm:") == 0.75
    assert metric_value(text, "kvbridge_pull_bytes_sum", prefix="vllm:", engine="0") == 12288
    assert metric_value(text, "kvbridge_failed_pulls_total", prefix="vllm:") == 1
