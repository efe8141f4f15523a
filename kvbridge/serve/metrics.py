"""A small Prometheus text-format registry (counters, gauges, histograms).

Owned by one process (the proxy or an instance) and updated from its event loop;
`render()` produces the text `/metrics` serves.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict

Labels = tuple[tuple[str, str], ...]

_MS_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)


def _fmt_labels(labels: Labels, extra: tuple[tuple[str, str], ...] = ()) -> str:
    items = labels + extra
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in items) + "}"


class Metrics:
    """Thread-safe named metrics with optional labels."""

    def __init__(self, prefix: str = "kvbridge") -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._help: dict[str, tuple[str, str]] = {}
        self._values: dict[str, dict[Labels, float]] = defaultdict(dict)
        self._hist: dict[str, dict[Labels, list[float]]] = defaultdict(dict)
        self._buckets: dict[str, tuple[float, ...]] = {}

    def describe(
        self, name: str, kind: str, help_: str, buckets: tuple[float, ...] = _MS_BUCKETS
    ) -> None:
        self._help[name] = (kind, help_)
        if kind == "histogram":
            self._buckets[name] = buckets

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[name][key] = self._values[name].get(key, 0.0) + value

    def set(self, name: str, value: float, **labels: str) -> None:
        with self._lock:
            self._values[name][tuple(sorted(labels.items()))] = value

    def observe(self, name: str, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        buckets = self._buckets[name]
        with self._lock:
            # [count per bucket..., +Inf count, sum]
            h = self._hist[name].setdefault(key, [0.0] * (len(buckets) + 2))
            h[bisect.bisect_left(buckets, value)] += 1
            h[-1] += value

    def value(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._values[name].get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            for name, (kind, help_) in self._help.items():
                full = f"{self.prefix}_{name}"
                lines.append(f"# HELP {full} {help_}")
                lines.append(f"# TYPE {full} {kind}")
                if kind == "histogram":
                    buckets = self._buckets[name]
                    for labels, h in self._hist[name].items():
                        cum = 0.0
                        for bound, n in zip(buckets, h[: len(buckets)], strict=True):
                            cum += n
                            le = (("le", f"{bound:g}"),)
                            lines.append(f"{full}_bucket{_fmt_labels(labels, le)} {cum:g}")
                        cum += h[len(buckets)]
                        inf = (("le", "+Inf"),)
                        lines.append(f"{full}_bucket{_fmt_labels(labels, inf)} {cum:g}")
                        lines.append(f"{full}_sum{_fmt_labels(labels)} {h[-1]:g}")
                        lines.append(f"{full}_count{_fmt_labels(labels)} {cum:g}")
                else:
                    for labels, v in self._values[name].items():
                        lines.append(f"{full}{_fmt_labels(labels)} {v:g}")
        return "\n".join(lines) + "\n"


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
