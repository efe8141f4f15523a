"""Copy lists: exact bytes, maximal merging, validation, and a verifier that catches bugs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvbridge.errors import LayoutError
from kvbridge.plan.copylist import copy_lists, merge_runs, region_nbytes
from kvbridge.plan.geometry import from_hf_config, load_model_spec
from kvbridge.plan.layout import InstanceLayout
from kvbridge.plan.planner import make_plan
from kvbridge.plan.verifier import (
    RequestSpan,
    VerificationError,
    apply_copy_lists,
    count_contiguous_runs,
    expected_decode_cache,
    fill_worker_cache,
)

LLAMA = load_model_spec("llama-3.2-1b")


def test_contiguous_blocks_merge_to_one_run_per_region():
    # one local head per worker: HND and NHD regions are a plain token array
    for layout in ("HND", "NHD"):
        plan = make_plan(
            LLAMA, InstanceLayout(8, cache_layout=layout), InstanceLayout(16, cache_layout=layout)
        )
        (cl,) = copy_lists(plan, 3, np.arange(10), np.arange(10), 160)
        assert cl.num_region_pairs == 16 * 2
        assert len(cl.lengths) == 1 and cl.lengths[0] == 160 * 64 * 2
        assert cl.num_unmerged == 10 * 32


def test_nhd_token_rows_merge_only_when_whole():
    # prefill tp 2 (4 heads local) -> decode tp 4 (2 heads): a token's 2 heads are a run of
    # 2 rows on both sides, but the prefill row holds 4 heads, so tokens never merge
    plan = make_plan(
        LLAMA, InstanceLayout(2, cache_layout="NHD"), InstanceLayout(4, cache_layout="NHD")
    )
    (cl,) = copy_lists(plan, 1, np.arange(4), np.arange(4), 64)
    assert len(cl.lengths) == 64 and set(cl.lengths) == {2 * 64 * 2}
    # equal tp: whole rows on both sides, contiguous blocks -> one run
    plan = make_plan(
        LLAMA, InstanceLayout(4, cache_layout="NHD"), InstanceLayout(4, cache_layout="NHD")
    )
    (cl,) = copy_lists(plan, 1, np.arange(4), np.arange(4), 64)
    assert len(cl.lengths) == 1


def test_block_size_change_cuts_at_both_boundaries():
    plan = make_plan(LLAMA, InstanceLayout(8, block_size=16), InstanceLayout(8, block_size=24))
    p_ids, d_ids = np.array([5, 2, 9]), np.array([3, 0])
    (cl,) = copy_lists(plan, 0, p_ids, d_ids, 40)
    # token cuts at 0, 16, 24, 32 -> four pieces, none contiguous with the next
    assert cl.num_unmerged == 4 * cl.num_region_pairs
    # tokens 16-24 and 24-32 are adjacent in prefill block 2 but not in the decode blocks
    assert sorted(cl.lengths // 128) == [8, 8, 8, 16] and cl.num_descriptors == 4 * 32


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
    p = InstanceLayout(
        int(rng.choice(tps)),
        block_size=int(rng.choice([1, 2, 4, 8, 16])),
        cache_layout=str(rng.choice(["HND", "NHD"])),
    )
    d = InstanceLayout(
        int(rng.choice(tps)),
        block_size=int(rng.choice([1, 2, 4, 8, 16])),
        cache_layout=str(rng.choice(["HND", "NHD"])),
    )
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


def test_merge_runs_sorts_then_joins():
    src, dst, n = merge_runs(
        np.array([8, 0, 4, 20]), np.array([108, 100, 104, 50]), np.array([4, 4, 4, 4])
    )
    assert list(src) == [0, 20] and list(dst) == [100, 50] and list(n) == [12, 4]


def test_addresses_offset_each_region_base():
    plan = make_plan(LLAMA, InstanceLayout(8), InstanceLayout(8))
    (cl,) = copy_lists(plan, 0, [1], [0], 3)
    p_size = region_nbytes(LLAMA, plan.prefill, plan.prefill_workers[0], 4)
    src_bases = 1_000_000 + p_size * np.arange(32)
    dst_bases = 9_000_000 + p_size * np.arange(32)
    src, dst, lengths = cl.addresses(src_bases, dst_bases)
    assert len(src) == cl.num_descriptors == 32
    assert src[1] - src[0] == p_size and dst[0] == 9_000_000 and set(lengths) == {3 * 128}
    assert src[0] == 1_000_000 + 16 * 128  # block 1 of region 0


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
        fill_worker_cache(m, plan.prefill, w, 4, [p_req], salt=w.rank) for w in plan.prefill_workers
    ]
    d = plan.decode_workers[0]
    initial = fill_worker_cache(m, plan.decode, d, 4, [], salt=99)
    cache = initial.copy()
    for cl in lists_for(plan, p_req, d_req):
        apply_copy_lists(p_caches[cl.read.prefill_rank], cache, [cl])
    want = expected_decode_cache(m, plan.decode, d, initial, [d_req])
    return np.array_equal(cache, want)


def test_verifier_catches_wrong_offset_and_wrong_worker():
    plan = make_plan(LLAMA, InstanceLayout(4), InstanceLayout(8, cache_layout="NHD"))

    def good(plan, p_req, d_req):
        return copy_lists(plan, 0, p_req.block_ids, d_req.block_ids, 20)

    def shifted(plan, p_req, d_req):
        (cl,) = good(plan, p_req, d_req)
        return [dataclasses.replace(cl, src_offsets=cl.src_offsets + 128)]

    def wrong_worker(plan, p_req, d_req):
        (cl,) = good(plan, p_req, d_req)
        return [dataclasses.replace(cl, read=dataclasses.replace(cl.read, prefill_rank=1))]

    assert _run(plan, good)
    assert not _run(plan, shifted)
    assert not _run(plan, wrong_worker)


def test_apply_refuses_runs_past_the_region():
    plan = make_plan(LLAMA, InstanceLayout(4), InstanceLayout(4))
    (cl,) = copy_lists(plan, 0, [7], [0], 4)  # block 7 does not exist in a 4-block cache
    m = plan.model
    src = fill_worker_cache(m, plan.prefill, plan.prefill_workers[0], 4, [], salt=1)
    with pytest.raises(VerificationError, match="past the region"):
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
        "from kvbridge.plan.layout import InstanceLayout\n"
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
