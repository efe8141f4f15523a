"""Copy lists: exact bytes, maximal merging, validation, and a verifier that catches bugs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvbridge.errors import LayoutError
from kvbridge.plan.copylist import copy_lists, merge_runs
from kvbridge.plan.geometry import from_hf_config, load_model_spec
from kvbridge.plan.layout import InstanceLayout, num_regions, region_nbytes
from kvbridge.plan.planner import make_plan
from kvbridge.plan.verifier import (
    RequestSpan,
    VerificationError,
    _first_mismatch,
    apply_copy_lists,
    count_contiguous_runs,
    expected_decode_cache,
    fill_worker_cache,
    region_bytes,
    verify_plan,
)
from tests.plan.helpers import READ_ENDS

LLAMA = load_model_spec("llama-3.2-1b")


SMOL = load_model_spec("smollm2-135m")


@pytest.mark.parametrize(
    "model, p_tp, d_tp",
    [(LLAMA, 2, 4), (LLAMA, 8, 16), (LLAMA, 16, 2), (SMOL, 3, 9), (SMOL, 9, 3), (SMOL, 1, 3)],
)
def test_cross_layer_layout_reads_one_run_per_block_and_source(model, p_tp, d_tp):
    """BHLNC on both sides, same layer split: a read's heads of one block are one run over
    all layers and K/V, whatever the TP pair (replicated heads included)."""
    plan = make_plan(model, InstanceLayout(p_tp), InstanceLayout(d_tp))
    assert plan.prefill.cache_layout.name == "BHLNC"  # the default
    rng = np.random.default_rng(0)
    p_ids, d_ids = rng.permutation(40)[:9], rng.permutation(40)[:9]
    for d in plan.decode_workers:
        lists = copy_lists(plan, d.rank, p_ids, d_ids, 9 * 16)
        for cl in lists:
            assert cl.num_descriptors == 9
            assert set(cl.lengths) == {16 * cl.read.bytes_per_token}


def test_cross_layer_layout_with_a_pp_split_reads_one_run_per_head_and_block():
    plan = make_plan(LLAMA, InstanceLayout(2, pp_size=2), InstanceLayout(4))
    (first, second) = copy_lists(plan, 1, [3, 5], [0, 4], 32)
    for cl in (first, second):
        assert cl.read.num_heads == 2 and cl.num_descriptors == 2 * 2  # heads x blocks
        assert cl.nbytes == 32 * cl.read.bytes_per_token


def test_per_layer_layout_merges_contiguous_blocks_to_one_run_per_region():
    # one local head per worker: LBHNC and LBNHC regions are a plain token array
    for layout in ("LBHNC", "LBNHC"):
        plan = make_plan(
            LLAMA, InstanceLayout(8, cache_layout=layout), InstanceLayout(16, cache_layout=layout)
        )
        (cl,) = copy_lists(plan, 3, np.arange(10), np.arange(10), 160)
        assert cl.num_descriptors == 16 * 2  # layers x K/V regions
        assert set(cl.lengths) == {160 * 64 * 2}
        assert cl.num_unmerged == 10 * 32


def test_nhd_token_rows_merge_only_when_whole():
    # prefill tp 2 (4 heads local) -> decode tp 4 (2 heads): a token's 2 heads are a run of
    # 2 rows on both sides, but the prefill row holds 4 heads, so tokens never merge
    plan = make_plan(
        LLAMA, InstanceLayout(2, cache_layout="NHD"), InstanceLayout(4, cache_layout="NHD")
    )
    (cl,) = copy_lists(plan, 1, np.arange(4), np.arange(4), 64)
    assert cl.num_descriptors == 64 * 32 and set(cl.lengths) == {2 * 64 * 2}
    # equal tp: whole rows on both sides, contiguous blocks -> one run per region
    plan = make_plan(
        LLAMA, InstanceLayout(4, cache_layout="NHD"), InstanceLayout(4, cache_layout="NHD")
    )
    (cl,) = copy_lists(plan, 1, np.arange(4), np.arange(4), 64)
    assert cl.num_descriptors == 32


def test_block_size_change_cuts_at_both_boundaries():
    plan = make_plan(
        LLAMA,
        InstanceLayout(8, block_size=16, cache_layout="HND"),
        InstanceLayout(8, block_size=24, cache_layout="HND"),
    )
    p_ids, d_ids = np.array([5, 2, 9]), np.array([3, 0])
    (cl,) = copy_lists(plan, 0, p_ids, d_ids, 40)
    # token cuts at 0, 16, 24, 32 -> four pieces per region, none contiguous with the next
    assert cl.num_unmerged == cl.num_descriptors == 4 * 32
    # tokens 16-24 and 24-32 are adjacent in prefill block 2 but not in the decode blocks
    assert sorted(cl.lengths[cl.src_regions == 0] // 128) == [8, 8, 8, 16]


@pytest.mark.parametrize("seed", range(12))
def test_merged_count_is_number_of_contiguous_runs(seed):
    rng = np.random.default_rng(seed)
    model = from_hf_config(
        {
            "num_hidden_layers": 3,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 8,
            "torch_dtype": "float16",
        }
    )
    tps = [1, 2, 4, 8]

    def layout() -> InstanceLayout:
        order = "".join(rng.permutation(list("BLKHN"))) + "C"
        return InstanceLayout(
            int(rng.choice(tps)),
            pp_size=int(rng.choice([1, 1, 2, 3])),
            block_size=int(rng.choice([1, 2, 4, 8, 16])),
            cache_layout=order,
        )

    p, d = layout(), layout()
    plan = make_plan(model, p, d)
    tokens = int(rng.integers(1, 60))
    contiguous = rng.random() < 0.5
    p_need, d_need = -(-tokens // p.block_size), -(-tokens // d.block_size)
    p_ids = np.arange(p_need) + 2 if contiguous else rng.permutation(p_need + 3)[:p_need]
    d_ids = np.arange(d_need) if contiguous else rng.permutation(d_need + 3)[:d_need]
    for dw in plan.decode_workers:
        for cl in copy_lists(plan, dw.rank, p_ids, d_ids, tokens):
            assert cl.num_descriptors == count_contiguous_runs(cl, model.head_bytes)
            assert cl.nbytes == tokens * cl.read.bytes_per_token


def test_merge_runs_sorts_then_joins_within_regions():
    regs = merge_runs(
        np.array([0, 0, 0, 0, 1]),
        np.array([8, 0, 4, 20, 24]),
        np.array([0, 0, 0, 0, 0]),
        np.array([108, 100, 104, 50, 54]),
        np.array([4, 4, 4, 4, 4]),
    )
    s_reg, src, d_reg, dst, n = regs
    assert list(d_reg) == [0, 0, 0]
    # the last run continues the fourth on the destination, but not in the same source region
    assert list(s_reg) == [0, 0, 1] and list(src) == [0, 20, 24]
    assert list(dst) == [100, 50, 54] and list(n) == [12, 4, 4]


def test_addresses_offset_each_region_base():
    plan = make_plan(LLAMA, InstanceLayout(8, cache_layout="HND"), InstanceLayout(8))
    (cl,) = copy_lists(plan, 0, [1], [0], 3)
    p = plan.prefill_workers[0]
    assert num_regions(LLAMA, plan.prefill, p) == 32 and num_regions(LLAMA, plan.decode, p) == 1
    p_size = region_nbytes(LLAMA, plan.prefill, p, 4)
    src_bases = 1_000_000 + p_size * np.arange(32)
    src, dst, lengths = cl.addresses(src_bases, np.array([9_000_000]))
    assert len(src) == cl.num_descriptors == 32  # a run per prefill region
    order = np.argsort(src)
    assert src[order][1] - src[order][0] == p_size and set(lengths) == {3 * 128}
    assert src[order][0] == 1_000_000 + 16 * 128  # block 1 of region 0
    assert dst.min() == 9_000_000  # decode block 0: every layer of it is one region


@pytest.mark.parametrize(
    "p_ids, d_ids, tokens, words",
    [
        (
            [0],
            [0, 1],
            20,
            "prefill_block_ids has 1 blocks but num_tokens=20 at block_size=16 needs 2",
        ),
        ([0, 0], [0, 1], 20, "prefill_block_ids repeats a block id"),
        ([0, 1], [-1, 1], 20, "decode_block_ids contains -1"),
        ([0, 1], [0, 1], 0, "num_tokens=0 must be a positive integer"),
    ],
)
def test_block_id_errors(p_ids, d_ids, tokens, words):
    plan = make_plan(LLAMA, InstanceLayout(2), InstanceLayout(4))
    with pytest.raises(LayoutError, match=words):
        copy_lists(plan, 0, p_ids, d_ids, tokens)


def _run(plan, lists_for, tokens=20):
    """Fill, copy with the given lists, and compare decode worker 0 with its expectation."""
    m = plan.model
    p_req, d_req = RequestSpan(np.array([3, 1]), tokens), RequestSpan(np.array([0, 2]), tokens)
    p_caches = [
        region_bytes(
            fill_worker_cache(m, plan.prefill, w, 4, [p_req], salt=w.rank),
            num_regions(m, plan.prefill, w),
        )
        for w in plan.prefill_workers
    ]
    d = plan.decode_workers[0]
    initial = fill_worker_cache(m, plan.decode, d, 4, [], salt=99)
    cache = initial.copy()
    for cl in lists_for(plan, p_req, d_req):
        apply_copy_lists(
            p_caches[cl.read.prefill_rank],
            region_bytes(cache, num_regions(m, plan.decode, d)),
            [cl],
        )
    want = expected_decode_cache(m, plan.decode, d, initial, [d_req])
    return np.array_equal(cache, want)


@pytest.mark.parametrize("layouts", [("HND", "NHD"), ("BHLNC", "LBHNC"), ("BLNHC", "BHLNC")])
def test_verifier_catches_wrong_offset_region_and_worker(layouts):
    plan = make_plan(
        LLAMA,
        InstanceLayout(4, cache_layout=layouts[0]),
        InstanceLayout(8, cache_layout=layouts[1]),
    )

    def good(plan, p_req, d_req):
        return copy_lists(plan, 0, p_req.block_ids, d_req.block_ids, 20)

    def shifted(plan, p_req, d_req):
        (cl,) = good(plan, p_req, d_req)
        return [dataclasses.replace(cl, src_offsets=cl.src_offsets + 128)]

    def wrong_region(plan, p_req, d_req):
        (cl,) = good(plan, p_req, d_req)
        n = num_regions(plan.model, plan.decode, plan.decode_workers[0])
        return [dataclasses.replace(cl, dst_regions=(cl.dst_regions + 1) % n)]

    def wrong_worker(plan, p_req, d_req):
        (cl,) = good(plan, p_req, d_req)
        return [dataclasses.replace(cl, read=dataclasses.replace(cl.read, prefill_rank=1))]

    assert _run(plan, good)
    assert not _run(plan, shifted)
    assert not _run(plan, wrong_worker)
    if num_regions(plan.model, plan.decode, plan.decode_workers[0]) > 1:
        assert not _run(plan, wrong_region)


def test_apply_refuses_runs_past_the_region():
    plan = make_plan(LLAMA, InstanceLayout(4), InstanceLayout(4))
    (cl,) = copy_lists(plan, 0, [7], [0], 4)  # block 7 does not exist in a 4-block cache
    m = plan.model
    w = plan.prefill_workers[0]
    src = region_bytes(fill_worker_cache(m, plan.prefill, w, 4, [], salt=1), 1)
    with pytest.raises(VerificationError, match="past the"):
        apply_copy_lists(src, src.copy(), [cl])


def test_a_first_copy_list_imports_nothing():
    """A decode worker's first request must not pay a lazy import (numpy.ma, on the
    first np.unique, took over a second with nine workers starting at once)."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np\n"
        "from kvbridge.plan.copylist import copy_lists\n"
        "from kvbridge.plan.geometry import AttentionKind, ModelKVSpec\n"
        "from kvbridge.plan.layout import InstanceLayout, num_regions, region_nbytes\n"
        "from kvbridge.plan.planner import make_plan\n"
        "m = ModelKVSpec(30, 9, 3, 64, 'float32', AttentionKind.GQA, 'm')\n"
        "plan = make_plan(m, InstanceLayout(tp_size=3), InstanceLayout(tp_size=9))\n"
        "before = set(sys.modules)\n"
        "for rank in range(9):\n"
        "    for cl in copy_lists(plan, rank, np.array([5, 1]), np.array([0, 7]), 20):\n"
        "        assert cl.nbytes > 0\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("blocks", [(16, 32), (32, 16), (16, 24)])
@pytest.mark.parametrize("layouts", [("BHLNC", "LBNHC"), ("LBHNC", "BHLNC")])
def test_partial_pulls_are_byte_exact_at_every_start(blocks, layouts):
    """Tokens [start, T) only, start anywhere inside a block on either side; the decode
    worker's tokens before start stay as they were (the verifier checks every byte)."""
    model = from_hf_config(
        {
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 4,
            "torch_dtype": "float16",
        }
    )
    plan = make_plan(
        model,
        InstanceLayout(2, block_size=blocks[0], cache_layout=layouts[0]),
        InstanceLayout(1, block_size=blocks[1], cache_layout=layouts[1]),
    )
    tokens = 70
    for start in range(tokens):
        report = verify_plan(plan, tokens, seed=start, start_token=start)
        assert report.bytes_copied == (tokens - start) * plan.bytes_per_token


def test_a_partial_pull_takes_the_blocks_from_its_first_token_on():
    plan = make_plan(LLAMA, InstanceLayout(8, block_size=16), InstanceLayout(8, block_size=32))
    # tokens [40, 70): prefill blocks 2..4 (of 16), decode blocks 1..2 (of 32)
    (cl,) = copy_lists(plan, 0, [7, 3, 9], [5, 2], 70, start_token=40)
    assert cl.nbytes == 30 * cl.read.bytes_per_token
    with pytest.raises(LayoutError, match=r"prefill_block_ids has 2 blocks but tokens \[40, 70\)"):
        copy_lists(plan, 0, [7, 3], [5, 2], 70, start_token=40)
    with pytest.raises(LayoutError, match=r"start_token=70 must be in \[0, num_tokens=70\)"):
        copy_lists(plan, 0, [7, 3, 9], [5, 2], 70, start_token=70)


def test_the_verifier_sees_a_pull_that_overwrites_tokens_before_its_start():
    plan = make_plan(LLAMA, InstanceLayout(8), InstanceLayout(8))
    m, d = plan.model, plan.decode_workers[0]
    p_req, d_req = RequestSpan(np.array([3, 1]), 20), RequestSpan(np.array([0, 2]), 20)
    src = fill_worker_cache(m, plan.prefill, plan.prefill_workers[0], 4, [p_req], salt=1)
    initial = fill_worker_cache(m, plan.decode, d, 4, [], salt=2)
    cache = initial.copy()
    (cl,) = copy_lists(plan, 0, p_req.block_ids, d_req.block_ids, 20)  # all 20 tokens
    apply_copy_lists(region_bytes(src, 1), region_bytes(cache, 1), [cl])
    partial = RequestSpan(d_req.block_ids, 20, start_token=10)  # but only [10, 20) was asked
    assert not np.array_equal(cache, expected_decode_cache(m, plan.decode, d, initial, [partial]))
    assert np.array_equal(cache, expected_decode_cache(m, plan.decode, d, initial, [d_req]))


CPU = "LBHKNC:K=CN"  # vLLM's CPU page: K [channel][token], V [token][channel]
SMOL_F32 = SMOL.with_dtype("float32")


def test_a_channel_major_k_half_is_cut_into_channel_rows_across_block_sizes():
    """vLLM CPU pages, prefill block 64 -> decode block 32, one worker each: per
    32-token segment, head and layer, K moves as one run per channel (32 tokens of it,
    not contiguous across channels on the 64-token side) and V as one run of 32 rows."""
    plan = make_plan(
        SMOL_F32,
        InstanceLayout(1, block_size=64, cache_layout=CPU),
        InstanceLayout(1, block_size=32, cache_layout=CPU),
    )
    (cl,) = copy_lists(plan, 0, [5, 2], [9, 0, 4], 96)  # 3 segments of 32 tokens
    heads, layers, hd = 3, SMOL.num_layers, SMOL.head_dim
    k_runs = 3 * heads * layers * hd
    v_runs = 3 * heads * layers
    assert cl.num_unmerged == cl.num_descriptors == k_runs + v_runs
    assert sorted(set(cl.lengths.tolist())) == [32 * 4, 32 * hd * 4]
    assert int((cl.lengths == 32 * 4).sum()) == k_runs
    assert cl.nbytes == 96 * plan.bytes_per_token
    assert cl.num_descriptors == count_contiguous_runs(cl, 4)
    verify_plan(plan, 96)
    verify_plan(plan, 77, start_token=40)  # inside a block on both sides, a partial last


def test_equal_block_sizes_move_channel_major_pages_whole():
    """The same pages at equal block sizes: a whole page (K and V of one head and block)
    is one run, and whole blocks of a per-layer region merge as before."""
    plan = make_plan(
        SMOL_F32,
        InstanceLayout(1, block_size=32, cache_layout=CPU),
        InstanceLayout(3, block_size=32, cache_layout=CPU),
    )
    (cl,) = copy_lists(plan, 1, [5, 2], [9, 0], 64)
    assert set(cl.lengths.tolist()) == {2 * 32 * SMOL.head_dim * 4}  # K and V: one page
    assert cl.num_descriptors == 2 * SMOL.num_layers
    verify_plan(plan, 50, start_token=7)


def test_a_channel_major_half_into_a_token_major_one_is_transposed_element_by_element():
    plan = make_plan(
        SMOL_F32,
        InstanceLayout(1, block_size=32, cache_layout=CPU),
        InstanceLayout(1, block_size=32, cache_layout="LBHKNC"),
    )
    (cl,) = copy_lists(plan, 0, [1], [0], 32)
    pages = 3 * SMOL.num_layers  # (head, layer) pages of one block
    # before merging, K: one element per run; V: its whole half
    assert cl.num_unmerged == pages * (32 * SMOL.head_dim + 1)
    # merged: only where a K half's last element meets the next V half (or a V half the
    # next head's K) on both sides
    assert cl.num_descriptors == count_contiguous_runs(cl, 4) > pages * 32 * SMOL.head_dim - pages
    verify_plan(plan, 32)


def test_the_verifier_sees_a_channel_major_half_moved_as_token_major():
    """Pages planned as if K were token-major land transposed: caught, and named."""
    right = make_plan(
        SMOL_F32,
        InstanceLayout(1, block_size=64, cache_layout=CPU),
        InstanceLayout(1, block_size=32, cache_layout=CPU),
    )
    naive = make_plan(
        SMOL_F32,
        InstanceLayout(1, block_size=64, cache_layout="LBHKNC"),
        InstanceLayout(1, block_size=32, cache_layout="LBHKNC"),
    )
    m = right.model
    p_req, d_req = RequestSpan(np.array([3, 1]), 80), RequestSpan(np.array([0, 2, 3]), 80)
    src = fill_worker_cache(m, right.prefill, right.prefill_workers[0], 4, [p_req], salt=1)
    d = right.decode_workers[0]
    initial = fill_worker_cache(m, right.decode, d, 4, [], salt=2)
    want = expected_decode_cache(m, right.decode, d, initial, [d_req])
    for plan, ok in ((right, True), (naive, False)):
        cache = initial.copy()
        lists = copy_lists(plan, 0, p_req.block_ids, d_req.block_ids, 80)
        apply_copy_lists(region_bytes(src, m.num_layers), region_bytes(cache, m.num_layers), lists)
        assert np.array_equal(cache, want) == ok
    # the verifier's words for a decode side that never got the request: its first
    # wrong element named by layer, K/V, head, block, slot and channel (not by offset)
    first = _first_mismatch(m, right.decode, d, initial, want)
    assert "elements wrong, first at layer 0 K head 0 block 0 slot 0 element 0" in first


@pytest.mark.parametrize("layout", [CPU, "BHLNC", "LBNHC"])
def test_a_partial_last_block_read_to_its_end_costs_the_descriptors_of_a_full_one(layout):
    """vLLM's CPU pages, SmolLM2 tp 1 -> tp 1 at block 32, a 208-token prompt (6 full
    blocks and 16 tokens): read to `read_end` (224) its last page moves whole, so the
    pull takes exactly the descriptors of a 7-block prompt; cut at its last token, K's
    channel-major half of the last block is a run per channel, head and layer."""
    lay = InstanceLayout(1, block_size=32, cache_layout=layout)
    plan = make_plan(SMOL_F32, lay, lay)
    assert plan.read_end(208) == 224
    p_ids, d_ids = [11, 3, 17, 5, 9, 1, 13], [4, 20, 2, 8, 14, 6, 0]  # no two adjacent
    (whole,) = copy_lists(plan, 0, p_ids, d_ids, 224)
    (read,) = copy_lists(plan, 0, p_ids, d_ids, plan.read_end(208))
    (cut,) = copy_lists(plan, 0, p_ids, d_ids, 208)
    assert read.num_descriptors == whole.num_descriptors
    if layout == CPU:  # a run per (block, layer): K and V of its 3 heads are one page each
        assert read.num_descriptors == 7 * SMOL.num_layers
        assert cut.num_descriptors == 6 * SMOL.num_layers + SMOL.num_layers * 3 * (
            SMOL.head_dim + 1
        )


@pytest.mark.parametrize("bp, bd, n, end", READ_ENDS)
def test_read_end_stops_where_the_first_sides_last_block_ends(bp, bd, n, end):
    """min(ceil(n/bp)*bp, ceil(n/bd)*bd): never a block more on either side, the prompt's
    last block whole on the side whose block ends first (partly whole on the other)."""
    plan = make_plan(SMOL, InstanceLayout(1, block_size=bp), InstanceLayout(1, block_size=bd))
    assert plan.read_end(n) == end
    for b in (bp, bd):
        assert -(-end // b) == -(-n // b)  # the same blocks hold it on both sides
    (cl,) = copy_lists(plan, 0, np.arange(-(-n // bp)), np.arange(-(-n // bd)), end)
    assert cl.nbytes == end * cl.read.bytes_per_token
    verify_plan(plan, end)  # the runs to `end` are byte-exact
