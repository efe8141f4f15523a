"""Cache regions as registered with NIXL: host arrays and tensors (DRAM), GPU tensors
(VRAM; described here with a tensor that names a CUDA device, registered for real in
tests/gpu)."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.transfer.errors import TransferError
from kvbridge.transfer.regions import CacheRegions, MemType, memory_of

from .fakes import OnDevice


def test_regions_of_an_engine_style_host_tensor() -> None:
    torch = pytest.importorskip("torch")
    # LBHNC: [num_local_layers, num_kv_tensors, num_blocks, heads, block_size, head_dim],
    # one region per layer and K/V
    cache = torch.zeros(3, 2, 5, 2, 4, 8, dtype=torch.bfloat16)
    regions = CacheRegions.from_tensor(cache, 6)
    size = 5 * 2 * 4 * 8 * 2
    assert regions.mem_type is MemType.DRAM and regions.num_regions == 6
    assert regions.lengths == (size,) * 6
    assert regions.addresses == tuple(cache.data_ptr() + r * size for r in range(6))
    with pytest.raises(TransferError, match="contiguous"):
        CacheRegions.from_tensor(cache.transpose(1, 2), 6)
    # BHLNC: the whole cache is one region
    whole = CacheRegions.from_tensor(cache)
    assert whole.addresses == (cache.data_ptr(),) and whole.lengths == (6 * size,)


def test_regions_of_a_host_array_and_their_nixl_rows() -> None:
    arr = np.zeros((4, 1024), dtype=np.uint16)
    regions = CacheRegions.from_array(arr, 4)
    rows = regions.as_array()
    assert rows.shape == (4, 3)
    assert rows[:, 0].tolist() == [arr.ctypes.data + r * 2048 for r in range(4)]
    assert rows[:, 1].tolist() == [2048] * 4


def test_a_gpu_tensor_is_vram_of_its_device_and_other_devices_are_refused() -> None:
    import torch

    cache = torch.zeros(2, 4, 8)
    regions = CacheRegions.from_tensor(OnDevice(cache, "cuda:3"), 2)
    assert (regions.mem_type, regions.device_id) == (MemType.VRAM, 3)
    assert regions.addresses == (cache.data_ptr(), cache.data_ptr() + 128)
    assert regions.as_array()[:, 2].tolist() == [3, 3]  # NIXL's device id column
    assert memory_of(torch.device("cuda")) == (MemType.VRAM, 0)
    assert memory_of(torch.device("cpu")) == (MemType.DRAM, 0)
    with pytest.raises(TransferError, match=r"device meta cannot be registered .* use host"):
        CacheRegions.from_tensor(OnDevice(cache, "meta"))
