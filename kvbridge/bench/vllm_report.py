"""`kvbridge bench vllm`'s results: what each setup measured (`Setup`, `Phase`) and
the rows made of them (`Row`: the table and `--json`), with ratios to colocated vLLM at
the same concurrency and, from the hooks' trace (`vllm_trace.py`), the transfer over the
same span for every connector and where a pull's time goes."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from kvbridge.bench.vllm_trace import (
    STEP_CALLS,
    TraceEvent,
    median_of,
    pull_timelines,
    step_costs,
)

if TYPE_CHECKING:
    from kvbridge.bench.client import Streamed


#: KVBridgeConnector's log line of a decode worker's pull (`RoleWorkers`): the request,
#: the READs' descriptors, the phases of `PULL_PHASES` in ms
PULL_LINE = re.compile(
    r"kvbridge decode worker \d+ pulled (\S+): .* ms, (\d+) descriptors, phases ms ([\d./]+)"
)
#: `kvbridge.transfer.pull.PullPhases`, in its order
PULL_PHASES = ("queued", "post", "read", "digest", "confirm", "cast")


def pull_lines(log_text: str) -> dict[str, list[tuple[int, tuple[float, ...]]]]:
    """Each pulled request's (descriptors, phases in ms) per decode worker, from a
    KVBridgeConnector decode instance's log."""
    out: dict[str, list[tuple[int, tuple[float, ...]]]] = {}
    for rid, ndesc, phases in PULL_LINE.findall(log_text):
        out.setdefault(rid, []).append((int(ndesc), tuple(float(x) for x in phases.split("/"))))
    return out


class Connector(Enum):
    KVBRIDGE = "kvbridge"
    NIXL = "nixl"
    COLOCATED = "colocated"  # the decode instance alone: no connector, no prefill


#: each connector's own figures on vLLM's /metrics (after "vllm:"): its transfer-time
#: histogram, and its descriptors per transfer where it counts them
@dataclass
class Phase:
    """One concurrency's requests on one setup: what the client saw, when, and the
    decode's own transfer figures over it (/metrics deltas)."""

    streams: list[Streamed]
    since: float
    until: float
    own_count: float = 0.0
    own_sum_s: float = 0.0
    descriptors: float = 0.0


@dataclass
class Setup:
    """One setup of a pair (a connector's two instances, or colocated), as measured."""

    connector: Connector
    failure: str = ""
    phases: dict[int, Phase] = field(default_factory=dict)
    idle_cpu: dict[str, float] = field(default_factory=dict)  # side -> % of a core per worker
    trace: list[TraceEvent] = field(default_factory=list)
    pulls: dict[str, list[tuple[int, tuple[float, ...]]]] = field(default_factory=dict)


@dataclass
class Row:
    """One (pair, concurrency, connector) of the table and of `--json`."""

    pair: str
    concurrency: int
    connector: str
    transfer_ms: float = math.nan
    ttft_ms: float = math.nan
    tpot_ms: float = math.nan
    ttft_ratio: float = math.nan
    tpot_ratio: float = math.nan
    own_transfer_ms: float = math.nan
    pulls_per_request: float = math.nan
    descriptors_per_pull: float = math.nan
    idle_cpu_pct: float = math.nan  # per worker, of the busier instance
    idle_cpu: dict[str, float] = field(default_factory=dict)  # per worker, each instance
    steps_ms: dict[str, float] = field(default_factory=dict)
    step_calls_us: dict[str, float] = field(default_factory=dict)
    pull_phases_ms: dict[str, float] = field(default_factory=dict)  # a worker's, KVBridge
    token_exact: bool | None = None
    failure: str = ""
    mismatches: list[str] = field(default_factory=list)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def rows_of(pair: str, coloc: Setup, setups: list[Setup]) -> list[Row]:
    """The table's rows for one pair: colocated first, then each connector, per
    concurrency, with ratios to colocated at the same concurrency."""
    rows = []
    concurrencies = sorted({c for s in (coloc, *setups) for c in s.phases} or {1})
    for c in concurrencies:
        base = coloc.phases.get(c)
        base_ttft = median_of(s.ttft_s for s in base.streams) * 1e3 if base else math.nan
        base_tpot = median_of(s.tpot_s for s in base.streams) * 1e3 if base else math.nan
        for s in (coloc, *setups):
            row = Row(pair, c, s.connector.value, failure=s.failure)
            if s.idle_cpu:
                row.idle_cpu, row.idle_cpu_pct = s.idle_cpu, max(s.idle_cpu.values())
            phase = s.phases.get(c)
            rows.append(row)
            if phase is None:
                continue
            row.ttft_ms = median_of(x.ttft_s for x in phase.streams) * 1e3
            row.tpot_ms = median_of(x.tpot_s for x in phase.streams) * 1e3
            row.ttft_ratio = _ratio(row.ttft_ms, base_ttft)
            row.tpot_ratio = _ratio(row.tpot_ms, base_tpot)
            if base is not None and s is not coloc:
                row.mismatches = [
                    f"{d.text!r} != colocated {b.text!r}"
                    for d, b in zip(phase.streams, base.streams, strict=True)
                    if d.text != b.text
                ]
                row.token_exact = not row.mismatches
            if s is coloc:
                continue
            pulls = pull_timelines(s.trace, phase.since, phase.until)
            if not pulls:
                row.failure = row.failure or "no pull traced: the decode computed the KV"
                continue
            row.transfer_ms = median_of(p.transfer_s for p in pulls) * 1e3
            row.steps_ms = {
                step: round(median_of(getattr(p, f"{step}_s") for p in pulls) * 1e3, 2)
                for step in ("order", "pull", "report", "take")
            }
            logged = [x for p in pulls for x in s.pulls.get(p.request_id, [])]
            if logged:  # KVBridgeConnector's own account of each worker's pull
                row.descriptors_per_pull = median_of(n for n, _ in logged)
                row.pull_phases_ms = {
                    name: round(median_of(ph[i] for _, ph in logged if len(ph) > i), 2)
                    for i, name in enumerate(PULL_PHASES)
                }
            costs = step_costs(s.trace, phase.since, phase.until)
            row.step_calls_us = {k: round(v * 1e6, 1) for k, v in costs.items()}
            if phase.own_count:
                row.own_transfer_ms = phase.own_sum_s / phase.own_count * 1e3
                row.pulls_per_request = phase.own_count / len(phase.streams)
                if phase.descriptors:  # NixlConnector's: per READ
                    row.descriptors_per_pull = phase.descriptors / phase.own_count
    return rows


def _f(x: float, width: int, digits: int = 1) -> str:
    return f"{x:{width}.{digits}f}" if x == x else f"{'-':>{width}}"


def print_rows(rows: list[Row], steps: bool) -> None:
    print(
        f"{'pair':>5} {'conc':>4} {'connector':>9} {'xfer ms':>8} {'own ms':>7} "
        f"{'pulls/req':>9} {'descs':>6} {'TTFT ms':>8} {'/coloc':>6} {'TPOT ms':>8} "
        f"{'/coloc':>6} {'idle CPU%':>9} {'tokens':>7}"
    )
    for r in rows:
        tokens = {None: "", True: "exact", False: "DIFFER"}[r.token_exact]
        print(
            f"{r.pair:>5} {r.concurrency:>4} {r.connector:>9} {_f(r.transfer_ms, 8)} "
            f"{_f(r.own_transfer_ms, 7)} {_f(r.pulls_per_request, 9)} "
            f"{_f(r.descriptors_per_pull, 6, 0)} {_f(r.ttft_ms, 8)} {_f(r.ttft_ratio, 6, 2)} "
            f"{_f(r.tpot_ms, 8)} {_f(r.tpot_ratio, 6, 2)} {_f(r.idle_cpu_pct, 9)} {tokens:>7}"
        )
        if r.failure:
            print(f"{'':>11}note: {r.failure}")
        for m in r.mismatches:
            print(f"{'':>11}tokens differ: {m}")
    if not steps:
        return
    print("\nwhere a pull's time goes (median ms) and the connector's calls per step (median us)")
    print(
        f"{'pair':>5} {'conc':>4} {'connector':>9} {'order':>7} {'pull':>7} {'report':>7} "
        f"{'take':>7} " + " ".join(f"{name:>8}" for name in STEP_CALLS)
    )
    for r in rows:
        if not r.steps_ms:
            continue
        print(
            f"{r.pair:>5} {r.concurrency:>4} {r.connector:>9} "
            + " ".join(_f(r.steps_ms[k], 7, 2) for k in ("order", "pull", "report", "take"))
            + " "
            + " ".join(_f(r.step_calls_us[k], 8) for k in STEP_CALLS)
        )
    print("calls: " + ", ".join(f"{k} = {v}" for k, v in STEP_CALLS.items()))
    phased = [r for r in rows if r.pull_phases_ms]
    if phased:
        print(
            "\ninside a KVBridgeConnector pull (median ms per worker: kvbridge.transfer.PullPhases)"
        )
        print(f"{'pair':>5} {'conc':>4} " + " ".join(f"{n:>8}" for n in PULL_PHASES))
        for r in phased:
            print(
                f"{r.pair:>5} {r.concurrency:>4} "
                + " ".join(_f(r.pull_phases_ms[n], 8, 2) for n in PULL_PHASES)
            )
    print("\nidle CPU, % of a core per worker (each instance's processes, over its TP size)")
    seen = set()
    for r in rows:
        if (r.pair, r.connector) not in seen and r.idle_cpu:
            seen.add((r.pair, r.connector))
            print(
                f"{r.pair:>5} {r.connector:>9}: "
                + ", ".join(f"{k} {v}" for k, v in r.idle_cpu.items())
            )


def rows_json(rows: list[Row]) -> str:
    """The rows as one JSON list (NaN, not measured, as null)."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and x != x:
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    return json.dumps([clean(asdict(r)) for r in rows])
