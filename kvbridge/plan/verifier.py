"""Byte-exact verification of a plan on numpy buffers.

Every worker's cache is filled with values that encode where they belong:
a slot holding token t of a request gets hash(layer, kv, global head, t, element,
request key); every other slot gets hash(layer, kv, head, physical slot, element,
worker salt). Each element is placed where its layout's strides put it, a
channel-major half (`CacheLayout.k_inner`) included. Applying the copy lists must leave each decode worker holding exactly
the request's values in the request's slots -- what it would have computed itself --
and every other byte as it was.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbridge.errors import KVBridgeError
from kvbridge.plan.cast import run_indices
from kvbridge.plan.copylist import CopyList, check_block_ids, copy_lists, local_copy_lists
from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.plan.layout import (
    InstanceLayout,
    WorkerShard,
    cache_extents,
    cache_shape,
    num_regions,
)
from kvbridge.plan.planner import TransferPlan

_UINT: dict[int, type[np.unsignedinteger]] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def uint_dtype(itemsize: int) -> type[np.unsignedinteger]:
    """The unsigned integer type of `itemsize` bytes (caches are handled as raw bits)."""
    return _UINT[itemsize]


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


class VerificationError(KVBridgeError):
    """Bytes on a decode worker differ from what it would have computed itself."""


@dataclass(frozen=True)
class RequestSpan:
    """One request's blocks on one instance: its block ids in token order, and the
    first token its values are written for (a partial pull leaves [0, start_token) as
    it was). `read_end` past `num_tokens`: the slots [num_tokens, read_end) were read
    whole from a producer that zeroed them (`TransferPlan.read_end`), so they hold 0."""

    block_ids: np.ndarray
    num_tokens: int
    key: int = 1
    start_token: int = 0
    read_end: int = 0


def _mix(*parts: np.ndarray | int) -> np.ndarray:
    """splitmix64 over a combination of the parts (uint64 arithmetic wraps)."""
    x = np.asarray(np.uint64(0x9E3779B97F4A7C15))
    for part in parts:
        x = (x ^ np.asarray(part).astype(np.uint64)) * _M1
        x = (x ^ (x >> np.uint64(29))) * _M2
    return x ^ (x >> np.uint64(32))


def _grid(
    model: ModelKVSpec, layout: InstanceLayout, shard: WorkerShard, num_blocks: int
) -> tuple[dict[str, np.ndarray], tuple[int, ...]]:
    """(index arrays, grid shape): the logical indices of every element of the cache, as
    arrays broadcastable over the *grid shape*, the layout's axes up to K, then one axis
    over the elements after K in memory order. That order is each half's own
    (`CacheLayout.axis_order`: a channel-major half trades N and C), so a cache-shaped
    array reshaped to the grid shape holds every element where the strides put it.

        LBHKNC:K=CN   grid [L][B][H][K][N*C]: K index 0 runs over (C, N), 1 over (N, C)
    """
    cl = layout.cache_layout
    ext = cache_extents(model, shard, layout.block_size, num_blocks)
    cut = cl.order.index("K") + 1
    outer = cl.order[:cut]
    inner_size = math.prod(ext[a] for a in cl.order[cut:])
    shape = (*(ext[a] for a in outer), inner_size)
    idx = dict(zip(outer, np.ix_(*(np.arange(n) for n in shape))[:-1], strict=True))
    # [K extent, inner_size] per inner axis: each half's indices in its memory order
    halves = [cl.axis_order(kv)[cut:] for kv in range(ext["K"])]
    flat = [
        dict(zip(h, np.unravel_index(np.arange(inner_size), [ext[a] for a in h]), strict=True))
        for h in halves
    ]
    at_k = (1,) * (cut - 1) + (ext["K"], inner_size)  # K's dim and the last one
    for a in cl.order[cut:]:
        idx[a] = np.stack([f[a] for f in flat]).reshape(at_k)
    names = {"layer": "L", "kv": "K", "head": "H", "block": "B", "slot": "N", "elem": "C"}
    out = {name: idx[a] for name, a in names.items()}
    out["layer"] = shard.layers[0] + out["layer"]
    out["head"] = shard.kv_heads[0] + out["head"]
    return out, shape


def _request_values(
    model: ModelKVSpec,
    layout: InstanceLayout,
    shard: WorkerShard,
    num_blocks: int,
    requests: Sequence[RequestSpan],
    out: np.ndarray,
) -> None:
    """Write every request's token values into `out` (a C-contiguous cache-shaped array)."""
    g, shape = _grid(model, layout, shard, num_blocks)
    out = out.reshape(shape)  # a view: the same memory, as the grid sees it
    dtype = out.dtype
    for req in requests:
        ids = check_block_ids(req.block_ids, req.num_tokens, layout.block_size, "request")
        if len(ids) and ids.max() >= num_blocks:
            raise VerificationError(f"block id {int(ids.max())} >= num_blocks={num_blocks}")
        position = np.full(num_blocks, -1, dtype=np.int64)
        position[ids] = np.arange(len(ids))
        token = position[g["block"]] * layout.block_size + g["slot"]
        held = (position[g["block"]] >= 0) & (token < req.num_tokens) & (token >= req.start_token)
        mask = np.broadcast_to(held, out.shape)
        values = _mix(g["layer"], g["kv"], g["head"], token, g["elem"], int(req.key))
        out[mask] = np.broadcast_to(values, out.shape)[mask].astype(dtype)
        zeroed = (position[g["block"]] >= 0) & (token >= req.num_tokens) & (token < req.read_end)
        out[np.broadcast_to(zeroed, out.shape)] = 0


def fill_worker_cache(
    model: ModelKVSpec,
    layout: InstanceLayout,
    shard: WorkerShard,
    num_blocks: int,
    requests: Sequence[RequestSpan],
    salt: int,
) -> np.ndarray:
    """A worker's cache, shaped `cache_shape` (unsigned ints of the cache's itemsize):
    the requests' tokens hold their values, every other slot values keyed by `salt`."""
    g, shape = _grid(model, layout, shard, num_blocks)
    dtype = uint_dtype(model.itemsize)
    phys = g["block"] * layout.block_size + g["slot"]
    out = _mix(g["layer"], g["kv"], g["head"], phys, g["elem"], int(salt) + (1 << 40))
    out = np.ascontiguousarray(np.broadcast_to(out, shape)).astype(dtype)
    out = out.reshape(cache_shape(model, layout, shard, num_blocks))
    _request_values(model, layout, shard, num_blocks, requests, out)
    return out


def expected_decode_cache(
    model: ModelKVSpec,
    layout: InstanceLayout,
    shard: WorkerShard,
    initial: np.ndarray,
    requests: Sequence[RequestSpan],
) -> np.ndarray:
    """What a decode worker whose cache was `initial` must hold once the requests' KV
    arrived: `initial` with the requests' token slots holding their values."""
    out = initial.copy()
    _request_values(model, layout, shard, num_blocks_of(layout, initial), requests, out)
    return out


def num_blocks_of(layout: InstanceLayout, cache: np.ndarray) -> int:
    """The number of blocks of a cache-shaped array."""
    return int(cache.shape[layout.cache_layout.order.index("B")])


def region_bytes(cache: np.ndarray, num_regions: int) -> np.ndarray:
    """A cache-shaped array as bytes, one row per region: [regions, region bytes]."""
    return cache.reshape(num_regions, -1).view(np.uint8)


def apply_copy_lists(src: np.ndarray, dst: np.ndarray, lists: Sequence[CopyList]) -> int:
    """Execute copy lists from one source worker's regions into a destination's (in place).
    Both are [regions, region bytes] uint8 views (`region_bytes`). Returns bytes copied."""
    copied = 0
    for cl in lists:
        if len(cl.lengths) == 0:
            continue
        for name, regs, offs, side in (
            ("src", cl.src_regions, cl.src_offsets, src),
            ("dst", cl.dst_regions, cl.dst_offsets, dst),
        ):
            end = int((offs + cl.lengths).max())
            if end > side.shape[1] or int(regs.max()) >= side.shape[0] or int(regs.min()) < 0:
                raise VerificationError(
                    f"{name} run ends at byte {end} of region {int(regs.max())}, past the "
                    f"{side.shape[0]} regions of {side.shape[1]} bytes"
                )
        s_reg = np.repeat(cl.src_regions, cl.lengths)
        d_reg = np.repeat(cl.dst_regions, cl.lengths)
        dst[d_reg, run_indices(cl.dst_offsets, cl.lengths)] = src[
            s_reg, run_indices(cl.src_offsets, cl.lengths)
        ]
        copied += cl.nbytes
    return copied


@dataclass
class VerifyReport:
    """What `verify_plan` checked."""

    num_tokens: int
    bytes_copied: int = 0  # link and local together
    link_bytes: int = 0  # read from prefill workers
    local_bytes: int = 0  # copied between decode workers of one host (the second hop)
    descriptors_unmerged: int = 0
    descriptors: int = 0
    per_decode_rank: dict[int, tuple[int, int]] = field(default_factory=dict)


def _first_mismatch(
    model: ModelKVSpec,
    layout: InstanceLayout,
    shard: WorkerShard,
    got: np.ndarray,
    want: np.ndarray,
) -> str:
    g, shape = _grid(model, layout, shard, num_blocks_of(layout, got))
    wrong = got.reshape(shape) != want.reshape(shape)
    pos = tuple(int(i[0]) for i in np.nonzero(wrong))
    at = {name: int(np.broadcast_to(a, shape)[pos]) for name, a in g.items()}
    kv = ("K", "V")[at["kv"]] if not model.is_mla else "latent"
    return (
        f"decode rank {shard.rank}: {int(wrong.sum())} elements wrong, first at layer "
        f"{at['layer']} {kv} head {at['head']} block {at['block']} slot {at['slot']} "
        f"element {at['elem']}"
    )


def verify_plan(
    plan: TransferPlan,
    num_tokens: int,
    *,
    seed: int = 0,
    spare_blocks: int = 3,
    start_token: int = 0,
) -> VerifyReport:
    """Run the plan for one synthetic request with shuffled, non-contiguous block ids
    on both sides and check every decode worker byte for byte; with `start_token`, a
    partial pull of tokens [start_token, num_tokens) that must leave the decode side's
    earlier tokens as they were. A plan with local copies (a fan-out on a decode host)
    runs them after their source's reads, from the source's cache as the reads left it.
    Raises VerificationError."""
    rng = np.random.default_rng(seed)
    model = plan.model

    def request(layout: InstanceLayout, key: int) -> tuple[int, RequestSpan]:
        need = -(-num_tokens // layout.block_size)
        num_blocks = need + spare_blocks
        ids = rng.permutation(num_blocks)[:need]
        return num_blocks, RequestSpan(ids, num_tokens, key)

    p_blocks, p_req = request(plan.prefill, key=7)
    d_blocks, d_req = request(plan.decode, key=7)
    d_req = RequestSpan(d_req.block_ids, num_tokens, d_req.key, start_token)
    p_first = start_token // plan.prefill.block_size
    d_first = start_token // plan.decode.block_size
    p_caches = [
        fill_worker_cache(model, plan.prefill, w, p_blocks, [p_req], salt=1000 + w.rank)
        for w in plan.prefill_workers
    ]
    report = VerifyReport(num_tokens)
    done: dict[int, np.ndarray] = {}  # decode rank -> its cache once its reads are done
    # a local copy's source reads over the link itself, so sources come first
    order = sorted(plan.decode_workers, key=lambda w: bool(plan.local_copies_for(w.rank)))
    for d in order:
        initial = fill_worker_cache(model, plan.decode, d, d_blocks, [], salt=5000 + d.rank)
        cache = initial.copy()
        lists = copy_lists(
            plan,
            d.rank,
            p_req.block_ids[p_first:],
            d_req.block_ids[d_first:],
            num_tokens,
            start_token,
        )
        dst = region_bytes(cache, num_regions(model, plan.decode, d))
        for cl in lists:
            p = plan.prefill_workers[cl.read.prefill_rank]
            src = region_bytes(p_caches[p.rank], num_regions(model, plan.prefill, p))
            report.link_bytes += apply_copy_lists(src, dst, [cl])
        local = local_copy_lists(plan, d.rank, d_req.block_ids[d_first:], num_tokens, start_token)
        for lc in local:
            s = plan.decode_workers[lc.read.source_rank]
            if s.rank not in done:
                raise VerificationError(
                    f"decode rank {d.rank} copies from decode rank {s.rank} before its reads"
                )
            src = region_bytes(done[s.rank], num_regions(model, plan.decode, s))
            report.local_bytes += apply_copy_lists(src, dst, [lc])
        done[d.rank] = cache
        unmerged = sum(c.num_unmerged for c in lists) + sum(c.num_unmerged for c in local)
        merged = sum(c.num_descriptors for c in lists) + sum(c.num_descriptors for c in local)
        report.descriptors_unmerged += unmerged
        report.descriptors += merged
        report.per_decode_rank[d.rank] = (unmerged, merged)
        want = expected_decode_cache(model, plan.decode, d, initial, [d_req])
        if not np.array_equal(cache, want):
            raise VerificationError(_first_mismatch(model, plan.decode, d, cache, want))
    report.bytes_copied = report.link_bytes + report.local_bytes
    n = num_tokens - start_token
    for what, got, planned in (
        ("read", report.link_bytes, n * plan.link_bytes_per_token),
        ("copied locally", report.local_bytes, n * plan.local_bytes_per_token),
    ):
        if got != planned:
            raise VerificationError(f"{what} {got} bytes, the plan accounts for {planned}")
    report.per_decode_rank = dict(sorted(report.per_decode_rank.items()))
    return report


def count_contiguous_runs(cl: CopyList, unit: int) -> int:
    """Brute-force count of maximal runs contiguous on both sides, at the granularity of
    `unit` bytes (a row; one element where a side keeps a half channel-major): an
    independent check of `merge_runs` (used by tests and the bench)."""
    if not len(cl.lengths):
        return 0
    per = cl.lengths // unit
    s_reg, d_reg = np.repeat(cl.src_regions, per), np.repeat(cl.dst_regions, per)
    s_rows = run_indices(cl.src_offsets // unit, per)
    d_rows = run_indices(cl.dst_offsets // unit, per)
    order = np.lexsort((s_rows, s_reg))
    s_reg, d_reg, s_rows, d_rows = s_reg[order], d_reg[order], s_rows[order], d_rows[order]
    breaks = (np.diff(s_rows) != 1) | (np.diff(d_rows) != 1)
    breaks |= (np.diff(s_reg) != 0) | (np.diff(d_reg) != 0)
    return 1 + int(np.count_nonzero(breaks))
