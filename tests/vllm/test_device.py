"""Caches on a GPU, as the connector decides about them at start-up, without a GPU.

vLLM gives a GPU worker its caches on the worker's device; kvbridge reads their device,
addresses, shapes and strides only (`OnDevice`: host tensors that name a CUDA device),
registers them as that device's memory (VRAM, its index), and refuses at start-up what
it cannot serve there: caches on several devices, a kind of device NIXL is not given,
an export process (it maps host memory) under kv_export 'process'. A KV dtype
conversion into a GPU cache fails the pull that would need it, naming why (the cast
runs on the host; the prefill's dtype is known at the pair's first pull only). The
same caches on a GPU, registered with NIXL and moved, are tests/gpu's (`make test-gpu`).
"""

from __future__ import annotations

import logging
import time

import pytest

from kvbridge.connector import CacheRegions, MemType
from kvbridge.connector.worker import adopt_segment
from kvbridge.errors import ConfigError
from kvbridge.plan.cast import Cast
from kvbridge.transfer.config import KVExport, TransferConfig
from kvbridge.transfer.errors import TransferError
from kvbridge.transfer.pull import DecodeWorker
from kvbridge.transfer.staging import Staging
from kvbridge.vllm.cache import CacheFormat, describe_kv_caches
from tests.transfer.fakes import FakeTransport, OnDevice
from tests.vllm.test_layouts import GQA, TP, allocate

TOKEN = b"a shared secret of 32 bytes ...."


def flash_attn(caches: dict) -> CacheFormat:
    return CacheFormat(dict.fromkeys(caches, "FLASH_ATTN"), "LBNHC")


@pytest.mark.parametrize(("device", "mem_type", "device_id"), [
    ("cpu", MemType.DRAM, 0),
    ("cuda:1", MemType.VRAM, 1),
    ("cuda", MemType.VRAM, 0),
])  # fmt: skip
def test_caches_on_one_device_register_as_its_memory(device, mem_type, device_id) -> None:
    """The same FlashAttention caches in host memory and on GPU 1: the same layout,
    addresses and lengths; host memory as DRAM, the GPU as VRAM of its index."""
    _, caches = allocate("LBNHC", GQA, 32)
    host = describe_kv_caches(caches, GQA, TP, 32, flash_attn(caches))
    on = {name: OnDevice(t, device) for name, t in caches.items()}
    reg = describe_kv_caches(on, GQA, TP, 32, flash_attn(caches))
    assert (reg.regions.mem_type, reg.regions.device_id) == (mem_type, device_id)
    assert (reg.layout, reg.num_blocks, reg.model) == (host.layout, host.num_blocks, host.model)
    assert reg.regions.addresses == host.regions.addresses
    assert reg.regions.lengths == host.regions.lengths
    assert (host.regions.mem_type, host.regions.device_id) == (MemType.DRAM, 0)


@pytest.mark.parametrize("devices", [("cuda:0", "cuda:1"), ("cpu", "cuda:0")])
def test_caches_on_several_devices_are_refused_naming_each(devices) -> None:
    _, caches = allocate("LBNHC", GQA, 32)
    on = {name: OnDevice(t, devices[i > 0]) for i, (name, t) in enumerate(caches.items())}
    first, second = devices
    with pytest.raises(
        ConfigError,
        match=rf"one worker lie on 2 devices \({first}: model.layers.0.self_attn.attn; "
        rf"{second}: model.layers.1.self_attn.attn, model.layers.2.self_attn.attn\); "
        r".*all in host memory \(vLLM's CPU build\) or all on the worker's own GPU",
    ):
        describe_kv_caches(on, GQA, TP, 32, flash_attn(caches))


def test_caches_on_a_device_nixl_is_not_given_are_refused() -> None:
    _, caches = allocate("LBNHC", GQA, 32)
    on = {name: OnDevice(t, "xpu:0") for name, t in caches.items()}
    with pytest.raises(
        ConfigError,
        match=r"memory on device xpu:0 cannot be registered with NIXL here; use host memory "
        r"\(cpu\) or a GPU",
    ):
        describe_kv_caches(on, GQA, TP, 32, flash_attn(caches))


def gpu_regions() -> CacheRegions:
    """Three layers' regions on GPU 1 (never read or written here)."""
    return CacheRegions((1 << 40, (1 << 40) + 4096, (1 << 40) + 8192), (4096,) * 3, MemType.VRAM, 1)


def test_an_export_process_is_refused_for_a_gpu_cache(caplog) -> None:
    """An export process maps host memory: kv_export 'process' is refused at start-up
    naming the device; 'auto' with a token keeps the KV in the worker's own agent and
    says why; neither touches the GPU's memory."""
    process = TransferConfig(kv_export=KVExport.PROCESS, token=TOKEN)
    with pytest.raises(
        ConfigError,
        match=r"kv_export='process' cannot export this KV cache: it lies in device memory "
        r"\(VRAM, device 1\), which cannot be moved into shared memory; use 'inline' or 'auto'",
    ):
        adopt_segment(gpu_regions(), process)
    with caplog.at_level(logging.WARNING, "kvbridge.connector"):
        assert adopt_segment(gpu_regions(), TransferConfig(token=TOKEN)) is None
    assert "it lies in device memory (VRAM, device 1)" in caplog.text
    assert adopt_segment(gpu_regions(), TransferConfig()) is None  # inline: nothing to move


def test_a_dtype_conversion_into_a_gpu_cache_fails_naming_why() -> None:
    """The cast runs on the host: the pull that needs one fails, naming the cache's
    memory and what works; no staging buffer is made or registered."""
    transport = FakeTransport("decode0")
    worker = DecodeWorker(0, "D", gpu_regions(), 4, transport, TransferConfig(), time.monotonic)
    staging = Staging(worker)
    with pytest.raises(
        TransferError,
        match=r"decode worker 0 keeps its cache in VRAM; converting the KV from float32 to "
        r"bfloat16 needs a host-memory \(DRAM\) cache: give the prefill instance the decode "
        r"cache's dtype",
    ):
        staging.regions(Cast("float32", "bfloat16"))
    assert staging.nbytes == 0 and not transport.registered
