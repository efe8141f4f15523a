"""Integrity of pulled KV: a digest of the bytes read, computed on both sides.

Prefill and decode caches differ in layout, tp and block size, so the digest is over
what both sides can compute: the byte runs of the pair's copy lists (`copy_lists`)
taken in source order (prefill region, then offset). The producer hashes its source
bytes of each run, the consumer its destination bytes of the same runs, so equal bytes
give equal digests however each side cuts or merges its runs (a run list is a cut of
the same byte ranges; the producer plans the pair with stand-in decode block ids).

The producer computes its digest when it answers a ReadDone held (`ReadAck.digest`):
the exposure was pinned since expose, and pinned blocks are never written (a finished
request's blocks; a shared prefix block is full and immutable), so that is the digest
of the bytes at expose time, computed only for what is actually read. The consumer
hashes its copy while the producer hashes its own, and a mismatch fails the pull
(`PullFailure.INTEGRITY`).

The check costs more than a same-host pull on a loaded 2-core machine (docs/benchmarks.md),
so by default it is sampled: `Integrity.SAMPLE` checks one request in `SAMPLE_EVERY`,
chosen by its request id, so every decode worker of a request decides alike. DRAM only:
a VRAM cache is never hashed (the check is skipped, with a warning once).
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
from collections.abc import Sequence

import numpy as np

from kvbridge.plan.copylist import CopyList
from kvbridge.transfer.regions import CacheRegions, MemType

#: `Integrity.SAMPLE` checks one request in this many.
SAMPLE_EVERY = 8
#: Bytes of a digest (SHA-256, truncated).
DIGEST_BYTES = 16


class Integrity(enum.Enum):
    """Whether a decode worker checks the digest of what it pulled."""

    ON = "on"  # every pull
    OFF = "off"  # none
    SAMPLE = "sample"  # one request in SAMPLE_EVERY (by request id)


def is_checked(mode: Integrity, request_id: str) -> bool:
    """Whether the pull of `request_id` is checked under `mode` (the same answer on
    every decode worker)."""
    if mode is Integrity.SAMPLE:
        pick = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
        return int.from_bytes(pick, "little") % SAMPLE_EVERY == 0
    return mode is Integrity.ON


def region_views(regions: CacheRegions) -> list[memoryview] | None:
    """Read-only byte views of host-memory cache regions; None for device memory (VRAM),
    which this process cannot read directly."""
    if regions.mem_type is not MemType.DRAM:
        return None
    return [
        memoryview((ctypes.c_uint8 * n).from_address(a)).cast("B").toreadonly()
        for a, n in zip(regions.addresses, regions.lengths, strict=True)
    ]


def digest(views: Sequence[memoryview], lists: Sequence[CopyList], side: str) -> bytes:
    """The digest of the bytes of `lists`' runs on one side ("src": the prefill worker's
    regions, "dst": the decode worker's), taken in source order."""
    if not lists:
        return hashlib.sha256().digest()[:DIGEST_BYTES]
    src_regions = np.concatenate([cl.src_regions for cl in lists])
    src_offsets = np.concatenate([cl.src_offsets for cl in lists])
    regions = src_regions if side == "src" else np.concatenate([cl.dst_regions for cl in lists])
    offsets = src_offsets if side == "src" else np.concatenate([cl.dst_offsets for cl in lists])
    lengths = np.concatenate([cl.lengths for cl in lists])
    order = np.lexsort((src_offsets, src_regions))
    h = hashlib.sha256()
    for r, o, n in zip(
        regions[order].tolist(), offsets[order].tolist(), lengths[order].tolist(), strict=True
    ):
        h.update(views[r][o : o + n])
    return h.digest()[:DIGEST_BYTES]
