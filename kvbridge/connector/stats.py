"""The connector's figures, for a host's metrics (vLLM's `KVConnectorStats`).

`Figures` maps each of `FIGURE_KEYS` to a list of values. A decode worker's pulls
(`PULL_KEYS`): the seconds and bytes of each pull that completed, a 1 per pull that
failed. A prefill's exposures (`EXPOSURE_KEYS`, from its scheduler side, `ExposureTally`):
the blocks its workers hold for decode readers (a value per step while any are held or
when the count changed, the latest last: a host whose gauges expire unless set again, as
Ray's do, keeps showing them) and a 1 per exposed request released, by cause (`RELEASE_KEYS`). Plain lists
of floats, so a host can carry them between processes as they are; figures of several
workers or steps are summed by concatenating (`merge_figures`), and `summarize_figures`
gives the line a log shows.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from kvbridge.connector.scheduler import RELEASE_CAUSES
from kvbridge.transfer.connector import ConnectorEvent

PULL_KEYS = ("pull_seconds", "pull_bytes", "failed_pulls")
#: each release cause (`RELEASE_CAUSES`) -> its figure
RELEASE_KEYS = {cause: f"released_{cause}" for cause in RELEASE_CAUSES}
EXPOSURE_KEYS = ("pinned_blocks", *RELEASE_KEYS.values())
FIGURE_KEYS = PULL_KEYS + EXPOSURE_KEYS
Figures = dict[str, list[float]]


def no_pulls() -> Figures:
    return {key: [] for key in PULL_KEYS}


def record_pull(figures: Figures, ev: ConnectorEvent) -> None:
    """One decode worker's pull ended (`ev`, as its worker reports it)."""
    if not ev.ok:
        figures["failed_pulls"].append(1.0)
        return
    figures["pull_seconds"].append(ev.elapsed_ms / 1e3)
    figures["pull_bytes"].append(float(ev.nbytes))


def has_figures(figures: Mapping[str, list[float]]) -> bool:
    return any(figures.get(key) for key in FIGURE_KEYS)


def merge_figures(figures: Figures, other: Mapping[str, list[float]]) -> Figures:
    """`other`'s figures added to `figures` (another worker's, another interval's)."""
    for key in FIGURE_KEYS:
        if key in other or key in PULL_KEYS:
            figures.setdefault(key, []).extend(other.get(key, []))
    return figures


def summarize_figures(figures: Mapping[str, list[float]]) -> dict[str, int | float]:
    """The figures in a few numbers: pull counts, then (with a pull that completed) the
    mean and 90th percentile time, the mean size and the throughput over the time spent;
    a prefill's pinned blocks (the latest count) and its releases by cause, where it
    reported them."""
    seconds = np.asarray(figures.get("pull_seconds", []), dtype=np.float64)
    mib = np.asarray(figures.get("pull_bytes", []), dtype=np.float64) / 2**20
    out: dict[str, int | float] = {
        "Num pulls": int(seconds.size),
        "Num failed pulls": len(figures.get("failed_pulls", [])),
    }
    if seconds.size:
        out |= {
            "Avg pull time (ms)": round(float(seconds.mean()) * 1e3, 3),
            "P90 pull time (ms)": round(float(np.percentile(seconds, 90)) * 1e3, 3),
            "Avg MB per pull": round(float(mib.mean()), 3),
            "Throughput (MB/s)": round(float(mib.sum() / max(seconds.sum(), 1e-9)), 3),
        }
    if pinned := figures.get("pinned_blocks"):
        out["Pinned blocks"] = int(pinned[-1])
    for cause, key in RELEASE_KEYS.items():
        if released := figures.get(key):
            out[f"Num released ({cause})"] = len(released)
    return out


@dataclass
class ExposureTally:
    """A prefill scheduler side's exposures as figures: its workers' pinned blocks
    while any are held or when the count changed, its releases by cause since the last
    `take`. Owned by the host's scheduler thread."""

    pinned_blocks: int = 0
    releases: collections.Counter[str] = field(default_factory=collections.Counter)

    def take(self, pinned_blocks: int, releases: Mapping[str, int]) -> Figures | None:
        """The figures of this step from the scheduler side's running totals
        (`KVConnectorScheduler.pinned_blocks`, `.releases`); None if nothing is pinned
        and nothing changed."""
        out: Figures = {}
        if pinned_blocks or pinned_blocks != self.pinned_blocks:
            out["pinned_blocks"] = [float(pinned_blocks)]
            self.pinned_blocks = pinned_blocks
        for cause, total in releases.items():
            if total > self.releases[cause]:
                out[RELEASE_KEYS[cause]] = [1.0] * (total - self.releases[cause])
                self.releases[cause] = total
        return out or None
