"""Every KV cache layout vLLM's attention backends make, read by the connector.

For each backend and each KV cache layout vLLM lets it use (`ROWS`), a worker's caches
are allocated as vLLM allocates them (its own `create_kv_cache_views` where vLLM is
installed, the same dense buffer otherwise) and written through the backend's own view
of them (FlashAttention, FlashInfer: the content split at head_dim; MLA: the latent;
CPU attention: vLLM's kernel where installed). `describe_kv_caches` names the layout in
kvbridge's letters, and every element must lie at the address that layout and the
regions it registers give. Each layout then moves through real worker processes and
NIXL byte-exact (`run_check`, the transfer tests' check) to another layout of the table
(tests/plan/test_backends.py plans each against all the others).
"""

from __future__ import annotations

import pytest
import torch

from kvbridge.errors import ConfigError
from kvbridge.harness.check import run_check
from kvbridge.plan import InstanceLayout, make_plan
from kvbridge.plan.backends import BACKEND_CONTENT, VLLM_ORDERS, Content, dense_strides
from kvbridge.plan.geometry import AttentionKind, ModelKVSpec
from kvbridge.plan.layout import cache_strides
from kvbridge.transfer.regions import MemType
from kvbridge.vllm.cache import CacheFormat, RegisteredCache, describe_kv_caches

#: (backend, vLLM's KV cache layout): CPU attention declares LBHNC only; FlashAttention
#: and the MLA backends declare none (any layout); FlashInfer on SM100 LBHNC and BLHNC
ROWS = [
    ("CPU_ATTN", "LBHNC"),
    *(("FLASH_ATTN", order) for order in VLLM_ORDERS),
    ("FLASHINFER", "LBHNC"),
    ("FLASHINFER", "BLHNC"),
    ("CPU_MLA", "LBNHC"),
    *(("FLASHMLA", order) for order in VLLM_ORDERS),
]
GQA = ModelKVSpec(3, 8, 4, 32, "float32", AttentionKind.GQA, "gqa")
MLA = ModelKVSpec(3, 4, 1, 576, "float32", AttentionKind.MLA, "mla")
TP, BLOCKS = 2, 5  # the worker's tp (GQA: 2 of 4 KV heads) and its cache's blocks


def model_of(backend: str) -> ModelKVSpec:
    return MLA if BACKEND_CONTENT[backend] is Content.LATENT else GQA


def block_of(backend: str) -> int:
    return 16 if model_of(backend).is_mla else 32  # CPU_MLA takes 16, CPU_ATTN multiples of 32


def allocate(
    order: str, model: ModelKVSpec, block: int, device: str = "cpu"
) -> tuple[torch.Tensor, dict]:
    """A worker's caches as vLLM allocates them on `device`: one buffer, per-layer
    [B, H, N, C]."""
    heads = 1 if model.is_mla else model.num_kv_heads // TP
    names = [f"model.layers.{i}.self_attn.attn" for i in range(model.num_layers)]
    try:
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheTensor,
            MLAAttentionSpec,
            compute_layout_strides,
            create_kv_cache_views,
        )
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:  # the same dense buffer, without vLLM
        ext = {"L": model.num_layers, "B": BLOCKS, "H": heads, "N": block}
        ext["C"] = model.num_kv_tensors * model.head_dim
        st = dense_strides(order, ext)
        raw = torch.zeros(model.num_layers * BLOCKS * heads * block * ext["C"], device=device)
        views = [
            raw.as_strided([ext[a] for a in "BHNC"], [st[a] for a in "BHNC"], i * st["L"])
            for i in range(model.num_layers)
        ]
        return raw, dict(zip(names, views, strict=True))
    kind = MLAAttentionSpec if model.is_mla else FullAttentionSpec
    spec = kind(block_size=block, num_kv_heads=heads, head_size=model.head_dim, dtype=torch.float32)
    layout = KVCacheLayout[order]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, model.num_layers, layout)
    size = model.num_layers * BLOCKS * spec.page_size_bytes
    tensor = KVCacheTensor(
        size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    raw = torch.zeros(size, dtype=torch.int8, device=device)
    views = create_kv_cache_views(raw, spec, BLOCKS, layout, tensor)
    return raw, dict(zip(names, views, strict=True))


def write(backend: str, cache: torch.Tensor, kv: torch.Tensor) -> None:
    """Write `kv` ([K/V, B, N, H, C]) into one layer's `cache` as the backend does."""
    hd = kv.shape[-1]
    content = BACKEND_CONTENT[backend]
    if content is Content.LATENT:
        cache.transpose(1, 2)[..., :hd].copy_(kv[0])
    elif content is Content.KV:  # flash_attn.py: (B, H, N, 2*D) -> ((B, N, H, D), (B, N, H, D))
        for half, view in zip(kv, cache.transpose(1, 2).split(hd, dim=-1), strict=True):
            view.copy_(half)
    else:  # cpu_attn.py: pages [.., 2*block, head_dim], K then V
        blocks, heads, block, _ = cache.shape
        k_cache, v_cache = cache.view(blocks, heads, 2 * block, hd).chunk(2, dim=2)
        try:
            from vllm import _custom_ops as ops
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        except ImportError:  # as the kernel writes (test_cache.py): K [channel][token]
            v_cache.copy_(kv[1].transpose(1, 2))
            k_cache.view(blocks, heads, hd, block).copy_(kv[0].permute(0, 2, 3, 1))
            return
        slots = torch.arange(blocks * block)  # token t of block b: slot b*block + t
        key, value = (half.reshape(blocks * block, heads, hd) for half in kv)
        isa = _get_attn_isa(torch.float32, block, hd)
        ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa)


@pytest.mark.parametrize(("backend", "order"), ROWS)
def test_each_element_lies_where_the_connectors_layout_and_regions_say(
    backend: str, order: str
) -> None:
    reg = check_elements(backend, order, "cpu")
    assert (reg.regions.mem_type, reg.regions.device_id) == (MemType.DRAM, 0)


def check_elements(backend: str, order: str, device: str) -> RegisteredCache:
    """Allocate a worker's caches of `backend` under `order` on `device`, write them as
    the backend does, and check every element lies where `describe_kv_caches` says (its
    layout and regions); what it described."""
    model, block = model_of(backend), block_of(backend)
    raw, caches = allocate(order, model, block, device)
    heads = caches[next(iter(caches))].shape[1]
    gen = torch.Generator().manual_seed(7)
    # [layer][K/V][block][token][head][channel]
    values = torch.randn(
        model.num_layers, model.num_kv_tensors, BLOCKS, block, heads, model.head_dim, generator=gen
    ).to(device)
    for layer, cache in enumerate(caches.values()):
        write(backend, cache, values[layer])
    reg = describe_kv_caches(
        caches, model, TP, block, CacheFormat(dict.fromkeys(caches, backend), order)
    )
    assert reg.num_blocks == BLOCKS and reg.layout.block_size == block
    shard = reg.layout.workers(model)[0]
    base, flat = raw.data_ptr(), raw.view(torch.float32)
    addresses = torch.tensor(reg.regions.addresses)
    for kv in range(model.num_kv_tensors):
        st = cache_strides(model, reg.layout, shard, kv)
        extents = {"L": model.num_layers, "B": BLOCKS, "N": block, "H": heads, "C": model.head_dim}
        region, offset = torch.tensor(kv * st["K"][0]), torch.tensor(kv * st["K"][1])
        for dim, axis in enumerate("LBNHC"):  # broadcast over the axes of `values[:, kv]`
            shape = [1] * 5
            shape[dim] = extents[axis]
            idx = torch.arange(extents[axis]).view(shape)
            region = region + idx * st[axis][0]
            offset = offset + idx * st[axis][1]
        at = addresses[region] + offset - base
        got = flat[(at // 4).to(device)]
        assert torch.equal(got, values[:, kv]), f"{backend} {order} {'KV'[kv]}"
        assert int(at.max()) + 4 <= raw.numel() * raw.element_size()
    return reg


def test_a_layout_it_does_not_know_is_refused_naming_backend_shape_and_what_works() -> None:
    _, caches = allocate("LBNHC", GQA, 32)
    with pytest.raises(
        ConfigError, match=r"backend ROCM_ATTN is not one kvbridge knows; .*CPU_ATTN, FLASH_ATTN"
    ):
        describe_kv_caches(
            caches, GQA, TP, 32, CacheFormat(dict.fromkeys(caches, "ROCM_ATTN"), "LBNHC")
        )
    with pytest.raises(
        ConfigError, match=r"CPU_ATTN under KV cache layout LBNHC: .*pages need N and C innermost"
    ):
        describe_kv_caches(
            caches, GQA, TP, 32, CacheFormat(dict.fromkeys(caches, "CPU_ATTN"), "LBNHC")
        )
    # FlashAttention's caches read as if they were LBHNC: shape and strides named
    with pytest.raises(
        ConfigError,
        match=r"'model.layers.0.self_attn.attn' of attention backend FLASH_ATTN under layout "
        r"LBHNC has shape \(5, 2, 32, 64\), strides \(4096, 64, 128, 1\)",
    ):
        describe_kv_caches(
            caches, GQA, TP, 32, CacheFormat(dict.fromkeys(caches, "FLASH_ATTN"), "LBHNC")
        )
    mixed = CacheFormat(
        {**dict.fromkeys(caches, "FLASH_ATTN"), next(iter(caches)): "CPU_ATTN"}, "LBHNC"
    )
    with pytest.raises(
        ConfigError,
        match=r"\(CPU_ATTN\) and 'model.layers.1.self_attn.attn' \(FLASH_ATTN\) are read differently",
    ):
        describe_kv_caches(caches, GQA, TP, 32, mixed)


#: each kvbridge layout of the table once as prefill or decode
PAIRS = [
    (GQA, "LBHKNC:K=CN", "LBNHKC"),  # CPU attention -> FlashAttention NHD
    (GQA, "LBHNKC", "LHBNKC"),  # FlashInfer HND -> heads outside blocks
    (GQA, "BLHNKC", "BLNHKC"),  # cross-layer
    (GQA, "BHLNKC", "LBHKNC:K=CN"),  # cross-layer, heads outermost -> CPU attention
    (MLA, "LBNHKC", "BLNHKC"),  # MLA latent, per layer -> cross-layer
    (MLA, "LBHNKC", "BLHNKC"),
    (MLA, "LHBNKC", "BHLNKC"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "prefill", "decode"), PAIRS)
def test_each_layout_moves_byte_exact_through_the_transfer_runtime(model, prefill, decode) -> None:
    """Prefill tp 2 -> decode tp 4 (MLA: tp 1), blocks 32 -> 16 (MLA: 16 -> 32)."""
    mla = model.is_mla
    p = InstanceLayout(tp_size=TP, block_size=16 if mla else 32, cache_layout=prefill)
    d = InstanceLayout(tp_size=1 if mla else 4, block_size=32 if mla else 16, cache_layout=decode)
    report = run_check(model, p, d, num_requests=2, num_tokens=45, timeout_s=60)
    assert report.failures == [] and report.verified
    assert report.bytes == 2 * 45 * make_plan(model, p, d).bytes_per_token
