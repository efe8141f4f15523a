"""vLLM's CPU KV cache named in kvbridge's terms.

The CPU attention kernel views a layer's cache [num_blocks, heads, block_size,
2*head_dim] as [num_blocks, heads, 2*block_size, head_dim] and takes the first
block_size rows as K, the rest as V; within them it keeps K channel-major. Keys and
values written by vLLM's own kernel (`cpu_attn_reshape_and_cache`, where vLLM is
installed) must lie at the offsets kvbridge's layout (LBHKNC:K=CN) gives, element for
element; the layout must then plan with the TP sizes and block sizes of the matrix.
"""

from __future__ import annotations

import pytest
import torch

from kvbridge.errors import ConfigError
from kvbridge.plan import from_hf_config, make_plan, verify_plan
from kvbridge.plan.backends import CPU_LAYOUT
from kvbridge.plan.layout import cache_strides, default_pp_split
from kvbridge.vllm.cache import CacheFormat, describe_kv_caches, pipeline_layers

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


def cpu(caches: dict) -> CacheFormat:
    """What vLLM's CPU build says made `caches`: its CPU attention backend, LBHNC."""
    return CacheFormat(dict.fromkeys(caches, "CPU_ATTN"), "LBHNC")


def test_pages_lie_where_the_layout_says() -> None:
    """Each (block, head, K/V) page half starts where LBHKNC puts it and spans
    block_size x head_dim elements (within it the kernel keeps K channel-major: the
    next test)."""
    model = from_hf_config({**SMOLLM2, "num_hidden_layers": 2})
    caches = vllm_cpu_caches(2, 5, 1, 32, 64)  # tp 3: one head per worker
    reg = describe_kv_caches(caches, model, 3, 32, cpu(caches))
    assert reg.layout.cache_layout == CPU_LAYOUT and reg.num_blocks == 5
    shard = reg.layout.workers(model)[0]
    strides = cache_strides(model, reg.layout, shard, 1)  # V: token-major
    assert strides["N"][1] * 32 == strides["K"][1] == 32 * 64 * 4
    k_half = cache_strides(model, reg.layout, shard, 0)  # K: channel-major, same pages
    assert k_half["C"][1] * 64 == strides["K"][1] and k_half["N"][1] == 4
    assert {a: k_half[a] for a in "LBHK"} == {a: strides[a] for a in "LBHK"}
    for layer, t in enumerate(caches.values()):
        assert reg.regions.addresses[layer] == t.data_ptr()
        assert reg.regions.lengths[layer] == t.numel() * 4
        k, v = t.view(5, 1, 64, 64).chunk(2, dim=2)  # the kernel's K and V pages
        for b in range(5):
            for kv, page in ((0, k), (1, v)):
                off = b * strides["B"][1] + kv * strides["K"][1]
                assert page[b, 0].data_ptr() == t.data_ptr() + off


@pytest.mark.parametrize("block_size", [32, 64])
def test_the_cpu_kernel_writes_each_element_where_the_layout_says(block_size: int) -> None:
    """vLLM's kernel writes 70 tokens' keys and values into scattered blocks; every
    element is found at its offset under LBHKNC:K=CN (K channel-major, V token-major)."""
    ops = pytest.importorskip("vllm._custom_ops")
    cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    heads, hd, tokens, num_blocks = 2, 64, 70, 4
    model = from_hf_config(
        {**SMOLLM2, "num_hidden_layers": 1, "num_key_value_heads": heads, "num_attention_heads": 2}
        | {"hidden_size": 2 * hd}
    )
    cache = torch.zeros(num_blocks, heads, block_size, 2 * hd)
    key_cache, value_cache = cache.view(num_blocks, heads, 2 * block_size, hd).chunk(2, dim=2)
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(tokens, heads, hd, generator=gen) for _ in range(2))
    ids = torch.tensor([3, 0, 2])[: -(-tokens // block_size)]
    t = torch.arange(tokens)
    slots = ids[t // block_size] * block_size + t % block_size
    isa = cpu_attn._get_attn_isa(torch.float32, block_size, hd)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    caches = {"model.layers.0.attn": cache}
    reg = describe_kv_caches(caches, model, 1, block_size, cpu(caches))
    assert reg.layout.cache_layout.name == "LBHKNC:K=CN"
    raw = cache.view(-1)
    shard = reg.layout.workers(model)[0]
    for kv, want in ((0, key), (1, value)):
        st = {a: b // 4 for a, (_, b) in cache_strides(model, reg.layout, shard, kv).items()}
        # [tokens, heads, hd] element offsets of each token's K (or V) under the layout
        at = (
            (ids[t // block_size] * st["B"] + t % block_size * st["N"])[:, None, None]
            + torch.arange(heads)[None, :, None] * st["H"]
            + kv * st["K"]
            + torch.arange(hd)[None, None, :] * st["C"]
        )
        assert torch.equal(raw[at], want), ("K", "V")[kv]


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
        (3, 1, 3, 64, 32),
        (6, 3, 2, 32, 64),
        (1, 2, 1, 64, 32),
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
    p_caches = vllm_cpu_caches(3, 4, max(heads // p_tp, 1), p_block, hd)
    d_caches = vllm_cpu_caches(3, 4, max(heads // d_tp, 1), d_block, hd)
    p = describe_kv_caches(p_caches, model, p_tp, p_block, cpu(p_caches)).layout
    d = describe_kv_caches(d_caches, model, d_tp, d_block, cpu(d_caches)).layout
    plan = make_plan(model, p, d)
    verify_plan(plan, 77)
    verify_plan(plan, 77, start_token=64)
    verify_plan(plan, 77, start_token=32)  # inside a 64-token block


def stage_caches(layers: range, blocks: int, heads: int, block: int, head_dim: int):
    """One pipeline stage's caches: vLLM registers its own layers only, by their names."""
    buf = torch.zeros(len(layers), blocks, heads, block, 2 * head_dim)
    return {f"model.layers.{i}.self_attn.attn": buf[n] for n, i in enumerate(layers)}


@pytest.mark.parametrize(
    ("p_tp", "p_pp", "d_tp", "d_pp"), [(1, 2, 2, 1), (2, 1, 1, 2), (1, 3, 2, 2)]
)
def test_pipeline_stages_hold_their_layers_and_plan_byte_exact(p_tp, p_pp, d_tp, d_pp) -> None:
    """Each worker of a pipeline-parallel instance registers its stage's layers (vLLM's
    split, here 2 + 2 and 2 + 1 + 1 of tiny-kv6's 4 layers, with 6 KV heads); the
    instance layout names each worker's layers and heads, and every pair plans
    byte-exact."""
    model = from_hf_config(
        {**SMOLLM2, "num_hidden_layers": 4, "num_key_value_heads": 6}
        | {"num_attention_heads": 6, "hidden_size": 384}
    )
    splits = {1: None, 2: (2, 2), 3: (2, 1, 1)}

    def instance(tp: int, pp: int, block: int):
        layouts, start = [], 0
        for stage, n in enumerate(splits[pp] or (4,)):
            caches = stage_caches(range(start, start + n), 4, 6 // tp, block, 64)
            reg = describe_kv_caches(
                caches, model, tp, block, cpu(caches), pp_layers=splits[pp], pp_rank=stage
            )
            assert len(reg.regions.addresses) == n  # one region per layer of the stage
            for shard in reg.layout.workers(model):
                if shard.pp_rank == stage:
                    assert shard.layers == (start, start + n) and shard.rank // tp == stage
            layouts.append(reg.layout)
            start += n
        assert len(set(layouts)) == 1 and layouts[0].world_size == tp * pp
        return layouts[0]

    plan = make_plan(model, instance(p_tp, p_pp, 32), instance(d_tp, d_pp, 32))
    verify_plan(plan, 77)
    verify_plan(plan, 77, start_token=32)


def test_the_stages_layers_are_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pipeline_layers` is vLLM's split: spare layers before the last stage, or the
    operator's VLLM_PP_LAYER_PARTITION."""
    pytest.importorskip("vllm.distributed.utils")
    assert pipeline_layers(4, 1) is None
    assert pipeline_layers(4, 2) == (2, 2)
    assert pipeline_layers(30, 4) == default_pp_split(30, 4) == (7, 8, 8, 7)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,3")
    assert pipeline_layers(4, 2) == (1, 3)


def test_a_stage_with_other_layers_is_refused() -> None:
    model = from_hf_config({**SMOLLM2, "num_hidden_layers": 4})
    caches = stage_caches(range(2), 4, 3, 32, 64)  # stage 1 of (2, 2) holds layers 2, 3
    with pytest.raises(ConfigError, match=r"layers \[0, 1\] on pipeline stage 1; .* \[2, 4\)"):
        describe_kv_caches(caches, model, 1, 32, cpu(caches), pp_layers=(2, 2), pp_rank=1)
    three = stage_caches(range(2, 5), 4, 3, 32, 64)
    with pytest.raises(ConfigError, match=r"layers \[2, 3, 4\] on pipeline stage 1"):
        describe_kv_caches(three, model, 1, 32, cpu(three), pp_layers=(2, 2), pp_rank=1)


def test_other_layouts_are_refused_with_what_works() -> None:
    model = from_hf_config({**SMOLLM2, "num_hidden_layers": 2})
    flash = {f"model.layers.{i}.attn": torch.zeros(2, 5, 32, 3, 64) for i in range(2)}
    with pytest.raises(
        ConfigError, match=r"attention backend CPU_ATTN under layout LBHNC has shape \(2, 5, 32, 3"
    ):
        describe_kv_caches(flash, model, 1, 32, cpu(flash))
    made_by = CacheFormat(dict.fromkeys(flash, "ROCM_AITER_FA"), "LBNHC")
    with pytest.raises(ConfigError, match=r"backend ROCM_AITER_FA is not one kvbridge knows; "):
        describe_kv_caches(flash, model, 1, 32, made_by)
    one = dict(list(vllm_cpu_caches(2, 5, 3, 32, 64).items())[:1])
    with pytest.raises(ConfigError, match=r"registered 1 KV caches; .* has 2 layers"):
        describe_kv_caches(one, model, 1, 32, cpu(one))


def hybrid_cpu_caches(groups: list[list[int]], blocks: int, heads: int, block: int, head_dim: int):
    """vLLM's hybrid KV cache manager's caches: the j-th layer of every KV cache group
    (layer numbers) views the j-th tensor of one buffer (groups alias from byte 0)."""
    slots = max(len(g) for g in groups)
    buf = torch.zeros(slots, blocks, heads, block, 2 * head_dim)
    return {f"model.layers.{i}.self_attn.attn": buf[j] for g in groups for j, i in enumerate(g)}


#: tiny-gemma3's geometry: 2 KV heads of 64
GEMMA3 = {**SMOLLM2, "num_key_value_heads": 2, "num_attention_heads": 4, "hidden_size": 256}

#: The KV cache groups vLLM makes (`_get_kv_cache_groups_uniform_page_size`) of 8 layers
#: where every 4th is full attention (tiny-gemma3): three sliding groups and a full one
GEMMA3_GROUPS = [[0, 4], [1, 5], [2, 6], [3, 7]]


def names(groups: list[list[int]]) -> list[list[str]]:
    return [[f"model.layers.{i}.self_attn.attn" for i in g] for g in groups]


def test_a_hybrid_models_shared_tensors_are_one_layer_each() -> None:
    """Four groups of two layers over two shared tensors: kvbridge moves a model of two
    layers, one region per tensor (a request's groups each move their own blocks
    over both)."""
    model = from_hf_config({**GEMMA3, "num_hidden_layers": 8})
    caches = hybrid_cpu_caches(GEMMA3_GROUPS, 5, 1, 32, 64)  # tp 2: one head per worker
    reg = describe_kv_caches(caches, model, 2, 32, cpu(caches), names(GEMMA3_GROUPS))
    assert reg.model.num_layers == 2 and reg.model.num_kv_heads == 2
    tensors = [caches["model.layers.0.self_attn.attn"], caches["model.layers.4.self_attn.attn"]]
    assert reg.regions.addresses == tuple(t.data_ptr() for t in tensors)
    assert reg.regions.lengths == (5 * 32 * 128 * 4,) * 2 and reg.num_blocks == 5
    # without the hybrid KV cache manager: one tensor per layer, the model as it is
    flat = vllm_cpu_caches(8, 5, 1, 32, 64)
    assert describe_kv_caches(flat, model, 2, 32, cpu(flat)).model == model


def test_a_hybrid_model_under_pipeline_parallel_is_refused() -> None:
    model = from_hf_config({**GEMMA3, "num_hidden_layers": 8})
    caches = hybrid_cpu_caches(GEMMA3_GROUPS, 5, 1, 32, 64)
    with pytest.raises(
        ConfigError,
        match=r"pipeline_parallel_size=2 with a hybrid model's 4 KV cache groups .* use "
        r"pipeline_parallel_size 1 .*--disable-hybrid-kv-cache-manager",
    ):
        describe_kv_caches(
            caches, model, 2, 32, cpu(caches), names(GEMMA3_GROUPS), pp_layers=(4, 4)
        )


def test_a_hybrid_model_whose_groups_vllm_padded_is_refused() -> None:
    """6 sliding and 2 full layers as vLLM groups 7 sliding and 2 full (layer 3 alone in
    its group: vLLM pads it): moving that group over both tensors would move bytes none
    of its layers holds."""
    model = from_hf_config({**GEMMA3, "num_hidden_layers": 9})
    groups = [[0, 4], [1, 6], [2, 7], [3], [5, 8]]
    caches = hybrid_cpu_caches(groups, 5, 1, 32, 64)
    with pytest.raises(
        ConfigError,
        match=r"KV cache group 3 \(1 layers: model.layers.3.self_attn.attn\) holds "
        r"1 of the 2 shared KV cache tensors; .* equal numbers of layers .*"
        r"--disable-hybrid-kv-cache-manager",
    ):
        describe_kv_caches(caches, model, 2, 32, cpu(caches), names(groups))


def test_a_hybrid_models_groups_plan_byte_exact_with_the_bytes_of_their_tokens() -> None:
    """tiny-gemma3 under the hybrid KV cache manager, prefill tp 1 -> decode tp 2, an
    87-token prompt: the full group moves tokens [0, 87), each of the three
    sliding-window groups (window 32) tokens [32, 87) only, over the two shared
    tensors, byte-exact: each decode worker (one KV head of 64, float32, K and V: 512
    bytes a token and tensor) 2 x (87 + 3 x 55) x 512 = 258,048 bytes, not the
    8 x 87 x 512 = 356,352 of every layer's whole prompt (tests/vllm/test_pd.py
    measures them in vLLM)."""
    model = from_hf_config({**GEMMA3, "num_hidden_layers": 8})
    p_caches = hybrid_cpu_caches(GEMMA3_GROUPS, 8, 2, 32, 64)
    d_caches = hybrid_cpu_caches(GEMMA3_GROUPS, 8, 1, 32, 64)
    p = describe_kv_caches(p_caches, model, 1, 32, cpu(p_caches), names(GEMMA3_GROUPS))
    d = describe_kv_caches(d_caches, model, 2, 32, cpu(d_caches), names(GEMMA3_GROUPS))
    plan = make_plan(p.model, p.layout, d.layout)
    full, sliding = verify_plan(plan, 87), verify_plan(plan, 87, start_token=32)
    assert full.link_bytes + 3 * sliding.link_bytes == 2 * 258_048  # both decode workers


def test_state_tensors_of_a_layer_no_group_names_ssm_are_refused_naming_it() -> None:
    """A layer registered as state tensors (conv, SSM) outside vLLM's Mamba KV cache
    groups (tests/vllm/test_state_cache.py: the ones inside them)."""
    model = from_hf_config({**GEMMA3, "num_hidden_layers": 2})
    caches: dict = vllm_cpu_caches(2, 5, 2, 32, 64)
    caches["model.layers.1.mixer"] = [torch.zeros(5, 4, 3), torch.zeros(5, 2, 64, 16)]
    made_by = CacheFormat({**cpu(caches).backends, "model.layers.1.mixer": "MAMBA2"}, "LBHNC")
    with pytest.raises(
        ConfigError,
        match=r"'model.layers.1.mixer' \(backend MAMBA2\) is 2 state .* no KV cache group names it an SSM",
    ):
        describe_kv_caches(caches, model, 1, 32, made_by)
