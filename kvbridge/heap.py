"""A long-running process's start-up objects, kept out of its garbage collections.

Python's full (generation 2) collection walks every container object the process
holds, with the GIL held: an instance with its engine loaded holds about 210,000, and
one full collection took 98 ms (docs/benchmarks.md), during which its serving thread,
engine loop and KV connector's progress thread (a pull in flight) all stop. What a
process makes at start-up (modules, the model's objects, the app's) lives as long as it
does: `freeze_start_up` moves it to the permanent generation once the process is ready
(`gc.freeze`), so a later full collection walks only what came after (under 0.1 ms
right after it). The instance's and the proxy's apps call it at the end of their
start-up, a tp worker before it reports ready.
"""

from __future__ import annotations

import gc


def freeze_start_up() -> int:
    """Collect once, then freeze every object left; how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
