"""A decode instance's hand-over, step by step, from the trace lines the bench's hooks
write in vLLM's processes (`kvbridge/bench/vllm_hooks/sitecustomize.py`). The hooks sit
on vLLM's own connector API and scheduler, so every connector is timed by the same code
over the same span.

One pulled request, in the decode instance (times from `time.time()`, one host):

    arrive --order--> alloc --pull--> done (last worker) --report--> known --take--> taken
    |<------------------ transfer ------------------>|

- transfer: from the request reaching the decode's scheduler to its last KV byte in
  place (the last TP worker's report of it);
- order: the scheduler's first step over it (the connector's orders go out with it);
- pull: from the allocation to the last worker's report (the READs, their
  notifications, and the wait for the worker step that reports them);
- report: until the scheduler learns it (the end of the step that reported it);
- take: until the step that takes the request runs (vLLM's next `schedule()`).

A synchronous load (KVBridgeConnector's in-step pull) is taken by the step that
allocated it: its KV is in place when the workers' `start_load_kv` of that step
returned, before its forward; report and take are 0 (`pull_timelines`).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

#: the per-call events: (event, the call it times)
STEP_CALLS = {
    "meta": "build_connector_meta",
    "bind": "bind_connector_metadata",
    "start": "start_load_kv",
    "save": "wait_for_save",
    "fin": "get_transfer_results",
}


@dataclass(frozen=True)
class TraceEvent:
    t: float
    pid: int
    event: str
    request_id: str
    value: float


def parse_line(line: str) -> TraceEvent | None:
    """One trace line ("<time> <pid> <event> <request id or -> <value>"); None for a
    line cut short (a process ended while writing it)."""
    parts = line.split()
    if len(parts) != 5:
        return None
    try:
        return TraceEvent(float(parts[0]), int(parts[1]), parts[2], parts[3], float(parts[4]))
    except ValueError:
        return None


def read_traces(folder: Path) -> list[TraceEvent]:
    """Every event of every process that wrote to `folder`, in time order."""
    events = []
    for path in sorted(folder.glob("*.trace")):
        for line in path.read_text(errors="replace").splitlines():
            if (ev := parse_line(line)) is not None:
                events.append(ev)
    return sorted(events, key=lambda ev: ev.t)


@dataclass(frozen=True)
class PullTimeline:
    """One pulled request's moments (see the module docstring)."""

    request_id: str
    arrive: float
    alloc: float
    done: float
    known: float
    taken: float
    num_done: int  # worker reports: one per decode TP worker
    in_step: bool = False  # a synchronous load: taken by the step that allocated it

    @property
    def transfer_s(self) -> float:
        return self.done - self.arrive

    @property
    def order_s(self) -> float:
        return self.alloc - self.arrive

    @property
    def pull_s(self) -> float:
        return self.done - self.alloc

    @property
    def report_s(self) -> float:
        return self.known - self.done

    @property
    def take_s(self) -> float:
        return self.taken - self.known


def pull_timelines(events: Iterable[TraceEvent], since: float, until: float) -> list[PullTimeline]:
    """The requests that arrived in [since, until) and were pulled and taken.

    An asynchronous load ends where its last worker reports it (`done`), and is taken
    by a later step (`known`, `taken`). A synchronous one (in step: allocated, never
    reported) is in place when every worker's `start_load_kv` of the step that
    allocated it returned (vLLM calls it before that step's forward): there it is
    known and taken."""
    events = list(events)
    first: dict[str, dict[str, float]] = defaultdict(dict)
    last_done: dict[str, float] = {}
    num_done: dict[str, int] = defaultdict(int)
    starts: dict[int, list[float]] = defaultdict(list)  # worker pid -> its calls' ends
    for ev in events:
        if ev.event == "done":
            last_done[ev.request_id] = ev.t
            num_done[ev.request_id] += 1
        elif ev.event == "start":
            starts[ev.pid].append(ev.t)
        elif ev.event in ("arrive", "alloc", "known", "taken"):
            first[ev.request_id].setdefault(ev.event, ev.t)
    out = []
    for rid, at in first.items():
        if not (since <= at.get("arrive", -1.0) < until) or "alloc" not in at:
            continue
        if rid in last_done and {"known", "taken"} <= at.keys():
            done, known, taken = last_done[rid], at["known"], at["taken"]
            out.append(
                PullTimeline(rid, at["arrive"], at["alloc"], done, known, taken, num_done[rid])
            )
            continue
        if rid in last_done or "known" in at or "taken" in at:
            continue  # still in flight when the trace ended
        ends = [next((t for t in ts if t >= at["alloc"]), None) for ts in starts.values()]
        if not ends or None in ends:
            continue
        done = max(t for t in ends if t is not None)
        out.append(PullTimeline(rid, at["arrive"], at["alloc"], done, done, done, len(ends), True))
    return sorted(out, key=lambda p: p.arrive)


def step_costs(events: Iterable[TraceEvent], since: float, until: float) -> dict[str, float]:
    """The median seconds of each connector call of `STEP_CALLS` in [since, until)
    (one process's call per step: the scheduler's, or a worker's)."""
    took: dict[str, list[float]] = defaultdict(list)
    for ev in events:
        if ev.event in STEP_CALLS and since <= ev.t < until:
            took[ev.event].append(ev.value)
    return {name: statistics.median(took[name]) if took[name] else 0.0 for name in STEP_CALLS}


def median_of(values: Iterable[float]) -> float:
    data = list(values)
    return statistics.median(data) if data else float("nan")
