"""A decode worker's staging buffer: where KV read in the prefill's dtype lands before it
is cast into a cache of another dtype (`kvbridge.plan.cast`).

The staging of a source dtype is the worker's cache again, region for region, block for
block, in that dtype: a region of n cache bytes has n * src itemsize / cache itemsize
staging bytes. The copy lists of a converting plan (`TransferPlan.cast`) address it as
they would the cache, so the cast of a pull reads the runs its READs wrote (the copy
lists' destination runs) and writes the same elements of the cache. Nothing else reads
or writes it: a block of it belongs to the pull that holds the cache block of the same id.

Made the first time a plan converts from its dtype, written through once (every page
touched: a READ into never-touched pages is slower) and registered with the transport
once; one per source dtype (at most two: `cast.CASTABLE`), kept for the consumer's life
and freed with it, as the warm-up scratch buffers are (NIXL keeps a registration until
its agent closes).
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvbridge.plan.cast import Cast, cast_runs
from kvbridge.transfer.errors import TransferError
from kvbridge.transfer.pull import ActivePull, DecodeWorker
from kvbridge.transfer.regions import CacheRegions, MemType


class Staging:
    """One decode worker's staging buffers, by source dtype; owned by its `KVConsumer`,
    called from the consumer's thread only."""

    def __init__(self, worker: DecodeWorker) -> None:
        self._worker = worker
        self._buffers: dict[str, tuple[list[np.ndarray], CacheRegions]] = {}
        self._cache: list[np.ndarray] | None = None  # writable views of the cache regions

    def regions(self, cast: Cast) -> CacheRegions:
        """The staging regions for `cast`'s source dtype, made and registered the first
        time; TransferError for a cache outside host memory (the cast runs on the host)."""
        w = self._worker
        if w.regions.mem_type is not MemType.DRAM:
            raise TransferError(
                f"decode worker {w.rank} keeps its cache in {w.regions.mem_type.value}; "
                f"converting the KV from {cast.src} to {cast.dst} needs a host-memory "
                "(DRAM) cache: give the prefill instance the decode cache's dtype"
            )
        if cast.src not in self._buffers:
            arrays = []
            for n in w.regions.lengths:
                a = np.empty(n // cast.dst_itemsize * cast.src_itemsize, dtype=np.uint8)
                a.fill(0)  # every page touched (np.zeros may map lazily)
                arrays.append(a)
            regions = CacheRegions(
                tuple(a.ctypes.data for a in arrays), tuple(a.nbytes for a in arrays)
            )
            w.transport.register(regions)
            self._buffers[cast.src] = (arrays, regions)
        return self._buffers[cast.src][1]

    def views(self, cast: Cast) -> list[memoryview]:
        """Read-only views of the staging regions of `cast` (to digest what was read)."""
        return [a.data.toreadonly() for a in self._buffers[cast.src][0]]

    @property
    def nbytes(self) -> int:
        """Bytes of every staging buffer made so far."""
        return sum(a.nbytes for arrays, _ in self._buffers.values() for a in arrays)

    def cast(self, pull: ActivePull) -> int:
        """Cast what `pull`'s READs wrote into the staging into the cache (every READ
        done); the cache bytes written."""
        plan = pull.instance.plan
        assert plan is not None and plan.cast is not None
        lists = [cl for cls in pull.copies.values() for cl in cls]
        if not lists:
            return 0
        if self._cache is None:
            self._cache = [
                np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(a))
                for a, n in zip(
                    self._worker.regions.addresses, self._worker.regions.lengths, strict=True
                )
            ]
        return cast_runs(
            plan.cast,
            self._buffers[plan.cast.src][0],
            self._cache,
            np.concatenate([cl.dst_regions for cl in lists]),
            np.concatenate([cl.dst_offsets for cl in lists]),
            np.concatenate([cl.lengths for cl in lists]),
        )
