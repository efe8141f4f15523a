"""From a planner `CopyList` to NIXL descriptor lists and index arrays (numpy only).

Descriptor lists are prepared once per peer and *unit size* g: every region of a
worker cut into g-byte units,

    unit index of (region r, byte offset o) = unit_start[r] + o // g
    unit_start[r] = sum(lengths[:r]) // g           (g divides every region length)

A request's copy list is then an index array on each side: the copy
(src region rs, dst region rd, offsets so/do, length n) becomes n // g consecutive
units on both sides. g is the gcd of the copy list's offsets, lengths and region
lengths, so every copy is a whole number of units; NIXL merges consecutive units
back into one descriptor when both sides are contiguous, so a run of units costs no
more on the wire than one descriptor. Lists are prepared only at the unit of whole
blocks (and only up to `max_units`): the copies of a partial last block, whose unit can
be a single token of one head, get the request's own merged descriptors from
`exact_descs` instead (the consumer posts them as a second READ).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from kvbridge.transfer.regions import CacheRegions

if TYPE_CHECKING:
    from kvbridge.plan.copylist import CopyList


def unit_size(cl: CopyList, src_lengths: tuple[int, ...], dst_lengths: tuple[int, ...]) -> int:
    """The largest g dividing every offset, length and region length involved."""
    g = 0
    for arr in (cl.src_offsets, cl.dst_offsets, cl.lengths):
        if len(arr):
            g = math.gcd(g, int(np.gcd.reduce(arr.astype(np.int64))))
    for n in (*src_lengths, *dst_lengths):
        g = math.gcd(g, int(n))
    return max(g, 1)


def num_units(regions: CacheRegions, g: int) -> int:
    return sum(regions.lengths) // g


def unit_descs(regions: CacheRegions, g: int) -> np.ndarray:
    """Nx3 uint64 (address, g, device id): every g-byte unit of every region, in order."""
    parts = []
    for addr, length in zip(regions.addresses, regions.lengths, strict=True):
        # [length // g] addresses of one region's units
        parts.append(addr + np.arange(length // g, dtype=np.uint64) * np.uint64(g))
    addrs = np.concatenate(parts)
    out = np.empty((len(addrs), 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = g
    out[:, 2] = regions.device_id
    return out


def _unit_start(regions: CacheRegions, g: int) -> np.ndarray:
    lengths = np.asarray(regions.lengths, dtype=np.int64) // g
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)


def unit_indices(
    cl: CopyList, g: int, src: CacheRegions, dst: CacheRegions
) -> tuple[np.ndarray, np.ndarray]:
    """(remote unit indices, local unit indices), int32, paired element by element."""
    per = cl.lengths // g  # [M] units per copy
    total = int(per.sum())
    first = np.repeat(np.cumsum(per) - per, per)  # [U] index of each unit's copy start
    within = np.arange(total, dtype=np.int64) - first  # [U] 0..per[m]-1 within copy m
    src_idx = np.repeat(_unit_start(src, g)[cl.src_regions] + cl.src_offsets // g, per) + within
    dst_idx = np.repeat(_unit_start(dst, g)[cl.dst_regions] + cl.dst_offsets // g, per) + within
    return src_idx.astype(np.int32), dst_idx.astype(np.int32)


def exact_descs(
    cl: CopyList, src: CacheRegions, dst: CacheRegions
) -> tuple[np.ndarray, np.ndarray]:
    """(remote Nx3, local Nx3) descriptors of exactly this copy list, one row per copy."""

    def side(regions: CacheRegions, region_ids: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        out = np.empty((len(offsets), 3), dtype=np.uint64)
        out[:, 0] = np.asarray(regions.addresses, dtype=np.uint64)[region_ids] + offsets.astype(
            np.uint64
        )
        out[:, 1] = cl.lengths.astype(np.uint64)
        out[:, 2] = regions.device_id
        return out

    return side(src, cl.src_regions, cl.src_offsets), side(dst, cl.dst_regions, cl.dst_offsets)
