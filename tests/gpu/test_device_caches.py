"""vLLM's GPU backends' caches on a GPU: read by the connector, registered with NIXL as
device memory (VRAM, the device's index) and moved between GPU caches byte-exact.

Every GPU row of the layout table (tests/vllm/test_layouts.py: FlashAttention under each
of vLLM's KV cache layouts, FlashInfer, FlashMLA) is allocated on the GPU as vLLM
allocates it, written through the backend's view there, and every element must lie where
the connector's layout and regions say; the regions register with a real NIXL agent.
Each layout pair of the table then moves between real worker processes whose caches
lie on the GPU (two agents on one device), with the integrity digest on (gathered on the
device), a fan-out on the decode host (sibling copies between GPU caches), and a KV
dtype conversion into a GPU cache failing the pull with its reason.
"""

from __future__ import annotations

import pytest

from kvbridge.plan.geometry import AttentionKind, ModelKVSpec
from kvbridge.plan.layout import InstanceLayout
from tests.vllm.test_layouts import PAIRS, ROWS, TP

pytestmark = pytest.mark.gpu

#: the table's rows a GPU backend makes (CPU attention's kernel writes host memory only)
GPU_ROWS = [(backend, order) for backend, order in ROWS if not backend.startswith("CPU_")]


@pytest.mark.parametrize(("backend", "order"), GPU_ROWS)
def test_each_element_of_a_gpu_cache_lies_where_the_connector_says(
    backend: str, order: str, gpu: str
) -> None:
    from kvbridge.transfer.agent import NixlTransport
    from kvbridge.transfer.regions import MemType
    from tests.vllm.test_layouts import check_elements

    reg = check_elements(backend, order, gpu)
    assert (reg.regions.mem_type, reg.regions.device_id) == (MemType.VRAM, 0)
    transport = NixlTransport(f"gpu-{backend}-{order}", reg.regions)
    try:
        assert transport.metadata()
    finally:
        transport.close()


def test_a_cache_on_the_gpu_registers_as_vram_of_its_device(gpu: str) -> None:
    import torch

    from kvbridge.transfer.agent import NixlTransport
    from kvbridge.transfer.regions import CacheRegions, MemType

    index = torch.cuda.device_count() - 1  # the last GPU: its own index, not 0's
    cache = torch.zeros(4, 2, 16, 8, 64, dtype=torch.bfloat16, device=f"cuda:{index}")
    regions = CacheRegions.from_tensor(cache, 4)
    assert (regions.mem_type, regions.device_id) == (MemType.VRAM, index)
    transport = NixlTransport("gpu-regions", regions)
    try:
        assert transport.metadata()
    finally:
        transport.close()


@pytest.mark.parametrize(("model", "prefill", "decode"), PAIRS)
def test_each_layout_moves_byte_exact_between_gpu_caches(model, prefill, decode, gpu) -> None:
    """As tests/vllm/test_layouts.py moves them between host caches: prefill tp 2 ->
    decode tp 4 (MLA: tp 1), blocks 32 -> 16 (MLA: 16 -> 32), every pull's digest
    checked (the harness runs with integrity on)."""
    from kvbridge.harness.check import run_check
    from kvbridge.plan import make_plan

    mla = model.is_mla
    p = InstanceLayout(tp_size=TP, block_size=16 if mla else 32, cache_layout=prefill)
    d = InstanceLayout(tp_size=1 if mla else 4, block_size=32 if mla else 16, cache_layout=decode)
    report = run_check(model, p, d, num_requests=2, num_tokens=45, timeout_s=120, device=gpu)
    assert report.failures == [] and report.verified
    assert report.bytes == 2 * 45 * make_plan(model, p, d).bytes_per_token


def test_a_fan_out_copies_between_the_decode_workers_gpu_caches(gpu: str) -> None:
    """MLA prefill tp 1 -> decode tp 2: one decode worker reads the latent, the other
    copies it from that worker's GPU cache; every byte checked."""
    from kvbridge.harness.check import run_check
    from kvbridge.plan import make_plan

    model = ModelKVSpec(3, 4, 1, 576, "bfloat16", AttentionKind.MLA, "mla")
    p = InstanceLayout(tp_size=1, block_size=16, cache_layout="LBNHKC")
    d = InstanceLayout(tp_size=2, block_size=32, cache_layout="LBNHKC")
    report = run_check(
        model, p, d, num_requests=2, num_tokens=45, timeout_s=120, device=gpu, fan_out="on"
    )
    assert report.failures == [] and report.verified
    fan = make_plan(model, p, d, decode_hosts=["here"] * d.world_size)
    assert report.local_bytes == 2 * 45 * fan.local_bytes_per_token > 0


def test_a_dtype_conversion_into_a_gpu_cache_fails_the_pull_naming_why(gpu: str) -> None:
    from kvbridge.harness.check import run_check

    model = ModelKVSpec(2, 4, 2, 64, "float32", AttentionKind.GQA, "gqa")
    p = InstanceLayout(tp_size=1, block_size=16, cache_layout="LBNHKC")
    d = InstanceLayout(tp_size=1, block_size=16, cache_layout="LBNHKC", dtype="bfloat16")
    report = run_check(model, p, d, num_requests=1, num_tokens=20, timeout_s=60, device=gpu)
    assert not report.verified
    assert any("needs a host-memory (DRAM) cache" in f for f in report.failures), report.failures
