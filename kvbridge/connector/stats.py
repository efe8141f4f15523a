"""A decode worker's pulls as figures, for a host's metrics (vLLM's `KVConnectorStats`).

`PullFigures` maps each of `PULL_KEYS` to one value per pull: the seconds and bytes of
each pull that completed, a 1 per pull that failed. Plain lists of floats, so a host can
carry them between processes as they are; figures of several workers are summed by
concatenating (`merge_pulls`), and `summarize_pulls` gives the line a log shows.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kvbridge.transfer.connector import ConnectorEvent

PULL_KEYS = ("pull_seconds", "pull_bytes", "failed_pulls")
PullFigures = dict[str, list[float]]


def no_pulls() -> PullFigures:
    return {key: [] for key in PULL_KEYS}


def record_pull(figures: PullFigures, ev: ConnectorEvent) -> None:
    """One decode worker's pull ended (`ev`, as its worker reports it)."""
    if not ev.ok:
        figures["failed_pulls"].append(1.0)
        return
    figures["pull_seconds"].append(ev.elapsed_ms / 1e3)
    figures["pull_bytes"].append(float(ev.nbytes))


def has_pulls(figures: Mapping[str, list[float]]) -> bool:
    return any(figures.get(key) for key in PULL_KEYS)


def merge_pulls(figures: PullFigures, other: Mapping[str, list[float]]) -> PullFigures:
    """`other`'s pulls added to `figures` (another worker's, another interval's)."""
    for key in PULL_KEYS:
        figures.setdefault(key, []).extend(other.get(key, []))
    return figures


def summarize_pulls(figures: Mapping[str, list[float]]) -> dict[str, int | float]:
    """The pulls in a few figures: counts, then (with a pull that completed) the mean
    and 90th percentile time, the mean size and the throughput over the time spent."""
    seconds = np.asarray(figures["pull_seconds"], dtype=np.float64)
    mib = np.asarray(figures["pull_bytes"], dtype=np.float64) / 2**20
    out: dict[str, int | float] = {
        "Num pulls": int(seconds.size),
        "Num failed pulls": len(figures["failed_pulls"]),
    }
    if seconds.size:
        out |= {
            "Avg pull time (ms)": round(float(seconds.mean()) * 1e3, 3),
            "P90 pull time (ms)": round(float(np.percentile(seconds, 90)) * 1e3, 3),
            "Avg MB per pull": round(float(mib.mean()), 3),
            "Throughput (MB/s)": round(float(mib.sum() / max(seconds.sum(), 1e-9)), 3),
        }
    return out
