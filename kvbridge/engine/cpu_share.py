"""How an instance's compute shares a host's cores with another instance's.

The colocated engine runs a new prompt's prefill before its next decode step, so a
prompt never waits for decodes. A disaggregated pair on one host's cores has no such
order: the scheduler shares the CPU between their threads, a decode instance's steps
take cores from the prefills, the first token comes later than colocated, and a pull
waits behind both (`kvbridge bench serve`, docs/benchmarks.md). So an instance runs its
compute at a lower CPU priority than its KV transfers, and a decode instance's lower
than a prefill instance's (`COMPUTE_NICE`, `kvbridge serve --cpu-priority`): on shared
cores the transfers come first, then prefills, then decodes; alone on its cores an
instance runs as fast as before.

Only the compute yields: the threads the KV connector made (its progress thread, NIXL's,
UCX's and the side channel's) keep the priority the process was started with. A thread
cannot raise its priority back without privilege, so `make_worker_connector` notes the
threads that exist before it makes the connector and lowers those, never the
connector's; threads the compute makes later inherit the value. (Linux shares the CPU
evenly between sessions first when autogroups are on, so nice values order threads of
one session only: `kvbridge serve` starts its instances in process groups of its own
session.)
"""

from __future__ import annotations

import os

from kvbridge.errors import ConfigError

#: The largest nice value Linux has.
MAX_NICE = 19
#: How much an instance's compute threads' nice value is raised above the process's (an
#: increment, as `nice -n` gives one), by role, with `--cpu-priority` (the default). From
#: nice 0, Linux's weights: a transfer thread 1024, a prefill compute thread 335, a
#: decode compute thread 36 (so three busy prefill workers get about three quarters of
#: the cores beside nine decode workers). Prefill compute at 0 gave a better TTFT but
#: left the transfers level with it, and pulls under load took 2.3-3.1x their time
#: alone (docs/benchmarks.md). An increment, not a value: an instance started under
#: `nice -n 10` keeps the order (10, 15, 19) instead of flattening it.
COMPUTE_NICE = {"prefill": 5, "decode": 15}


def check_cpu_nice(value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_NICE:
        raise ConfigError(
            f"cpu_nice={value!r} must be a nice increment from 0 (the compute keeps its "
            f"priority) to {MAX_NICE} (it yields the most)"
        )


def compute_nice(increment: int, started: int | None = None) -> int:
    """The nice value compute threads get with `increment` in a process started at nice
    `started` (None: the calling thread's now, which `yield_compute` has not lowered):
    the two summed, at most `MAX_NICE`."""
    if started is None:
        started = os.getpriority(os.PRIO_PROCESS, 0)
    return min(started + increment, MAX_NICE)


def thread_ids() -> set[int]:
    """This process's threads now."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def yield_compute(increment: int, keep: set[int]) -> int:
    """Lower every thread of this process but those in `keep` to `compute_nice(increment)`
    (never raising one already lower); how many threads it lowered. Called once, from
    a thread at the process's starting priority."""
    nice = compute_nice(increment)
    lowered = 0
    for tid in thread_ids() - keep:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                lowered += 1
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            continue
    return lowered
