"""The kernel's floor under NIXL's UCX transport on one machine: `process_vm_readv`.

Between two processes on one host, UCX reads through CMA (cross-memory attach): one
`process_vm_readv` system call per posted descriptor. This module measures that call
with no library in between, for the run size and count of a transfer plan:

  scattered:  `num_runs` runs of `run_bytes`, every other run of the source read, in
              shuffled order (the shape of "half the heads of every block"),
              IOV_MAX runs per call -- fewer calls than UCX makes, so a bound
  contiguous: the same bytes, 64 MiB per call
  shared:     the same bytes contiguous from shared memory (a memfd mapped read-only,
              as a KV export process maps its worker's cache), which gets huge pages
              only where the host allows them for shared memory (`shmem_huge_pages`)

Their ratio is the best any CMA-based transfer of those runs can reach against one
single-descriptor read on this machine. Linux only; `None` elsewhere or when the
kernel refuses (ptrace restrictions).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import cast

import numpy as np

IOV_MAX = 1024
_CHUNK = 64 << 20
_FILL = 7


@dataclass(frozen=True)
class CmaFloor:
    run_bytes: int
    num_runs: int
    scattered_s: float  # best of the repeats
    contiguous_s: float
    shared_s: float | None = None  # contiguous from shared memory; None if not measured

    @property
    def ratio(self) -> float:
        return self.contiguous_s / self.scattered_s

    @property
    def shared_ratio(self) -> float | None:
        """Shared memory's read time against private memory's (1.0: no cost)."""
        return self.shared_s / self.contiguous_s if self.shared_s else None


#: where the host says whether shared memory (memfd, tmpfs) gets transparent huge pages
SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def shmem_huge_pages() -> str | None:
    """The host's policy for huge pages in shared memory (`SHMEM_ENABLED`'s chosen word:
    always, within_size, advise, never, ...), None where it does not say."""
    try:
        with open(SHMEM_ENABLED) as f:
            words = f.read().split()
    except OSError:
        return None
    chosen = [w.strip("[]") for w in words if w.startswith("[")]
    return chosen[0] if chosen else None


def _hold(conn: Connection, nbytes: int, shared_bytes: int) -> None:
    """Child: own a touched private buffer of `nbytes` and a shared segment of
    `shared_bytes` mapped read-only (an export process's view), report both addresses,
    wait to be told to exit."""
    buf = np.full(nbytes, _FILL, dtype=np.uint8)  # touched
    fd = os.memfd_create("kvbridge-floor")
    os.ftruncate(fd, shared_bytes)
    with mmap.mmap(fd, shared_bytes, flags=mmap.MAP_SHARED) as rw:
        if hasattr(mmap, "MADV_HUGEPAGE"):  # as SharedSegment asks
            rw.madvise(mmap.MADV_HUGEPAGE)
        np.frombuffer(rw, dtype=np.uint8).fill(_FILL)
    ro = mmap.mmap(fd, shared_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    shared = np.frombuffer(ro, dtype=np.uint8)
    conn.send((buf.ctypes.data, shared.ctypes.data))
    conn.recv()


def _readv() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = getattr(libc, "process_vm_readv", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return cast(Callable[..., int], fn)


def measure(run_bytes: int, num_runs: int, repeat: int = 3, seed: int = 0) -> CmaFloor | None:
    """Time `num_runs` scattered `run_bytes` runs and the same bytes contiguous (best of
    `repeat`), read from a child process with `process_vm_readv`."""
    readv = _readv()
    if readv is None or run_bytes <= 0 or num_runs <= 0:
        return None
    total = run_bytes * num_runs
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_hold, args=(child, 2 * total, total), daemon=True)
    proc.start()
    child.close()  # ours: so that a child dying at start reads as end-of-file, not a wait
    try:
        if not parent.poll(60):
            return None
        remote, remote_shared = (int(a) for a in parent.recv())
        dst = np.full(total, 0, dtype=np.uint8)  # touched
        order = np.random.default_rng(seed).permutation(num_runs).astype(np.uint64)
        # [num_runs, 2] iovec arrays (base, len): local runs in order, remote ones shuffled
        local = np.empty((num_runs, 2), dtype=np.uint64)
        local[:, 0] = dst.ctypes.data + np.arange(num_runs, dtype=np.uint64) * run_bytes
        local[:, 1] = run_bytes
        far = np.empty_like(local)
        far[:, 0] = remote + order * np.uint64(2 * run_bytes)
        far[:, 1] = run_bytes

        def scattered() -> bool:
            for s in range(0, num_runs, IOV_MAX):
                k = min(IOV_MAX, num_runs - s)
                at = s * local.itemsize * 2
                got = readv(proc.pid, local.ctypes.data + at, k, far.ctypes.data + at, k, 0)
                if got != k * run_bytes:
                    return False
            return True

        def contiguous(base: int = remote) -> bool:
            one = np.empty((2, 2), dtype=np.uint64)  # [local iovec, remote iovec]
            for s in range(0, total, _CHUNK):
                k = min(_CHUNK, total - s)
                one[0] = (dst.ctypes.data + s, k)
                one[1] = (base + s, k)
                if readv(proc.pid, one.ctypes.data, 1, one.ctypes.data + 16, 1, 0) != k:
                    return False
            return True

        def shared() -> bool:
            return contiguous(remote_shared)

        best = []
        for fn in (scattered, contiguous, shared):
            times = []
            for _ in range(max(1, repeat)):
                t0 = time.perf_counter()
                if not fn():
                    return None  # e.g. ptrace_scope forbids reading the child
                times.append(time.perf_counter() - t0)
            if not (dst == _FILL).all():  # every byte came from the child
                return None
            dst.fill(0)
            best.append(min(times))
        return CmaFloor(run_bytes, num_runs, best[0], best[1], best[2])
    finally:
        with contextlib.suppress(OSError):  # the child may already be gone
            parent.send(None)
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
