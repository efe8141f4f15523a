"""Attention backends' caches in kvbridge's letters: the table, the checks on the
registered tensors, the refusals, and every layout planned byte-exact against others.
(tests/vllm/test_layouts.py runs the same table on tensors vLLM allocates and its
backends write, and moves them through the transfer runtime.)"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from kvbridge.errors import LayoutError
from kvbridge.plan import InstanceLayout, make_plan, verify_plan
from kvbridge.plan.backends import (
    BACKEND_CONTENT,
    VLLM_ORDERS,
    Content,
    LayerTensor,
    backend_layout,
    dense_strides,
    place_layers,
)
from kvbridge.plan.geometry import AttentionKind, ModelKVSpec

#: (backend, vLLM's layout) -> kvbridge's layout
TABLE = {
    ("CPU_ATTN", "LBHNC"): "LBHKNC:K=CN",  # the CPU backend's only layout
    ("FLASH_ATTN", "LBNHC"): "LBNHKC",  # NHD
    ("FLASHINFER", "LBHNC"): "LBHNKC",  # HND
    ("TRITON_ATTN", "LHBNC"): "LHBNKC",  # heads outside blocks: a region per layer and head
    ("FLASH_ATTN", "BLNHC"): "BLNHKC",  # cross-layer
    ("FLASHINFER", "BLHNC"): "BLHNKC",
    ("FLASHINFER", "BHLNC"): "BHLNKC",
    ("CPU_MLA", "LBNHC"): "LBNHKC",  # MLA's latent: H and K of extent 1
    ("FLASHMLA", "BLNHC"): "BLNHKC",
}


@pytest.mark.parametrize(("backend", "order"), list(TABLE))
def test_each_backend_layout_maps_to_kvbridge_letters(backend: str, order: str) -> None:
    assert backend_layout(backend, order).name == TABLE[backend, order]


def test_every_known_backend_under_every_layout_vllm_defines() -> None:
    for backend, order in itertools.product(BACKEND_CONTENT, VLLM_ORDERS):
        if BACKEND_CONTENT[backend] is Content.CPU_PAGE and not order.endswith("NC"):
            with pytest.raises(LayoutError, match=f"CPU_ATTN under KV cache layout {order}"):
                backend_layout(backend, order)
            continue
        layout = backend_layout(backend, order)
        # vLLM's L, B, H, N keep their order; K/V sits where the backend reads it
        assert layout.order.replace("K", "") == order


def test_unknown_backends_and_layouts_are_refused_with_what_works() -> None:
    with pytest.raises(LayoutError, match=r"attention backend ROCM_ATTN is not one .*FLASH_ATTN"):
        backend_layout("ROCM_ATTN", "LBNHC")
    with pytest.raises(LayoutError, match=r"KV cache layout NHD is not one .*LBNHC, LBHNC"):
        backend_layout("FLASH_ATTN", "NHD")


def tensors(
    order: str, layers: int, blocks: int, heads: int, block: int, width: int, backend="FLASH_ATTN"
):
    """Per-layer [B, H, N, C] views of one dense buffer in `order` (4-byte elements)."""
    ext = {"L": layers, "B": blocks, "H": heads, "N": block, "C": width}
    st = dense_strides(order, ext)
    return [
        LayerTensor(
            f"model.layers.{i}.attn",
            backend,
            4096 + 4 * i * st["L"],
            (blocks, heads, block, width),
            tuple(st[a] for a in "BHNC"),
            4,
            "float32",
        )
        for i in range(layers)
    ]


@pytest.mark.parametrize("order", VLLM_ORDERS)
def test_regions_are_the_layers_heads_or_the_buffer(order: str) -> None:
    placed = place_layers(order, tensors(order, 3, 5, 2, 16, 64), 2, 16, 32, 2)
    page = 2 * 16 * 64 * 4  # heads x tokens x (K and V) channels, bytes
    if order == "LHBNC":  # a region per (layer, head): [B][N][K/V][C]
        assert placed.addresses == tuple(
            4096 + (layer * 2 + h) * 5 * page // 2 for layer in range(3) for h in range(2)
        )
        assert placed.lengths == (5 * page // 2,) * 6
    elif order[0] == "L":  # a region per layer
        assert placed.addresses == tuple(4096 + layer * 5 * page for layer in range(3))
        assert placed.lengths == (5 * page,) * 3
    else:  # one region: the buffer
        assert placed.addresses == (4096,) and placed.lengths == (3 * 5 * page,)
    assert placed.num_blocks == 5


def test_tensors_that_are_not_the_dense_allocation_are_refused() -> None:
    ok = tensors("BLNHC", 2, 5, 2, 16, 64)
    with pytest.raises(LayoutError, match=r"'model.layers.0.attn' of attention backend "):
        place_layers("BLNHC", tensors("LBNHC", 2, 5, 2, 16, 64), 2, 16, 32, 2)
    apart = [ok[0], dataclasses.replace(ok[1], address=1 << 30)]
    with pytest.raises(LayoutError, match="at a separate address"):
        place_layers("BLNHC", apart, 2, 16, 32, 2)
    with pytest.raises(LayoutError, match=r"shape \(5, 2, 16, 64\) \[num_blocks"):
        place_layers("BLNHC", tensors("BLNHC", 2, 5, 2, 32, 64), 2, 16, 32, 2)
    with pytest.raises(LayoutError, match="an MLA model needs an MLA backend"):
        place_layers("LBNHC", tensors("LBNHC", 2, 5, 1, 16, 64, "CPU_MLA"), 1, 16, 32, 2)
    hnd = tensors("LBHNC", 2, 5, 2, 16, 64)
    mixed = [hnd[0], dataclasses.replace(hnd[1], backend="CPU_ATTN")]
    with pytest.raises(LayoutError, match=r"\(FLASH_ATTN\) and 'model.layers.1.attn' \(CPU_ATTN"):
        place_layers("LBHNC", mixed, 2, 16, 32, 2)
    with pytest.raises(LayoutError, match=r"'model.layers.1.attn': attention backend \(none\)"):
        place_layers("BLNHC", [ok[0], dataclasses.replace(ok[1], backend="")], 2, 16, 32, 2)
    # an axis of extent 1 may carry any stride (vLLM's views of one KV head per rank)
    one = tensors("LBHNC", 2, 5, 1, 16, 64)
    odd = [dataclasses.replace(t, strides=(t.strides[0], 7, 64, 1)) for t in one]
    assert place_layers("LBHNC", odd, 1, 16, 32, 2).num_blocks == 5


GQA = ModelKVSpec(3, 8, 4, 32, "float32", AttentionKind.GQA, "gqa")
MLA = ModelKVSpec(3, 4, 1, 576, "float32", AttentionKind.MLA, "mla")


@pytest.mark.parametrize(("backend", "order"), list(TABLE))
def test_each_layout_plans_byte_exact_to_and_from_the_others(backend: str, order: str) -> None:
    """Prefill tp 2 (block 32) in this layout -> decode tp 4 (block 16) in every other
    layout of the table for the same kind of model, and back; partial pulls too."""
    model = MLA if BACKEND_CONTENT[backend] is Content.LATENT else GQA
    mine = backend_layout(backend, order)
    for (b, o), name in TABLE.items():
        if (BACKEND_CONTENT[b] is Content.LATENT) != model.is_mla or (b, o) == (backend, order):
            continue
        for p, d in ((mine, name), (name, mine)):
            plan = make_plan(
                model,
                InstanceLayout(tp_size=2, block_size=32, cache_layout=p),
                InstanceLayout(tp_size=4, block_size=16, cache_layout=d),
            )
            verify_plan(plan, 45)
            verify_plan(plan, 45, start_token=20)
