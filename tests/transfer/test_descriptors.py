"""Copy lists -> prepared descriptor lists + index arrays move exactly the planned bytes.

The reference is the planner's own `apply_copy_lists`; here every (remote unit, local
unit) pair is executed on byte arrays the way NIXL executes a prepared READ.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.plan.copylist import copy_lists
from kvbridge.plan.geometry import AttentionKind, ModelKVSpec
from kvbridge.plan.layout import InstanceLayout, num_regions, region_nbytes
from kvbridge.plan.planner import make_plan
from kvbridge.plan.verifier import apply_copy_lists
from kvbridge.transfer.descriptors import exact_descs, unit_descs, unit_indices, unit_size
from kvbridge.transfer.regions import CacheRegions

GQA = ModelKVSpec(4, 8, 4, 8, "float16", AttentionKind.GQA, "gqa")
H3 = ModelKVSpec(2, 9, 3, 4, "float32", AttentionKind.GQA, "h3")
MLA = ModelKVSpec(3, 4, 1, 12, "bfloat16", AttentionKind.MLA, "mla")

CASES = [
    (GQA, InstanceLayout(tp_size=2), InstanceLayout(tp_size=4), 37),
    (
        GQA,
        InstanceLayout(tp_size=1, cache_layout="NHD"),
        InstanceLayout(tp_size=2, block_size=32),
        70,
    ),
    (
        GQA,
        InstanceLayout(tp_size=4, block_size=32),
        InstanceLayout(tp_size=1, block_size=16, cache_layout="NHD"),
        45,
    ),
    (H3, InstanceLayout(tp_size=3), InstanceLayout(tp_size=9), 20),
    (H3, InstanceLayout(tp_size=9), InstanceLayout(tp_size=1), 33),
    (GQA, InstanceLayout(tp_size=1, pp_size=2), InstanceLayout(tp_size=2, pp_size=1), 16),
    (MLA, InstanceLayout(tp_size=2), InstanceLayout(tp_size=1), 19),
    (H3, InstanceLayout(tp_size=3), InstanceLayout(tp_size=9, cache_layout="LBNHC"), 21),
    (GQA, InstanceLayout(tp_size=2, cache_layout="HND"), InstanceLayout(tp_size=4), 40),
    (
        GQA,
        InstanceLayout(tp_size=2, pp_size=2, block_size=32),
        InstanceLayout(tp_size=1, cache_layout="BLHNC"),
        50,
    ),
    (MLA, InstanceLayout(tp_size=2, cache_layout="BLNHC"), InstanceLayout(tp_size=4), 23),
]


def caches(
    model: ModelKVSpec, layout: InstanceLayout, rank: int, num_blocks: int, rng: np.random.Generator
) -> tuple[np.ndarray, CacheRegions]:
    shard = layout.workers(model)[rank]
    n, size = num_regions(model, layout, shard), region_nbytes(model, layout, shard, num_blocks)
    arr = rng.integers(0, 255, size=(n, size), dtype=np.uint8)
    return arr, CacheRegions.from_array(arr, n)


@pytest.mark.parametrize(("model", "prefill", "decode", "tokens"), CASES)
def test_unit_and_exact_descriptors_move_the_planned_bytes(model, prefill, decode, tokens) -> None:
    rng = np.random.default_rng(tokens)
    plan = make_plan(model, prefill, decode)
    nb = 2 * (-(-tokens // 16)) + 3
    p_ids = rng.permutation(nb)[: -(-tokens // prefill.block_size)]
    d_ids = rng.permutation(nb)[: -(-tokens // decode.block_size)]
    src = {w.rank: caches(model, prefill, w.rank, nb, rng) for w in plan.prefill_workers}
    for d in plan.decode_workers:
        dst, dst_regions = caches(model, decode, d.rank, nb, rng)
        want, by_units, by_exact = dst.copy(), dst.copy(), dst.copy()
        for cl in copy_lists(plan, d.rank, p_ids, d_ids, tokens):
            s, s_regions = src[cl.read.prefill_rank]
            apply_copy_lists(s, want, [cl])
            # prepared lists of g-byte units; a READ copies unit remote_idx[i] -> local_idx[i]
            g = unit_size(cl, s_regions.lengths, dst_regions.lengths)
            ridx, lidx = unit_indices(cl, g, s_regions, dst_regions)
            remote, local = unit_descs(s_regions, g), unit_descs(dst_regions, g)
            assert len(ridx) * g == cl.nbytes
            src_units = s.reshape(
                -1, g
            )  # the regions are adjacent here: unit u = bytes [u*g, u*g+g)
            by_units.reshape(-1, g)[lidx] = src_units[ridx]
            assert (remote[ridx, 0] - s.ctypes.data == ridx.astype(np.uint64) * g).all()
            assert (local[:, 1] == g).all()
            # per-request exact descriptors: (address, length) pairs of the merged runs
            rd, ld = exact_descs(cl, s_regions, dst_regions)
            assert len(rd) == cl.num_descriptors and int(rd[:, 1].sum()) == cl.nbytes
            flat_src, flat_dst = s.reshape(-1), by_exact.reshape(-1)
            for (ra, n, _), (la, _, _) in zip(rd, ld, strict=True):
                ro, lo = (
                    int(ra) - s.ctypes.data,
                    int(la) - dst.ctypes.data,
                )  # dst_regions point at dst
                flat_dst[lo : lo + int(n)] = flat_src[ro : ro + int(n)]
        assert np.array_equal(by_units, want), f"decode rank {d.rank} (units)"
        assert np.array_equal(by_exact, want), f"decode rank {d.rank} (exact)"


def test_cma_floor_reads_every_byte_of_the_runs() -> None:
    from kvbridge.bench.cma_floor import measure

    floor = measure(run_bytes=4096, num_runs=2500, repeat=1)
    assert floor is not None, "process_vm_readv of a child process failed on Linux"
    assert (floor.run_bytes, floor.num_runs) == (4096, 2500)
    assert floor.scattered_s > 0 and floor.contiguous_s > 0
    assert floor.ratio == floor.contiguous_s / floor.scattered_s
    # the same bytes from shared memory, as a KV export process maps them (the measure
    # checks every byte came from the child)
    assert floor.shared_s is not None and floor.shared_s > 0
    assert floor.shared_ratio == floor.shared_s / floor.contiguous_s
