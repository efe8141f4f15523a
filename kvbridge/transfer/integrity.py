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
chosen by its request id, so every decode worker of a request decides alike. A cache in
device memory (VRAM) is hashed too: its runs are gathered on its device by torch (the
process that owns a GPU cache has it), copied to the host a chunk at a time and hashed
in the same order, so a host cache and a GPU cache of the same bytes give the same
digest.
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvbridge.plan.copylist import CopyList
from kvbridge.transfer.regions import CacheRegions, MemType

#: `Integrity.SAMPLE` checks one request in this many.
SAMPLE_EVERY = 8
#: Bytes of a digest (SHA-256, truncated).
DIGEST_BYTES = 16
#: A device cache's runs are copied to the host in chunks of about this many bytes.
GATHER_BYTES = 64 << 20


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


def region_views(regions: CacheRegions) -> list[Any]:
    """Read-only byte views of the cache regions: memoryviews of host memory (DRAM); of
    device memory (VRAM), torch uint8 tensors over each region on its device."""
    if regions.mem_type is not MemType.DRAM:
        return device_views(regions)
    return [
        memoryview((ctypes.c_uint8 * n).from_address(a)).cast("B").toreadonly()
        for a, n in zip(regions.addresses, regions.lengths, strict=True)
    ]


class _DeviceSpan:
    """`n` bytes at device address `address`, as CUDA's array interface describes them
    (torch reads it: `torch.as_tensor` wraps the memory, it neither copies nor owns it)."""

    def __init__(self, address: int, n: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (n,),
            "typestr": "|u1",
            "data": (address, True),  # read-only
            "version": 3,
            "strides": None,
        }


def device_views(regions: CacheRegions) -> list[Any]:
    """Torch uint8 tensors over device regions (VRAM) on their GPU, sharing its memory."""
    import torch

    device = torch.device("cuda", regions.device_id)
    return [
        torch.as_tensor(_DeviceSpan(a, n), device=device)
        for a, n in zip(regions.addresses, regions.lengths, strict=True)
    ]


def digest(views: Sequence[Any], lists: Sequence[CopyList], side: str) -> bytes:
    """The digest of the bytes of `lists`' runs on one side ("src": the prefill worker's
    regions, "dst": the decode worker's), taken in source order; `views` from
    `region_views` (or torch uint8 tensors, one per region, on any device)."""
    if not lists:
        return hashlib.sha256().digest()[:DIGEST_BYTES]
    src_regions = np.concatenate([cl.src_regions for cl in lists])
    src_offsets = np.concatenate([cl.src_offsets for cl in lists])
    regions = src_regions if side == "src" else np.concatenate([cl.dst_regions for cl in lists])
    offsets = src_offsets if side == "src" else np.concatenate([cl.dst_offsets for cl in lists])
    lengths = np.concatenate([cl.lengths for cl in lists])
    order = np.lexsort((src_offsets, src_regions))
    h = hashlib.sha256()
    runs = zip(
        regions[order].tolist(), offsets[order].tolist(), lengths[order].tolist(), strict=True
    )
    if isinstance(views[0], memoryview):
        for r, o, n in runs:
            h.update(views[r][o : o + n])
    else:
        for chunk in gathered(views, runs):
            h.update(chunk)
    return h.digest()[:DIGEST_BYTES]


def gathered(views: Sequence[Any], runs: Iterator[tuple[int, int, int]]) -> Iterator[Any]:
    """The bytes of `runs` (region, offset, length) of torch tensors `views`, in order,
    gathered on the tensors' device and copied to the host about `GATHER_BYTES` at a time
    (one copy per chunk, not per run), as host arrays."""
    import torch

    parts: list[Any] = []
    size = 0
    for r, o, n in runs:
        parts.append(views[r][o : o + n])
        size += n
        if size >= GATHER_BYTES:
            yield torch.cat(parts).cpu().numpy()
            parts, size = [], 0
    if parts:
        yield torch.cat(parts).cpu().numpy()
