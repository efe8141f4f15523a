"""Copy lists: one request's reads as (src offset, dst offset, length) byte runs.

Offsets are relative to the start of a cache region (one layer's K, V or latent; see
`layout.py`). Every region of a worker has the same shape, so the byte runs of a read
are the same for each (layer, kv) region pair it touches: a `CopyList` stores the
region pairs [R] and the runs [M] once, and stands for R x M descriptors.

Byte offset of (token t, local head h) in a region, row = head_dim * itemsize,
blk = block_ids[t // block_size], slot = t % block_size, H = local KV heads:

    HND  ((blk * H + h) * block_size + slot) * row   a head's tokens are adjacent
    NHD  ((blk * block_size + slot) * H + h) * row   a token's heads are adjacent

With H == 1 both formulas agree. Runs are first cut at the natural unit the two
layouts share (see `_pieces`), then sorted by source offset and merged wherever the
next piece continues both the source and the destination run, which yields exactly
the maximal contiguous runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# np.unique and np.union1d import numpy.ma on their first call: 0.1-0.2 s of CPU, over
# a second when nine decode workers make their first copy lists at once. Importing it
# here moves that cost from a server's first request to its start.
import numpy.ma

from kvbridge.errors import LayoutError
from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.plan.layout import CacheLayout, InstanceLayout, WorkerShard, region_index
from kvbridge.plan.planner import Read, TransferPlan

IntArray = np.ndarray


@dataclass(frozen=True)
class CopyList:
    """The byte copies of one `Read` for one request.

    Descriptor i of region pair j copies `lengths[i]` bytes from offset `src_offsets[i]`
    of prefill region `src_regions[j]` to offset `dst_offsets[i]` of decode region
    `dst_regions[j]`. `num_unmerged` counts descriptors before merging adjacent runs
    (one per piece contiguous within a single block on both sides), over all pairs.
    """

    read: Read
    src_regions: IntArray
    dst_regions: IntArray
    src_offsets: IntArray
    dst_offsets: IntArray
    lengths: IntArray
    num_unmerged: int

    @property
    def num_region_pairs(self) -> int:
        return len(self.src_regions)

    @property
    def num_descriptors(self) -> int:
        return self.num_region_pairs * len(self.lengths)

    @property
    def nbytes(self) -> int:
        return self.num_region_pairs * int(self.lengths.sum())

    def addresses(
        self, src_bases: IntArray, dst_bases: IntArray
    ) -> tuple[IntArray, IntArray, IntArray]:
        """Absolute (src, dst, length) arrays given each side's region base addresses
        (indexed by region); descriptors ordered region pair by region pair."""
        src = (
            np.asarray(src_bases, np.int64)[self.src_regions][:, None] + self.src_offsets
        ).ravel()
        dst = (
            np.asarray(dst_bases, np.int64)[self.dst_regions][:, None] + self.dst_offsets
        ).ravel()
        return src, dst, np.tile(self.lengths, self.num_region_pairs)


def region_nbytes(
    model: ModelKVSpec, layout: InstanceLayout, shard: WorkerShard, num_blocks: int
) -> int:
    """Bytes of one cache region of `shard` with `num_blocks` blocks."""
    return num_blocks * layout.block_size * shard.num_local_heads * model.head_bytes


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def check_block_ids(
    block_ids: Sequence[int] | IntArray, num_tokens: int, block_size: int, side: str
) -> IntArray:
    """The first ceil(num_tokens / block_size) block ids as int64, validated."""
    ids = np.asarray(block_ids, dtype=np.int64).ravel()
    need = blocks_needed(num_tokens, block_size)
    if len(ids) < need:
        raise LayoutError(
            f"{side}_block_ids has {len(ids)} blocks but num_tokens={num_tokens} at "
            f"block_size={block_size} needs {need}"
        )
    ids = ids[:need]
    if need and ids.min() < 0:
        raise LayoutError(f"{side}_block_ids contains {int(ids.min())}; block ids are >= 0")
    if len(np.unique(ids)) != len(ids):
        raise LayoutError(f"{side}_block_ids repeats a block id; each block holds one token range")
    return ids


def _offsets(
    layout: CacheLayout,
    num_local_heads: int,
    block_size: int,
    row: int,
    block_ids: IntArray,
    tokens: IntArray,
    head: IntArray | int,
) -> IntArray:
    blk = block_ids[tokens // block_size]
    slot = tokens % block_size
    if layout is CacheLayout.HND:
        return ((blk * num_local_heads + head) * block_size + slot) * row
    return ((blk * block_size + slot) * num_local_heads + head) * row


def _pieces(
    model: ModelKVSpec,
    plan: TransferPlan,
    read: Read,
    p_ids: IntArray,
    d_ids: IntArray,
    num_tokens: int,
) -> tuple[IntArray, IntArray, IntArray]:
    """Unmerged runs of one region pair: (src offsets, dst offsets, lengths).

    The unit is the largest one contiguous on both sides whatever the block ids:
      both head-major (HND or one local head): one run per (head, token segment), a
        segment being the tokens between two block boundaries of either side;
      both token-major (NHD or one local head): one run per token over the read's heads;
      otherwise: one run per (token, head).
    """
    p = plan.prefill_workers[read.prefill_rank]
    d = plan.decode_workers[read.decode_rank]
    bp, bd = plan.prefill.block_size, plan.decode.block_size
    hp, hd = p.num_local_heads, d.num_local_heads
    lp, ld = plan.prefill.cache_layout, plan.decode.cache_layout
    row = model.head_bytes
    n = read.num_heads
    p0, d0 = read.kv_heads[0] - p.kv_heads[0], read.kv_heads[0] - d.kv_heads[0]
    hnd, nhd = CacheLayout.HND, CacheLayout.NHD

    if (lp is hnd or hp == 1) and (ld is hnd or hd == 1):
        cuts = np.union1d(np.arange(0, num_tokens, bp), np.arange(0, num_tokens, bd))
        seg_len = np.diff(np.append(cuts, num_tokens))
        heads = np.arange(n)[:, None]  # [n, 1] x segments [S] -> [n, S]
        src = _offsets(hnd, hp, bp, row, p_ids, cuts[None, :], p0 + heads)
        dst = _offsets(hnd, hd, bd, row, d_ids, cuts[None, :], d0 + heads)
        lengths = np.broadcast_to(seg_len * row, src.shape)
    elif (lp is nhd or hp == 1) and (ld is nhd or hd == 1):
        tokens = np.arange(num_tokens)
        src = _offsets(nhd, hp, bp, row, p_ids, tokens, p0)
        dst = _offsets(nhd, hd, bd, row, d_ids, tokens, d0)
        lengths = np.full(num_tokens, n * row)
    else:
        tokens = np.arange(num_tokens)[None, :]  # [1, T] x heads [n, 1] -> [n, T]
        heads = np.arange(n)[:, None]
        src = _offsets(lp, hp, bp, row, p_ids, tokens, p0 + heads)
        dst = _offsets(ld, hd, bd, row, d_ids, tokens, d0 + heads)
        lengths = np.broadcast_to(np.int64(row), src.shape)
    return src.ravel(), dst.ravel(), np.ascontiguousarray(lengths).ravel()


def merge_runs(
    src: IntArray, dst: IntArray, lengths: IntArray
) -> tuple[IntArray, IntArray, IntArray]:
    """Sort runs by source offset and merge each into its predecessor where it continues
    both the source and the destination."""
    if len(src) == 0:
        return src, dst, lengths
    order = np.argsort(src, kind="stable")
    src, dst, lengths = src[order], dst[order], lengths[order]
    starts = np.ones(len(src), dtype=bool)
    starts[1:] = (src[1:] != src[:-1] + lengths[:-1]) | (dst[1:] != dst[:-1] + lengths[:-1])
    idx = np.flatnonzero(starts)
    return src[idx], dst[idx], np.add.reduceat(lengths, idx)


def copy_lists(
    plan: TransferPlan,
    decode_rank: int,
    prefill_block_ids: Sequence[int] | IntArray,
    decode_block_ids: Sequence[int] | IntArray,
    num_tokens: int,
) -> list[CopyList]:
    """The copy lists of every read of decode worker `decode_rank` for one request.

    Block ids are the request's blocks in token order on each instance (the same ids
    on every worker of an instance); only the first ceil(num_tokens / block_size) are used.
    """
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
    model = plan.model
    p_ids = check_block_ids(prefill_block_ids, num_tokens, plan.prefill.block_size, "prefill")
    d_ids = check_block_ids(decode_block_ids, num_tokens, plan.decode.block_size, "decode")
    out = []
    for read in plan.reads_for(decode_rank):
        p = plan.prefill_workers[read.prefill_rank]
        d = plan.decode_workers[read.decode_rank]
        pairs = np.array(
            [
                (region_index(model, p, layer, kv), region_index(model, d, layer, kv))
                for layer in range(*read.layers)
                for kv in range(model.num_kv_tensors)
            ],
            dtype=np.int64,
        ).reshape(-1, 2)
        src, dst, lengths = _pieces(model, plan, read, p_ids, d_ids, num_tokens)
        unmerged = len(src)
        src, dst, lengths = merge_runs(src, dst, lengths)
        out.append(
            CopyList(
                read,
                pairs[:, 0].copy(),
                pairs[:, 1].copy(),
                src,
                dst,
                lengths,
                unmerged * len(pairs),
            )
        )
    return out
