"""vLLM's CPU KV cache named in kvbridge's terms (no vLLM needed: its layout rebuilt here).

The CPU attention kernel views a layer's cache [num_blocks, heads, block_size,
2*head_dim] as [num_blocks, heads, 2*block_size, head_dim] and takes the first
block_size rows as K, the rest as V. Writing distinct values through that view and
reading them back at the offsets kvbridge's layout (LBHKNC) gives must agree byte for
byte; the layout must then plan with the other TP sizes and block sizes of the matrix.
"""

from __future__ import annotations

import pytest
import torch

from kvbridge.errors import ConfigError
from kvbridge.plan import from_hf_config, make_plan, verify_plan
from kvbridge.plan.layout import cache_strides
from kvbridge.vllm.cache import CPU_LAYOUT, describe_kv_caches

SMOLLM2 = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
    "torch_dtype": "float32",
}


def vllm_cpu_caches(layers: int, blocks: int, heads: int, block: int, head_dim: int):
    """Per-layer views of one buffer, as vLLM's CPU worker registers them."""
    buf = torch.zeros(layers, blocks, heads, block, 2 * head_dim)
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(layers)}


def test_pages_lie_where_the_layout_says() -> None:
    """Each (block, head, K/V) page half starts where LBHKNC puts it and spans
    block_size x head_dim elements: the unit the connector moves (within a page the
    kernel keeps K channel-major, see cache.py)."""
    model = from_hf_config({**SMOLLM2, "num_hidden_layers": 2})
    caches = vllm_cpu_caches(2, 5, 1, 32, 64)  # tp 3: one head per worker
    reg = describe_kv_caches(caches, model, tp_size=3, block_size=32)
    assert reg.layout.cache_layout == CPU_LAYOUT and reg.num_blocks == 5
    strides = cache_strides(model, reg.layout, reg.layout.workers(model)[0])
    assert strides["N"][1] * 32 == strides["K"][1] == 32 * 64 * 4
    for layer, t in enumerate(caches.values()):
        assert reg.regions.addresses[layer] == t.data_ptr()
        assert reg.regions.lengths[layer] == t.numel() * 4
        k, v = t.view(5, 1, 64, 64).chunk(2, dim=2)  # the kernel's K and V pages
        for b in range(5):
            for kv, page in ((0, k), (1, v)):
                off = b * strides["B"][1] + kv * strides["K"][1]
                assert page[b, 0].data_ptr() == t.data_ptr() + off


@pytest.mark.parametrize(
    ("heads", "p_tp", "d_tp", "p_block", "d_block"),
    [
        (3, 1, 3, 32, 32),
        (3, 3, 1, 32, 32),
        (1, 1, 2, 32, 32),
        (1, 2, 1, 32, 32),
        (6, 2, 3, 32, 32),
        (6, 3, 2, 32, 32),
        (3, 1, 1, 64, 32),
    ],
)
def test_the_matrix_plans_byte_exact(heads, p_tp, d_tp, p_block, d_block) -> None:
    q_heads = 9 if heads == 3 else 6  # SmolLM2, tiny-kv1 (4 would do), tiny-kv6
    cfg = {
        **SMOLLM2,
        "num_hidden_layers": 3,
        "num_key_value_heads": heads,
        "num_attention_heads": q_heads,
        "hidden_size": q_heads * 64,
    }
    model = from_hf_config(cfg)
    hd = model.head_dim
    p = describe_kv_caches(
        vllm_cpu_caches(3, 4, max(heads // p_tp, 1), p_block, hd), model, p_tp, p_block
    ).layout
    d = describe_kv_caches(
        vllm_cpu_caches(3, 4, max(heads // d_tp, 1), d_block, hd), model, d_tp, d_block
    ).layout
    plan = make_plan(model, p, d)
    verify_plan(plan, 77)
    verify_plan(plan, 77, start_token=64)


def test_other_layouts_are_refused_with_what_works() -> None:
    model = from_hf_config({**SMOLLM2, "num_hidden_layers": 2})
    flash = {f"model.layers.{i}.attn": torch.zeros(2, 5, 32, 3, 64) for i in range(2)}
    with pytest.raises(ConfigError, match=r"vLLM's CPU layout \[num_blocks, kv_heads_per_rank"):
        describe_kv_caches(flash, model, 1, 32)
    with pytest.raises(ConfigError, match=r"registered 1 KV caches; .* has 2 layers"):
        describe_kv_caches(dict(list(vllm_cpu_caches(2, 5, 3, 32, 64).items())[:1]), model, 1, 32)
