"""Copy lists: one request's reads as (region, offset) -> (region, offset) byte runs.

A worker's cache is an array in its layout's axis order (`CacheLayout`); the axes
before B split it into regions, and offsets are bytes within a region. The address of
one element on either side is an affine function of its indices:

    region = sum(index[a] * region_stride[a])     over the region axes
    offset = sum(index[a] * byte_stride[a])       over the other axes (B outermost)

with block index = block_ids[t // block_size] and N index = t % block_size for token t.
Between two block boundaries of either side (a *segment*) the block ids are fixed on
both sides, so a read's elements there form a box over the axes L, K, H, N, C with
constant strides on each side. The box is cut into runs at the largest unit
contiguous on both sides: starting from one element, an axis joins the run while its
byte stride equals the run's length on both sides (C first: a token-major row; in a
channel-major half, `CacheLayout.k_inner`, N first: one channel's tokens). The
remaining axes enumerate the runs (numpy broadcasting, no Python loop over blocks or
tokens). Where either side keeps its K and V halves in different orders (one half
channel-major), their strides differ, so each half is a box of its own (K extent 1).
Runs are then sorted by source and merged wherever the next run continues both the
source and the destination within the same regions, which yields exactly the maximal
contiguous runs for these block ids.

    example, BHLNC on both sides, equal layer split, a full-block segment:
        C (row) -> N (block_size rows) -> K -> L -> H (the read's heads)
        = one run per block and prefill worker
    example, LBHKNC:K=CN (vLLM CPU) on both sides, blocks 64 -> 32, a 32-token segment:
        K half: N (32 tokens of one channel), C does not join (its stride is 64 tokens
                on one side, 32 on the other) = one run per channel, head, layer
        V half: C (row) -> N (32 rows) = one run per head and layer
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

# np.unique and np.union1d import numpy.ma on their first call, which costs a server's
# first request dearly when many decode workers make their first copy lists at once
# (docs/benchmarks.md). Importing it here moves that cost to start-up.
import numpy.ma

from kvbridge.errors import LayoutError
from kvbridge.plan.layout import InstanceLayout, WorkerShard, cache_strides
from kvbridge.plan.planner import LocalCopy, Read, TransferPlan

IntArray = np.ndarray


#: What a copy list copies: a `Read` from a prefill worker, or a decode host's `LocalCopy`.
R = TypeVar("R", Read, LocalCopy)


@dataclass(frozen=True)
class CopyList(Generic[R]):
    """The byte copies of one `Read` (or one `LocalCopy`) for one request.

    Descriptor i copies `lengths[i]` bytes from offset `src_offsets[i]` of source
    region `src_regions[i]` (a prefill worker's; a `LocalCopy`'s: its source decode
    worker's) to offset `dst_offsets[i]` of decode region `dst_regions[i]` (all int64
    arrays of one length). `num_unmerged` counts descriptors before merging adjacent
    runs (one per unit contiguous on both sides within one segment).
    """

    read: R
    src_regions: IntArray
    src_offsets: IntArray
    dst_regions: IntArray
    dst_offsets: IntArray
    lengths: IntArray
    num_unmerged: int

    @property
    def num_descriptors(self) -> int:
        return len(self.lengths)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def select(self, mask: IntArray) -> CopyList[R]:
        """The copies where `mask` holds."""
        return CopyList(
            self.read,
            self.src_regions[mask],
            self.src_offsets[mask],
            self.dst_regions[mask],
            self.dst_offsets[mask],
            self.lengths[mask],
            self.num_unmerged,
        )

    def addresses(
        self, src_bases: IntArray, dst_bases: IntArray
    ) -> tuple[IntArray, IntArray, IntArray]:
        """Absolute (src, dst, length) arrays given each side's region base addresses."""
        src = np.asarray(src_bases, np.int64)[self.src_regions] + self.src_offsets
        dst = np.asarray(dst_bases, np.int64)[self.dst_regions] + self.dst_offsets
        return src, dst, self.lengths


def blocks_needed(num_tokens: int, block_size: int, start_token: int = 0) -> int:
    """Blocks that hold tokens [start_token, num_tokens)."""
    return -(-num_tokens // block_size) - start_token // block_size


def check_block_ids(
    block_ids: Sequence[int] | IntArray,
    num_tokens: int,
    block_size: int,
    side: str,
    start_token: int = 0,
) -> IntArray:
    """The block ids holding tokens [start_token, num_tokens), as int64, validated: the
    first is the block of token `start_token`."""
    ids = np.asarray(block_ids, dtype=np.int64).ravel()
    need = blocks_needed(num_tokens, block_size, start_token)
    if len(ids) < need:
        span = (
            f"tokens [{start_token}, {num_tokens})" if start_token else f"num_tokens={num_tokens}"
        )
        raise LayoutError(
            f"{side}_block_ids has {len(ids)} blocks but {span} at "
            f"block_size={block_size} needs {need}"
        )
    ids = ids[:need]
    if need and ids.min() < 0:
        raise LayoutError(f"{side}_block_ids contains {int(ids.min())}; block ids are >= 0")
    if len(np.unique(ids)) != len(ids):
        raise LayoutError(f"{side}_block_ids repeats a block id; each block holds one token range")
    return ids


@dataclass(frozen=True)
class _Side:
    """One side of a read: strides of its cache and where the read starts in it."""

    strides: dict[str, tuple[int, int]]  # axis -> (region stride, byte stride)
    block_size: int
    block_ids: IntArray  # of the blocks from the one holding `first_block`'s tokens on
    first_block: int  # the block index (in token order) of block_ids[0]
    start: dict[str, int]  # first local index of the box along L, K and H

    @classmethod
    def of(
        cls,
        plan: TransferPlan,
        layout: InstanceLayout,
        shard: WorkerShard,
        read: Read | LocalCopy,
        ids: IntArray,
        start_token: int,
        kv: int,
    ) -> _Side:
        """The side of `read` in `shard`'s cache, with the strides of half `kv` (0: K,
        1: V); a box starting at K index `kv`."""
        return cls(
            cache_strides(plan.model, layout, shard, kv),
            layout.block_size,
            ids,
            start_token // layout.block_size,
            {
                "L": read.layers[0] - shard.layers[0],
                "K": kv,
                "H": read.kv_heads[0] - shard.kv_heads[0],
            },
        )

    def at(self, axis: str, index: IntArray | int) -> tuple[IntArray | int, IntArray | int]:
        """(region, offset) contribution of `index` along `axis`."""
        region_stride, byte_stride = self.strides[axis]
        return index * region_stride, index * byte_stride

    def segment_base(self, cuts: IntArray) -> tuple[IntArray, IntArray]:
        """(region, offset) of each segment's first token, at the box's first L, K, H."""
        r_b, o_b = self.at("B", self.block_ids[cuts // self.block_size - self.first_block])
        r_n, o_n = self.at("N", cuts % self.block_size)
        r_l, o_l = self.at("L", self.start["L"])
        r_k, o_k = self.at("K", self.start["K"])
        r_h, o_h = self.at("H", self.start["H"])
        return (
            np.asarray(r_b + r_n + r_l + r_k + r_h, dtype=np.int64),
            np.asarray(o_b + o_n + o_l + o_k + o_h, dtype=np.int64),
        )


def _segment_group(
    src: _Side, dst: _Side, extents: dict[str, int], itemsize: int, s_base: tuple, d_base: tuple
) -> tuple[IntArray, IntArray, IntArray, IntArray, IntArray]:
    """Runs of segments that share one length: (src region, src offset, dst region,
    dst offset, lengths), unmerged. `extents` holds C, L, K, H and N (the segment
    length)."""
    run = itemsize
    outer = [a for a in ("C", "L", "K", "H", "N") if extents[a] > 1]
    grew = True
    while grew:  # grow the run by every axis that continues it on both sides
        grew = False
        for a in outer:
            if src.strides[a] == (0, run) and dst.strides[a] == (0, run):
                run *= extents[a]
                outer.remove(a)
                grew = True
                break
    # [segments, *outer extents]: broadcast every outer axis' index over its own dim
    s_reg, s_off = (x[(...,) + (None,) * len(outer)] for x in s_base)
    d_reg, d_off = (x[(...,) + (None,) * len(outer)] for x in d_base)
    for i, a in enumerate(outer):
        idx = np.arange(extents[a]).reshape((1,) + (1,) * i + (-1,) + (1,) * (len(outer) - i - 1))
        r, o = src.at(a, idx)
        s_reg, s_off = s_reg + r, s_off + o
        r, o = dst.at(a, idx)
        d_reg, d_off = d_reg + r, d_off + o
    shape = np.broadcast_shapes(s_reg.shape, s_off.shape, d_reg.shape, d_off.shape)
    s_reg, s_off, d_reg, d_off = (
        np.broadcast_to(x, shape).ravel() for x in (s_reg, s_off, d_reg, d_off)
    )
    return s_reg, s_off, d_reg, d_off, np.full(s_reg.shape, run, dtype=np.int64)


def _pieces(
    plan: TransferPlan,
    read: Read | LocalCopy,
    p_ids: IntArray,
    d_ids: IntArray,
    num_tokens: int,
    start_token: int,
) -> tuple[IntArray, IntArray, IntArray, IntArray, IntArray]:
    """Unmerged runs of one read (or local copy) over tokens [start_token, num_tokens):
    (src regions, src offsets, dst regions, dst offsets, lengths), each contiguous on
    both sides and inside one segment. A local copy's source is a decode worker, whose
    blocks are `d_ids` too (every worker of an instance has the same block ids)."""
    d = plan.decode_workers[read.decode_rank]
    if isinstance(read, LocalCopy):
        src_layout, s, s_ids = plan.decode, plan.decode_workers[read.source_rank], d_ids
    else:
        src_layout, s, s_ids = plan.prefill, plan.prefill_workers[read.prefill_rank], p_ids
    num_kv = plan.model.num_kv_tensors
    # one box over K/V where both halves share their strides on both sides, else a box
    # per half: [(src side, dst side, K extent)]
    split = num_kv > 1 and any(
        lay.cache_layout.k_inner != lay.cache_layout.v_inner for lay in (src_layout, plan.decode)
    )
    boxes = [
        (
            _Side.of(plan, src_layout, s, read, s_ids, start_token, kv),
            _Side.of(plan, plan.decode, d, read, d_ids, start_token, kv),
            1 if split else num_kv,
        )
        for kv in (range(num_kv) if split else [0])
    ]
    bp, bd = src_layout.block_size, plan.decode.block_size
    first_p, first_d = -(-start_token // bp) * bp, -(-start_token // bd) * bd
    cuts = np.union1d(
        np.union1d(np.arange(first_p, num_tokens, bp), np.arange(first_d, num_tokens, bd)),
        [start_token],
    )
    seg_len = np.diff(np.append(cuts, num_tokens))
    parts = []
    for src, dst, num_k in boxes:
        s_base, d_base = src.segment_base(cuts), dst.segment_base(cuts)
        extents = {"C": plan.model.head_dim, "L": read.num_layers, "K": num_k, "H": read.num_heads}
        for m in np.unique(seg_len):  # a few distinct lengths: full blocks, the last one, ...
            sel = seg_len == m
            parts.append(
                _segment_group(
                    src,
                    dst,
                    {**extents, "N": int(m)},
                    plan.model.itemsize,
                    (s_base[0][sel], s_base[1][sel]),
                    (d_base[0][sel], d_base[1][sel]),
                )
            )
    s_reg, s_off, d_reg, d_off, lengths = (np.concatenate(col) for col in zip(*parts, strict=True))
    return s_reg, s_off, d_reg, d_off, lengths


def merge_runs(
    src_regions: IntArray,
    src: IntArray,
    dst_regions: IntArray,
    dst: IntArray,
    lengths: IntArray,
) -> tuple[IntArray, IntArray, IntArray, IntArray, IntArray]:
    """Sort runs by source (region, offset) and merge each into its predecessor where it
    continues both the source and the destination in the same regions."""
    if len(src) == 0:
        return src_regions, src, dst_regions, dst, lengths
    order = np.lexsort((src, src_regions))
    src_regions, src, dst_regions, dst, lengths = (
        x[order] for x in (src_regions, src, dst_regions, dst, lengths)
    )
    starts = np.ones(len(src), dtype=bool)
    starts[1:] = (
        (src_regions[1:] != src_regions[:-1])
        | (dst_regions[1:] != dst_regions[:-1])
        | (src[1:] != src[:-1] + lengths[:-1])
        | (dst[1:] != dst[:-1] + lengths[:-1])
    )
    idx = np.flatnonzero(starts)
    return (
        src_regions[idx],
        src[idx],
        dst_regions[idx],
        dst[idx],
        np.add.reduceat(lengths, idx),
    )


def _check_request(
    plan: TransferPlan, decode_rank: int, num_tokens: int, start_token: int
) -> tuple[int, int]:
    """(num_tokens, start_token) as ints, validated."""
    if (
        isinstance(num_tokens, bool)
        or not isinstance(num_tokens, (int, np.integer))
        or num_tokens <= 0
    ):
        raise LayoutError(f"num_tokens={num_tokens!r} must be a positive integer")
    if not 0 <= decode_rank < len(plan.decode_workers):
        raise LayoutError(
            f"decode_rank={decode_rank} is outside the decode instance's "
            f"{len(plan.decode_workers)} workers"
        )
    num_tokens = int(num_tokens)
    if isinstance(start_token, bool) or not 0 <= start_token < num_tokens:
        raise LayoutError(
            f"start_token={start_token!r} must be in [0, num_tokens={num_tokens}); "
            "a pull copies at least one token"
        )
    start_token = int(start_token)
    return num_tokens, start_token


def copy_lists(
    plan: TransferPlan,
    decode_rank: int,
    prefill_block_ids: Sequence[int] | IntArray,
    decode_block_ids: Sequence[int] | IntArray,
    num_tokens: int,
    start_token: int = 0,
) -> list[CopyList[Read]]:
    """The copy lists of every read of decode worker `decode_rank` for one request's
    tokens [start_token, num_tokens) (a partial pull: the decode side holds the rest).

    Block ids are the request's blocks in token order on each instance (the same ids on
    every worker of an instance), from the block holding token `start_token` on; only as
    many as those tokens need are used. `start_token` may fall inside a block on either side.
    """
    num_tokens, start_token = _check_request(plan, decode_rank, num_tokens, start_token)
    p_ids = check_block_ids(
        prefill_block_ids, num_tokens, plan.prefill.block_size, "prefill", start_token
    )
    d_ids = check_block_ids(
        decode_block_ids, num_tokens, plan.decode.block_size, "decode", start_token
    )
    return [
        _copy_list(plan, read, p_ids, d_ids, num_tokens, start_token)
        for read in plan.reads_for(decode_rank)
    ]


def _copy_list(
    plan: TransferPlan, read: R, p_ids: IntArray, d_ids: IntArray, num_tokens: int, start: int
) -> CopyList[R]:
    pieces = _pieces(plan, read, p_ids, d_ids, num_tokens, start)
    return CopyList(read, *merge_runs(*pieces), num_unmerged=len(pieces[0]))


def local_copy_lists(
    plan: TransferPlan,
    decode_rank: int,
    decode_block_ids: Sequence[int] | IntArray,
    num_tokens: int,
    start_token: int = 0,
) -> list[CopyList[LocalCopy]]:
    """The copy lists of every `LocalCopy` of decode worker `decode_rank` (the second hop
    of a fan-out: from its source decode worker's cache, on the same host) for one
    request's tokens [start_token, num_tokens); arguments as `copy_lists`. Source and
    destination hold the same shard in the same layout and blocks, so each run's source
    and destination offsets are equal."""
    num_tokens, start_token = _check_request(plan, decode_rank, num_tokens, start_token)
    d_ids = check_block_ids(
        decode_block_ids, num_tokens, plan.decode.block_size, "decode", start_token
    )
    return [
        _copy_list(plan, copy, d_ids, d_ids, num_tokens, start_token)
        for copy in plan.local_copies_for(decode_rank)
    ]
