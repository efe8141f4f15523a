"""KVBridgeConnector's figures in vLLM's metrics: the workers' pulls summed as vLLM sums
them, a prefill's pinned blocks and releases by cause, its log summary, and the
Prometheus series a deployment's /metrics shows (the end-to-end cases in test_pd.py read
them from a real decode instance, tests/ray/test_cluster.py a prefill's under Ray)."""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvbridge.connector.stats import ExposureTally
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


def test_a_prefills_exposures_are_reported_while_held_or_changed() -> None:
    tally = ExposureTally()
    assert tally.take(0, {}) is None  # nothing pinned, nothing released: no figures
    assert tally.take(8, {}) == {"pinned_blocks": [8.0]}
    assert tally.take(8, {}) == {"pinned_blocks": [8.0]}  # every step while held
    releases = {"completed": 2, "lease_expired": 1}
    assert tally.take(0, releases) == {
        "pinned_blocks": [0.0],
        "released_completed": [1.0, 1.0],
        "released_lease_expired": [1.0],
    }
    assert tally.take(0, releases) is None  # running totals: each release counted once
    assert tally.take(0, {**releases, "lease_expired": 2}) == {"released_lease_expired": [1.0]}


def test_a_prefills_figures_merge_with_the_workers_pulls_and_reduce() -> None:
    pulls = {"pull_seconds": [0.5], "pull_bytes": [1 << 20], "failed_pulls": []}
    stats = KVBridgeConnector.build_kv_connector_stats(pulls)
    exposures = {"pinned_blocks": [4.0], "released_lease_expired": [1.0]}
    stats = stats.aggregate(KVBridgeConnectorStats(data=exposures))
    stats = stats.aggregate(KVBridgeConnectorStats(data={"pinned_blocks": [0.0]}))
    summary = stats.reduce()
    assert summary["Num pulls"] == 1 and summary["Pinned blocks"] == 0  # the latest count
    assert summary["Num released (lease_expired)"] == 1
    assert not KVBridgeConnectorStats(data={"pinned_blocks": [0.0]}).is_empty()


def prom_metrics() -> tuple[KVBridgePromMetrics, CollectorRegistry]:
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
    return prom, registry


def test_prometheus_series_show_a_prefills_pinned_blocks_and_releases_by_cause() -> None:
    prom, registry = prom_metrics()
    prom.observe({"pinned_blocks": [3.0, 7.0], "released_completed": [1.0]})
    text = generate_latest(registry).decode()
    assert metric_value(text, "kvbridge_kv_pinned_blocks", prefix="vllm:", engine="0") == 7
    assert metric_value(text, "kvbridge_kv_releases_total", prefix="vllm:", cause="completed") == 1
    prom.observe({"pinned_blocks": [0.0], "released_lease_expired": [1.0, 1.0]})
    text = generate_latest(registry).decode()
    assert metric_value(text, "kvbridge_kv_pinned_blocks", prefix="vllm:") == 0
    assert metric_value(text, "kvbridge_kv_releases_total", prefix="vllm:", cause="completed") == 1
    lease = metric_value(text, "kvbridge_kv_releases_total", prefix="vllm:", cause="lease_expired")
    assert lease == 2
    prom.observe({"pull_seconds": [0.5]})  # a decode's figures leave the gauge as it was
    text = generate_latest(registry).decode()
    assert metric_value(text, "kvbridge_kv_pinned_blocks", prefix="vllm:") == 0


def test_prometheus_series_count_every_pull_and_failure() -> None:
    prom, registry = prom_metrics()
    prom.observe({"pull_seconds": [0.5, 0.25], "pull_bytes": [4096, 8192], "failed_pulls": [1.0]})
    text = generate_latest(registry).decode()
    assert metric_value(text, "kvbridge_pull_time_seconds_count", prefix="vllm:") == 2
    assert metric_value(text, "kvbridge_pull_time_seconds_sum", prefix="vllm:") == 0.75
    assert metric_value(text, "kvbridge_pull_bytes_sum", prefix="vllm:", engine="0") == 12288
    assert metric_value(text, "kvbridge_failed_pulls_total", prefix="vllm:") == 1
