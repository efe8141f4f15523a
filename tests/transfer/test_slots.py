"""A pull reads its prompt's last block whole (`TransferPlan.read_end`): the producer
zeroes that block's slots past the last token (`token_slots`, `clear_slots`) as it
exposes them, and the reader zeroes its own copy of them once the bytes are in (a READ
may race the expose), so the decode holds this request's KV and zeros there, never the
bytes another request left in them. On numpy caches in real layouts (vLLM's CPU pages with a
channel-major K half, cross-layer, per layer, MLA); tests/transfer/test_transfers.py
moves the same with real NIXL agents."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.plan.copylist import copy_lists
from kvbridge.plan.geometry import AttentionKind, ModelKVSpec, load_model_spec
from kvbridge.plan.layout import InstanceLayout, num_regions
from kvbridge.plan.planner import make_plan
from kvbridge.plan.slots import token_slots
from kvbridge.plan.verifier import (
    RequestSpan,
    apply_copy_lists,
    expected_decode_cache,
    fill_worker_cache,
    region_bytes,
)
from kvbridge.transfer.regions import (
    CacheRegions,
    MemType,
    clear_slots,
    read_end,
    tail_slots,
)
from tests.plan.helpers import READ_ENDS

SMOL = load_model_spec("smollm2-135m")
MLA = ModelKVSpec(3, 4, 1, 24, "bfloat16", AttentionKind.MLA, "mla")
LAYOUTS = ["LBHKNC:K=CN", "BHLNC", "LBNHC", "LBHNC"]


def lay(tp: int, layout: str, block_size: int) -> InstanceLayout:
    return InstanceLayout(tp_size=tp, block_size=block_size, cache_layout=layout)


@pytest.mark.parametrize("model", [SMOL, MLA], ids=["smollm2", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("first", [1, 13, 31])
def test_clearing_a_blocks_tail_zeroes_exactly_those_slots(model, layout, first):
    """Every element of slots [first, 32) of the one block, in every layer, head and
    K/V half, becomes 0; every other byte of the cache stays."""
    lay_ = lay(1, layout, 32)
    shard = lay_.workers(model)[0]
    ids = np.array([4, 1, 6])
    n = 2 * 32 + first  # the last block, 6, holds [64, n)
    cache = fill_worker_cache(model, lay_, shard, 8, [RequestSpan(ids, n, 7)], salt=11)
    want = fill_worker_cache(model, lay_, shard, 8, [RequestSpan(ids, n, 7, read_end=96)], 11)
    assert not np.array_equal(cache, want)  # the tail held bytes of no request
    regions = CacheRegions.from_array(cache, num_regions(model, lay_, shard))
    clear_slots(regions, token_slots(model, lay_, shard, 6, first, 32))
    assert np.array_equal(cache, want)


def test_only_host_memory_into_host_memory_without_a_cast_is_read_past_the_last_token():
    plan = make_plan(SMOL, lay(1, "BHLNC", 32), lay(1, "BHLNC", 32))
    assert read_end(plan, 208, MemType.DRAM, MemType.DRAM) == 224
    assert read_end(plan, 208, MemType.VRAM, MemType.DRAM) == 208
    assert read_end(plan, 208, MemType.DRAM, MemType.VRAM) == 208
    f32 = InstanceLayout(block_size=32, cache_layout="BHLNC", dtype="float32")
    to_f32 = make_plan(SMOL, lay(1, "BHLNC", 32), f32)
    assert to_f32.cast is not None and read_end(to_f32, 208, MemType.DRAM, MemType.DRAM) == 208
    vram = CacheRegions((1 << 20,), (4096,), MemType.VRAM)
    with pytest.raises(Exception, match="cannot clear slots of a VRAM cache"):
        clear_slots(vram, [])


@pytest.mark.parametrize("layout", ["LBHKNC:K=CN", "BHLNC"])
def test_a_read_that_raced_the_expose_is_zeroed_by_its_reader(layout):
    """The READ came before the producer cleared its tail (the capability reached the
    decode before the prefill worker took its expose order): the decode worker read the
    bytes another request left there, and zeroes its own slots past the prompt
    (`tail_slots`) before it reports the pull done."""
    p_lay, d_lay = lay(1, layout, 32), lay(3, layout, 16)
    plan = make_plan(SMOL, p_lay, d_lay)
    n, end = 40, plan.read_end(40)
    assert end == 48
    p_ids, d_ids = np.array([5, 2]), np.array([7, 0, 3])
    p = plan.prefill_workers[0]
    src = fill_worker_cache(SMOL, p_lay, p, 8, [RequestSpan(p_ids, n, 5)], salt=1)  # not cleared
    for d in plan.decode_workers:
        initial = fill_worker_cache(SMOL, d_lay, d, 8, [], salt=100 + d.rank)
        got = initial.copy()
        apply_copy_lists(
            region_bytes(src, num_regions(SMOL, p_lay, p)),
            region_bytes(got, num_regions(SMOL, d_lay, d)),
            copy_lists(plan, d.rank, p_ids, d_ids, end),
        )
        want = expected_decode_cache(
            SMOL, d_lay, d, initial, [RequestSpan(d_ids, n, 5, read_end=end)]
        )
        assert not np.array_equal(got, want)  # the other request's bytes came along
        regions = CacheRegions.from_array(got, num_regions(SMOL, d_lay, d))
        clear_slots(regions, tail_slots(SMOL, d_lay, d, d_ids, 0, n, end))
        assert np.array_equal(got, want), f"decode rank {d.rank}"


@pytest.mark.parametrize("bp, bd, n, end", READ_ENDS)
@pytest.mark.parametrize("layout", ["LBHKNC:K=CN", "BHLNC"])
@pytest.mark.parametrize("start", [0, 32])
def test_a_pull_read_to_the_end_of_its_last_block_is_byte_exact(bp, bd, n, end, layout, start):
    """Prefill tail slots hold other bytes, the producer clears them, the reader reads to
    `read_end`: the decode holds the prompt's KV in [start, n), zeros in [n, end), and
    every other byte as it was (its earlier tokens, other blocks, slots past `end`)."""
    p_lay, d_lay = lay(1, layout, bp), lay(3, layout, bd)
    plan = make_plan(SMOL, p_lay, d_lay)
    assert plan.read_end(n) == end
    rng = np.random.default_rng(n + bp)
    p_ids = rng.permutation(12)[: -(-n // bp)]
    d_ids = rng.permutation(20)[: -(-n // bd)]
    p = plan.prefill_workers[0]
    src = fill_worker_cache(SMOL, p_lay, p, 12, [RequestSpan(p_ids, n, 5)], salt=1)
    regions = CacheRegions.from_array(src, num_regions(SMOL, p_lay, p))
    if n % bp:
        clear_slots(regions, token_slots(SMOL, p_lay, p, int(p_ids[-1]), n % bp, bp))
    for d in plan.decode_workers:
        initial = fill_worker_cache(SMOL, d_lay, d, 20, [], salt=100 + d.rank)
        got = initial.copy()
        lists = copy_lists(plan, d.rank, p_ids[start // bp :], d_ids[start // bd :], end, start)
        apply_copy_lists(
            region_bytes(src, regions.num_regions),
            region_bytes(got, num_regions(SMOL, d_lay, d)),
            lists,
        )
        want = expected_decode_cache(
            SMOL, d_lay, d, initial, [RequestSpan(d_ids, n, 5, start, read_end=end)]
        )
        assert np.array_equal(got, want), f"decode rank {d.rank}"
