"""The Prometheus metrics of the proxy and of an instance (prometheus_client).

Each app owns one `CollectorRegistry` of its own (never the library's global one), so
several apps in one process (tests, the demo) keep separate figures. The proxy's
`/metrics` serves its own registry followed by every instance's exposition, merged so
each metric family appears once (`merge_expositions`).

Names and labels (dashboards depend on them):

    proxy     kvbridge_requests_total{endpoint,status}  kvbridge_requests_running
              kvbridge_ttft_ms  kvbridge_tpot_ms  kvbridge_kv_transfer_ms  (histograms, ms)
              kvbridge_kv_bytes_total  kvbridge_kv_local_bytes_total
              kvbridge_failures_total{reason}
              kvbridge_kv_load_failures_total  kvbridge_instance_up{url}
              kvbridge_requests_rejected_total{reason}  (refused for lack of room: 503)
    instance  kvbridge_blocks_in_use{instance,role}  kvbridge_blocks_total{instance,role}
              kvbridge_kv_pinned_blocks{instance,role}
              kvbridge_kv_releases_total{instance,role,cause}  (prefill: exposed KV freed)
              kvbridge_kv_instance_load_failures_total{instance,role}
              kvbridge_kv_stale_pulls_total{instance,role}  (decode: read but not held)
              kvbridge_kv_integrity_failures_total{instance,role}  (decode: digest mismatch)
              kvbridge_kv_instance_bytes_total{instance,role}
              kvbridge_kv_instance_local_bytes_total{instance,role}  (decode: fan-out copies)
              kvbridge_prefix_cache_queries_total{instance,role}
              kvbridge_prefix_cache_hits_total{instance,role}
              kvbridge_prefix_cache_hit_tokens_total{instance,role}
              kvbridge_kv_bytes_saved_total{instance,role}
              kvbridge_blocks_cached_free{instance,role}
              kvbridge_instance_rejected_total{instance,role}  (503: full)
              kvbridge_requests_queued{instance,role}  kvbridge_max_queued_requests{instance,role}
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "CONTENT_TYPE_LATEST",
    "InstanceMetrics",
    "ProxyMetrics",
    "merge_expositions",
    "metric_value",
]

#: Histogram buckets of the millisecond figures (TTFT, TPOT, transfer time).
MS_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)


class ProxyMetrics:
    """The proxy's figures. Owned by one proxy app; updated from its event loop."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvbridge_requests_total",
            "Requests by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.running = Gauge(
            "kvbridge_requests_running", "Requests being generated now.", registry=r
        )
        self.ttft_ms = Histogram(
            "kvbridge_ttft_ms", "Time to first token, milliseconds.", buckets=MS_BUCKETS, registry=r
        )
        self.tpot_ms = Histogram(
            "kvbridge_tpot_ms",
            "Time per output token after the first, milliseconds.",
            buckets=MS_BUCKETS,
            registry=r,
        )
        self.kv_bytes = Counter(
            "kvbridge_kv_bytes_total", "KV-cache bytes moved from prefill to decode.", registry=r
        )
        self.kv_local_bytes = Counter(
            "kvbridge_kv_local_bytes_total",
            "KV-cache bytes decode workers copied from each other on their host (a fan-out: "
            "read from the prefill once per host).",
            registry=r,
        )
        self.kv_transfer_ms = Histogram(
            "kvbridge_kv_transfer_ms",
            "KV transfer time per request, milliseconds.",
            buckets=MS_BUCKETS,
            registry=r,
        )
        self.failures = Counter(
            "kvbridge_failures_total", "Requests that failed, by reason.", ["reason"], registry=r
        )
        self.kv_load_failures = Counter(
            "kvbridge_kv_load_failures_total",
            "KV pulls that failed (then recomputed or refused).",
            registry=r,
        )
        self.rejected = Counter(
            "kvbridge_requests_rejected",
            "Requests refused at once with 503 and Retry-After because the instances "
            "were full (reason overloaded).",
            ["reason"],
            registry=r,
        )
        self.instance_up = Gauge(
            "kvbridge_instance_up",
            "Whether an instance answered its last /metrics scrape (1) or not (0).",
            ["url"],
            registry=r,
        )

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class InstanceMetrics:
    """One prefill or decode instance's figures, every series labelled with the
    instance id and role (several instances' expositions are merged by the proxy)."""

    def __init__(self, instance_id: str, role: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        names = ["instance", "role"]
        labels = {"instance": instance_id, "role": role}
        self.blocks_in_use = Gauge(
            "kvbridge_blocks_in_use", "KV blocks allocated on this instance.", names, registry=r
        ).labels(**labels)
        self.blocks_total = Gauge(
            "kvbridge_blocks_total", "KV blocks of this instance.", names, registry=r
        ).labels(**labels)
        self.pinned_blocks = Gauge(
            "kvbridge_kv_pinned_blocks",
            "Blocks held by the transfer runtime (exposed or being pulled).",
            names,
            registry=r,
        ).labels(**labels)
        self.load_failures = Counter(
            "kvbridge_kv_instance_load_failures_total",
            "KV pulls that failed here.",
            names,
            registry=r,
        ).labels(**labels)
        self.kv_bytes = Counter(
            "kvbridge_kv_instance_bytes_total", "KV bytes pulled here.", names, registry=r
        ).labels(**labels)
        self.kv_local_bytes = Counter(
            "kvbridge_kv_instance_local_bytes_total",
            "KV bytes this instance's workers copied from each other (a fan-out).",
            names,
            registry=r,
        ).labels(**labels)
        self.prefix_queries = Counter(
            "kvbridge_prefix_cache_queries",
            "Requests whose prompt was looked up in the prefix cache.",
            names,
            registry=r,
        ).labels(**labels)
        self.prefix_hits = Counter(
            "kvbridge_prefix_cache_hits",
            "Requests that found part of their prompt in the prefix cache.",
            names,
            registry=r,
        ).labels(**labels)
        self.prefix_hit_tokens = Counter(
            "kvbridge_prefix_cache_hit_tokens",
            "Prompt tokens taken from the prefix cache (neither computed nor pulled).",
            names,
            registry=r,
        ).labels(**labels)
        self.kv_bytes_saved = Counter(
            "kvbridge_kv_bytes_saved",
            "KV bytes this decode instance did not pull because its prefix cache held them.",
            names,
            registry=r,
        ).labels(**labels)
        self.blocks_cached_free = Gauge(
            "kvbridge_blocks_cached_free",
            "Blocks nobody uses that keep their KV for later prompts (evicted on demand).",
            names,
            registry=r,
        ).labels(**labels)
        self.rejected = Counter(
            "kvbridge_instance_rejected",
            "Requests and reservations this instance refused because it was full (503).",
            names,
            registry=r,
        ).labels(**labels)
        self.queued = Gauge(
            "kvbridge_requests_queued",
            "Requests this instance holds now (queued, running, streaming) plus "
            "reservations waiting for theirs.",
            names,
            registry=r,
        ).labels(**labels)
        self.max_queued = Gauge(
            "kvbridge_max_queued_requests",
            "The most requests this instance holds at once (--max-queued-requests).",
            names,
            registry=r,
        ).labels(**labels)
        self.kv_releases = Counter(
            "kvbridge_kv_releases_total",
            "Prefilled requests whose exposed KV blocks this prefill instance freed, by "
            "cause: completed (every decode worker pulled), aborted (the decode workers "
            "gave up or declined, or the proxy cancelled), lease_expired (nobody said "
            "within the lease), closed (shut down).",
            [*names, "cause"],
            registry=r,
        )
        self.stale_pulls = Counter(
            "kvbridge_kv_stale_pulls_total",
            "KV pulls this decode instance read but did not use because the prefill "
            "instance no longer held what was read when the read ended (lease expired, "
            "released, another exposure); each was then recomputed or failed by the "
            "failure policy.",
            names,
            registry=r,
        ).labels(**labels)
        self.integrity_failures = Counter(
            "kvbridge_kv_integrity_failures_total",
            "KV pulls this decode instance did not use because the bytes read differed "
            "from the prefill instance's digest of what it exposed (--kv-integrity); each "
            "was then recomputed or failed by the failure policy.",
            names,
            registry=r,
        ).labels(**labels)
        self._labels = labels
        self._releases_seen: dict[str, int] = {}
        self._pull_failures_seen: dict[str, int] = {}
        self.replays_refused = Gauge(
            "kvbridge_kv_replays_refused",
            "KV-plane messages this prefill instance refused as forged, replayed or "
            "misdirected (handshakes and completion notifications), since start.",
            names,
            registry=r,
        ).labels(**labels)

    def count_releases(self, totals: Mapping[str, int]) -> None:
        """Bring `kvbridge_kv_releases_total` up to the connector's running totals by
        cause (`KVConnectorScheduler.releases`)."""
        for cause, total in totals.items():
            seen = self._releases_seen.get(cause, 0)
            if total > seen:
                self.kv_releases.labels(**self._labels, cause=cause).inc(total - seen)
                self._releases_seen[cause] = total

    def count_pull_failures(self, totals: Mapping[str, int]) -> None:
        """Bring the pull-failure counters (`kvbridge_kv_stale_pulls_total`,
        `kvbridge_kv_integrity_failures_total`) up to the connector's running totals by
        cause (`KVConnectorScheduler.pull_failures`)."""
        counters = {"stale": self.stale_pulls, "integrity": self.integrity_failures}
        for cause, total in totals.items():
            seen = self._pull_failures_seen.get(cause, 0)
            if cause in counters and total > seen:
                counters[cause].inc(total - seen)
                self._pull_failures_seen[cause] = total

    def render(self) -> str:
        return generate_latest(self.registry).decode()


def with_label(text: str, name: str, value: str) -> str:
    """`text` (a Prometheus text exposition) with label `name`=`value` added to every
    sample that lacks it, so the same series from two servers (two vLLM instances of
    one model) stay apart once merged."""
    quoted = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    label = f'{name}="{quoted}"'
    out = []
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            out.append(line)
            continue
        brace, space = line.find("{"), line.find(" ")
        if 0 <= brace < space or (brace >= 0 and space < 0):
            end = line.index("}", brace)
            labels = line[brace + 1 : end]
            if f"{name}=" not in labels:
                sep = "," if labels.strip() else ""
                line = f"{line[: brace + 1]}{label}{sep}{labels}{line[end:]}"
        elif space > 0:
            line = f"{line[:space]}{{{label}}}{line[space:]}"
        out.append(line)
    return "\n".join(out) + "\n"


def merge_expositions(texts: list[str]) -> str:
    """Join several Prometheus text expositions so each metric family appears once
    (one HELP/TYPE, then all its samples), as the format requires."""
    order: list[str] = []
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = defaultdict(list)
    for text in texts:
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("# "):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    if family not in headers:
                        headers[family] = []
                        order.append(family)
                    if len(headers[family]) < 2 and line not in headers[family]:
                        headers[family].append(line)
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            key = family if family and name.startswith(family) else name
            if key not in headers:
                headers[key] = []
                order.append(key)
            samples[key].append(line)
    out = []
    for family in order:
        out.extend(headers[family])
        out.extend(samples[family])
    return "\n".join(out) + "\n"


def metric_value(text: str, name: str, *, prefix: str = "kvbridge_", **labels: str) -> float:
    """The sum of the `<prefix><name>` samples of a Prometheus text exposition whose
    labels include `labels` (0.0 if none): the one reader of `/metrics` (benchmarks,
    tests), parsed by prometheus_client. `name` is a sample's full name after the
    prefix: "requests_total", "ttft_ms_count", "blocks_in_use"; vLLM's series take
    `prefix="vllm:"`."""
    full = f"{prefix}{name}"
    return float(
        sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == full and all(sample.labels.get(k) == v for k, v in labels.items())
        )
    )
