"""Head and layer ownership of one instance, and the refusals of invalid layouts."""

from __future__ import annotations

import pytest

from kvbridge.errors import LayoutError
from kvbridge.plan.geometry import AttentionKind, ModelKVSpec, load_model_spec
from kvbridge.plan.layout import (
    CacheLayout,
    InstanceLayout,
    cache_strides,
    default_pp_split,
    kv_head_range,
    valid_tp_sizes,
)


def test_head_ranges_split_and_replicate():
    assert [kv_head_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # tp 9 > 3 KV heads: three consecutive workers replicate each head
    assert [kv_head_range(3, 9, r)[0] for r in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [kv_head_range(2, 8, r)[0] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_valid_tp_sizes():
    assert valid_tp_sizes(load_model_spec("smollm2-135m")) == [1, 3, 9]
    assert valid_tp_sizes(load_model_spec("llama-3.2-1b")) == [1, 2, 4, 8, 16, 32]
    # MLA: any tp dividing the query heads
    assert valid_tp_sizes(load_model_spec("deepseek-v2-lite")) == [1, 2, 4, 8, 16]


def test_vllm_default_pp_split():
    assert default_pp_split(30, 4) == (7, 8, 8, 7)
    assert default_pp_split(7, 4) == (2, 2, 2, 1)
    assert default_pp_split(16, 2) == (8, 8)
    for layers in range(1, 40):
        for pp in range(1, layers + 1):
            sizes = default_pp_split(layers, pp)
            assert sum(sizes) == layers and max(sizes) - min(sizes) <= 1


def test_workers_rank_order_and_explicit_pp_split():
    m = load_model_spec("llama-3.2-1b")
    ws = InstanceLayout(tp_size=2, pp_size=2, pp_layers=(10, 6)).workers(m)
    assert [(w.rank, w.tp_rank, w.pp_rank, w.kv_heads, w.layers) for w in ws] == [
        (0, 0, 0, (0, 4), (0, 10)),
        (1, 1, 0, (4, 8), (0, 10)),
        (2, 0, 1, (0, 4), (10, 16)),
        (3, 1, 1, (4, 8), (10, 16)),
    ]


@pytest.mark.parametrize(
    "layout, words",
    [
        (dict(tp_size=6), "decode tp_size=6 does not divide num_attention_heads=32"),
        (dict(tp_size=64), "decode tp_size=64 does not divide num_attention_heads=32"),
        (dict(pp_size=17), "decode pp_size=17 exceeds num_layers=16"),
        (dict(pp_size=2, pp_layers=(8, 7)), "decode pp_layers=[8, 7] sums to 15"),
    ],
)
def test_refusals_name_field_value_and_fix(layout, words):
    m = load_model_spec("llama-3.2-1b")
    with pytest.raises(LayoutError) as err:
        InstanceLayout(**layout).workers(m, "decode")
    assert words in str(err.value)


def test_kv_rule_refusal_lists_valid_sizes():
    # 12 query heads, 8 KV heads cannot exist; use 24 query heads and 8 KV heads:
    from kvbridge.plan.geometry import from_hf_config

    m = from_hf_config(
        {
            "num_hidden_layers": 2,
            "num_attention_heads": 24,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "torch_dtype": "float16",
        }
    )
    with pytest.raises(LayoutError) as err:
        InstanceLayout(tp_size=6).workers(m, "decode")
    assert str(err.value).startswith(
        "decode tp_size=6 neither divides nor is a multiple of num_kv_heads=8"
    )
    assert "use one of 1, 2, 4, 8, 24" in str(err.value)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(tp_size=0), "tp_size=0 must be a positive integer"),
        (dict(tp_size=-1), "tp_size=-1"),
        (dict(block_size=2.5), "block_size=2.5"),
        (dict(pp_size="2"), "pp_size='2'"),
        (dict(pp_size=2, pp_layers=(16,)), "pp_layers=[16] has 1 entries but pp_size=2"),
    ],
)
def test_bad_layout_values(kwargs, words):
    with pytest.raises(LayoutError) as err:
        InstanceLayout(**kwargs)
    assert words in str(err.value)


def test_bad_layout_name_is_refused_with_the_accepted_names():
    for bad, why in (
        ("XYZ", "letters other than"),
        ("BHLNCC", "an axis repeated"),
        ("BHLN", "axes missing: KC"),
        ("BHLKCN", "C (channel) not innermost"),
    ):
        with pytest.raises(LayoutError) as err:
            InstanceLayout(cache_layout=bad)
        msg = str(err.value)
        assert f"cache layout={bad!r} is not a valid axis order ({why}" in msg
        assert "use HND, NHD, BHLNC, BLHNC, BLNHC, LBHNC, LBNHC" in msg


@pytest.mark.parametrize(
    "name, order, short",
    [
        ("HND", "LKBHNC", "LBHNC"),
        ("nhd", "LKBNHC", "LBNHC"),
        ("LBHNC", "LKBHNC", "LBHNC"),
        ("BHLNC", "BHLKNC", "BHLNC"),
        ("blnhc", "BLKNHC", "BLNHC"),
        ("LBKNHC", "LBKNHC", "LBKNHC"),  # FlashInfer's per-layer [block][K/V][token][head]
    ],
)
def test_layout_names_parse_to_axis_orders(name, order, short):
    layout = CacheLayout.parse(name)
    assert layout.order == order and layout.name == short
    assert CacheLayout.parse(short) == layout


@pytest.mark.parametrize(
    "name, order, k_inner, v_inner, short",
    [
        ("LBHKNC:K=CN", "LBHKNC", "CN", "NC", "LBHKNC:K=CN"),  # vLLM's CPU cache
        ("lbhknc:k=cn", "LBHKNC", "CN", "NC", "LBHKNC:K=CN"),
        ("HND:V=CN", "LKBHNC", "NC", "CN", "LBHNC:V=CN"),
        ("BHLNC:K=CN,V=CN", "BHLKNC", "CN", "CN", "BHLNC:K=CN,V=CN"),
        ("BLKNHC: K=CN", "BLKNHC", "CN", "NC", "BLNHC:K=CN"),  # N and C apart: H between
        ("LBHKNC:K=NC", "LBHKNC", "NC", "NC", "LBHKNC"),  # token-major, said explicitly
    ],
)
def test_channel_major_halves_parse_name_and_round_trip(name, order, k_inner, v_inner, short):
    layout = CacheLayout.parse(name)
    assert (layout.order, layout.k_inner, layout.v_inner) == (order, k_inner, v_inner)
    assert layout.name == short == str(layout) == layout.value
    assert CacheLayout.parse(layout.name) == layout  # the wire and the CLI carry the name
    assert eval(repr(layout)) == layout


def test_a_channel_major_half_trades_n_and_c_in_its_own_order():
    layout = CacheLayout.parse("LBHKNC:K=CN")
    assert repr(layout) == "CacheLayout('LBHKNC', k_inner='CN')"
    assert layout.axis_order(0) == "LBHKCN" and layout.axis_order(1) == "LBHKNC"
    assert layout.is_channel_major and not CacheLayout.HND.is_channel_major
    # N and C swap their strides in the K half only; K and the axes outside it keep theirs
    model = ModelKVSpec(1, 2, 2, 64, "float32", AttentionKind.MHA)
    lay = InstanceLayout(block_size=32, cache_layout=layout)
    shard = lay.workers(model)[0]
    k, v = cache_strides(model, lay, shard, 0), cache_strides(model, lay, shard, 1)
    assert (k["N"], k["C"]) == ((0, 4), (0, 32 * 4))
    assert (v["N"], v["C"]) == ((0, 64 * 4), (0, 4))
    for axis in "LBHK":
        assert k[axis] == v[axis]
    assert (v["B"], v["H"], v["K"]) == ((0, 32768), (0, 16384), (0, 8192))  # the docstring's


@pytest.mark.parametrize(
    "name, words",
    [
        ("LBHKNC:K=XY", "'K=XY' does not say how a half keeps tokens and channels"),
        ("LBHKNC:Q=CN", "after the order write K=CN, V=CN or K=CN,V=CN"),
        ("LBHKNC:", "'' does not say how a half"),
        ("LBHKNC:K=CN,", "'' does not say how a half"),
        ("LBHKNC:K=CN,K=NC", "says how half K is kept twice; name each half once"),
        ("NBLKHC:K=CN", "needs N (token) after both B (block) and K (K/V)"),
        ("BLHNKC:V=CN", "order='BLHNKC' does not: e.g. LBHKNC:K=CN"),
    ],
)
def test_bad_channel_major_spellings_are_refused_with_what_works(name, words):
    with pytest.raises(LayoutError) as err:
        InstanceLayout(cache_layout=name)
    assert words in str(err.value)
    with pytest.raises(LayoutError, match=r"k_inner='cn' is not valid; use \"NC\""):
        CacheLayout("LBHKNC", k_inner="cn")
