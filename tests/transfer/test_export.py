"""`SharedSegment.adopt`: memory an engine allocated itself (vLLM's KV cache) moves into
shared memory in place, so an export process can map it (issue #21 item 4 for vLLM)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from kvbridge.transfer.errors import TransferError
from kvbridge.transfer.export import ADOPT_MIN_BYTES, SharedSegment


def test_memory_an_engine_allocated_moves_into_shared_memory_in_place() -> None:
    cache = np.empty(ADOPT_MIN_BYTES // 8 + 3, dtype=np.uint64)  # the allocator's own pages
    cache[:] = np.arange(cache.size, dtype=np.uint64)
    address, before = cache.ctypes.data, cache.copy()
    segment = SharedSegment.adopt(address, cache.nbytes)
    assert segment.base <= address and address + cache.nbytes <= segment.base + segment.size
    assert cache.ctypes.data == address and (cache == before).all()  # same place, same bytes
    other = mmap.mmap(segment.fd, segment.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    seen = np.frombuffer(other, dtype=np.uint8)
    off = address - segment.base
    assert bytes(seen[off : off + 64]) == cache.view(np.uint8)[:64].tobytes()
    cache[0] = 0xFEED  # the engine writes; another mapping of the segment sees it
    assert int(np.frombuffer(other, dtype=np.uint64, count=1, offset=off)[0]) == 0xFEED
    del seen
    other.close()


def test_a_small_buffer_that_may_share_pages_is_not_moved() -> None:
    small = np.zeros(1000, dtype=np.uint8)  # likely in the heap, beside other objects
    with pytest.raises(TransferError, match="may share pages"):
        SharedSegment.adopt(small.ctypes.data + 1, 999)
