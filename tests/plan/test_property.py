"""Property test: every valid layout pair (TP, PP, block size, any cache-layout axis
order, channel-major K and/or V halves, MLA) verifies byte-exact; every invalid one is
refused with the project's error, naming the offending value."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.errors import KVBridgeError
from kvbridge.plan.copylist import copy_lists
from kvbridge.plan.geometry import AttentionKind, ModelKVSpec
from kvbridge.plan.layout import CacheLayout, InstanceLayout, valid_tp_sizes
from kvbridge.plan.planner import make_plan
from kvbridge.plan.verifier import count_contiguous_runs, verify_plan
from tests.plan.helpers import check_plan_structure


@st.composite
def models(draw: st.DrawFn) -> ModelKVSpec:
    layers = draw(st.integers(1, 6))
    if draw(st.booleans()) and draw(st.booleans()):  # ~1/4 MLA
        heads = draw(st.sampled_from([1, 2, 4, 6, 8, 12]))
        return ModelKVSpec(
            layers, heads, 1, draw(st.sampled_from([3, 8])), "bfloat16", AttentionKind.MLA, "mla"
        )
    kv = draw(st.sampled_from([1, 2, 3, 4, 5, 6, 8, 10]))
    heads = kv * draw(st.sampled_from([1, 2, 3]))
    kind = (
        AttentionKind.MHA if heads == kv else (AttentionKind.MQA if kv == 1 else AttentionKind.GQA)
    )
    return ModelKVSpec(
        layers,
        heads,
        kv,
        draw(st.sampled_from([2, 4, 8])),
        draw(st.sampled_from(["float16", "float32", "float8_e4m3fn"])),
        kind,
    )


@st.composite
def layouts(draw: st.DrawFn, model: ModelKVSpec) -> InstanceLayout:
    divisors = [t for t in range(1, 31) if model.num_attention_heads % t == 0]
    tp = draw(st.one_of(st.sampled_from(divisors), st.integers(1, 30)))
    pp = draw(st.integers(1, model.num_layers + 1))
    order = CacheLayout.parse(
        draw(
            st.one_of(
                st.sampled_from(["HND", "NHD", "BHLNC", "BLHNC", "BLNHC"]),
                st.permutations("BLKHN").map(lambda axes: "".join(axes) + "C"),
            )
        )
    ).order
    return InstanceLayout(
        tp_size=tp,
        pp_size=pp,
        block_size=draw(st.integers(1, 20)),
        cache_layout=draw(halves(order)),
    )


def halves(order: str) -> st.SearchStrategy[str]:
    """`order` as it is, or with channel-major halves where the order allows them (N
    after B and K)."""
    if not order.index("B") < order.index("N") > order.index("K"):
        return st.just(order)
    return st.sampled_from(["", ":K=CN", ":V=CN", ":K=CN,V=CN"]).map(lambda h: order + h)


def is_valid(model: ModelKVSpec, layout: InstanceLayout) -> bool:
    tp, kv = layout.tp_size, model.num_kv_heads
    return (
        model.num_attention_heads % tp == 0
        and (model.is_mla or kv % tp == 0 or tp % kv == 0)
        and layout.pp_size <= model.num_layers
    )


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_layout_pair_verifies_or_is_refused(data: st.DataObject):
    model = data.draw(models())
    prefill = data.draw(layouts(model))
    decode = data.draw(layouts(model))
    if not (is_valid(model, prefill) and is_valid(model, decode)):
        try:
            make_plan(model, prefill, decode)
        except KVBridgeError as exc:
            side = "prefill" if not is_valid(model, prefill) else "decode"
            assert str(exc).startswith(side)
            assert "use" in str(exc)  # says what would work
            return
        raise AssertionError(f"invalid pair accepted: {prefill} {decode}")
    plan = make_plan(model, prefill, decode)
    check_plan_structure(plan)
    tokens = data.draw(st.integers(1, 3 * max(prefill.block_size, decode.block_size) + 2))
    # a partial pull at any alignment (the decode side already holds [0, start))
    start = data.draw(st.one_of(st.just(0), st.integers(0, tokens - 1)))
    report = verify_plan(plan, tokens, seed=data.draw(st.integers(0, 2**16)), start_token=start)
    assert report.bytes_copied == (tokens - start) * plan.bytes_per_token


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_fan_out_on_decode_hosts_verifies_and_reads_each_cell_once_per_host(
    data: st.DataObject,
):
    """With decode workers spread over hosts, every decode worker still ends up with
    exactly its bytes (the local hop copies from a worker that read them), and the link
    carries each (layer, head) cell once per decode host that holds it."""
    model = data.draw(models())
    prefill = data.draw(layouts(model))
    decode = data.draw(layouts(model))
    if not (is_valid(model, prefill) and is_valid(model, decode)):
        return
    num_hosts = data.draw(st.integers(1, 3))
    hosts = data.draw(
        st.lists(
            st.sampled_from([f"host{i}" for i in range(num_hosts)]),
            min_size=decode.world_size,
            max_size=decode.world_size,
        )
    )
    plan = make_plan(model, prefill, decode, decode_hosts=hosts)
    check_plan_structure(plan)
    flat = make_plan(model, prefill, decode)
    assert plan.bytes_per_token == flat.bytes_per_token  # every worker still gets its bytes
    cell = model.with_dtype(prefill.kv_dtype(model)).num_kv_tensors * (
        model.head_dim * model.with_dtype(prefill.kv_dtype(model)).itemsize
    )
    per_host = {
        (hosts[d.rank], layer, head)
        for d in plan.decode_workers
        for layer in range(*d.layers)
        for head in range(*d.kv_heads)
    }
    assert plan.link_bytes_per_token == len(per_host) * cell
    tokens = data.draw(st.integers(1, 3 * max(prefill.block_size, decode.block_size) + 2))
    start = data.draw(st.one_of(st.just(0), st.integers(0, tokens - 1)))
    report = verify_plan(plan, tokens, seed=data.draw(st.integers(0, 2**16)), start_token=start)
    assert report.link_bytes == (tokens - start) * plan.link_bytes_per_token
    assert report.local_bytes == (tokens - start) * plan.local_bytes_per_token


@st.composite
def paged_layouts(
    draw: st.DrawFn, model: ModelKVSpec, block_size: int, tp_size: int | None = None
) -> InstanceLayout:
    """A valid layout of vLLM-like paged caches: `block_size`, `tp_size` or any TP size
    the model allows (replicas included), per-layer or cross-layer orders, K and/or V
    channel-major or not."""
    order = draw(st.sampled_from(["LBHKNC", "LKBHNC", "LBKHNC", "BLKHNC", "BHLKNC", "BLKNHC"]))
    return InstanceLayout(
        tp_size=tp_size or draw(st.sampled_from(valid_tp_sizes(model))),
        block_size=block_size,
        cache_layout=draw(halves(order)),
    )


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_paged_caches_with_channel_major_halves_move_byte_exact(data: st.DataObject):
    """vLLM's CPU page (K channel-major) and its kin: mixed block sizes 16/32/64, TP
    pairs with replication and non-multiples, partial pulls starting inside a block of
    either side, partial last blocks. Every pair verifies byte for byte, and the merged
    copy lists are the maximal runs contiguous on both sides, counted element by element."""
    # a third each: any TP pair; sizes that are not multiples (6 KV heads, 2 <-> 3);
    # replicas on one side (tp twice the KV heads)
    kind = data.draw(st.sampled_from(["any", "non-multiple", "replicas"]))
    if kind == "non-multiple":
        kv = 6
    else:
        kv = data.draw(st.sampled_from([1, 2, 3, 6] if kind == "any" else [1, 2, 3]))
    model = ModelKVSpec(
        data.draw(st.integers(1, 2)),
        kv * (2 if kind == "replicas" else data.draw(st.sampled_from([1, 2]))),
        kv,
        data.draw(st.sampled_from([2, 4, 8])),
        data.draw(st.sampled_from(["float16", "float32"])),
        AttentionKind.MHA if data.draw(st.booleans()) else AttentionKind.GQA,
    )
    tps: list[int | None] = [None, None]
    if kind == "non-multiple":
        tps = data.draw(st.permutations([2, 3]))
    elif kind == "replicas":
        tps = data.draw(st.permutations([2 * kv, None]))
    blocks = data.draw(st.tuples(*[st.sampled_from([16, 32, 64])] * 2))  # 2/3 differ
    prefill = data.draw(paged_layouts(model, blocks[0], tps[0]))
    decode = data.draw(paged_layouts(model, blocks[1], tps[1]))
    plan = make_plan(model, prefill, decode)
    check_plan_structure(plan)
    # whole blocks on both sides, or a partial last block on either
    tokens = data.draw(st.one_of(st.sampled_from([64, 192]), st.integers(1, 3 * 64 + 5)))
    start = data.draw(st.one_of(st.just(0), st.integers(0, tokens - 1)))
    report = verify_plan(plan, tokens, seed=data.draw(st.integers(0, 2**16)), start_token=start)
    assert report.bytes_copied == (tokens - start) * plan.bytes_per_token
    rank = data.draw(st.integers(0, len(plan.decode_workers) - 1))
    p_need = -(-tokens // prefill.block_size) - start // prefill.block_size
    d_need = -(-tokens // decode.block_size) - start // decode.block_size
    for cl in copy_lists(plan, rank, 2 * np.arange(p_need), 3 * np.arange(d_need), tokens, start):
        assert cl.num_descriptors == count_contiguous_runs(cl, model.itemsize)
