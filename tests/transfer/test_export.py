"""The KV export's plumbing (issue #21 item 4): `SharedSegment.adopt` moves memory an
engine allocated itself (vLLM's KV cache) into shared memory in place, so an export
process can map it; an export process that breaks its pipe's protocol is replaced."""

from __future__ import annotations

import mmap
import os
import subprocess

import numpy as np
import pytest

from kvbridge.transfer.errors import TransferError
from kvbridge.transfer.export import (
    _HEADER,
    ADOPT_MIN_BYTES,
    ExportedTransport,
    ExportNotifs,
    ExportReady,
    SharedSegment,
    _Child,
    _encoder,
    heap_range,
)


def test_memory_an_engine_allocated_moves_into_shared_memory_in_place() -> None:
    # pages of its own, its start after a 16-byte header (as glibc maps a large buffer;
    # np.empty could come from the heap here, after other tests freed large buffers)
    pages = mmap.mmap(-1, ADOPT_MIN_BYTES + 2 * mmap.PAGESIZE)
    cache = np.frombuffer(pages, dtype=np.uint64, count=ADOPT_MIN_BYTES // 8 + 3, offset=16)
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


def test_the_heaps_pages_are_never_moved() -> None:
    """glibc serves even a buffer over ADOPT_MIN_BYTES from its heap once it holds that
    much freed memory, and grows and trims the heap in place: its pages stay where they
    are, whatever the size (the check comes before any byte is copied)."""
    heap = heap_range()
    assert heap is not None, "a Linux process has a [heap] in /proc/self/maps"
    start = heap[0]  # page-aligned: only the heap check can refuse it
    with pytest.raises(TransferError, match=r"lies in the process's heap.*or with mmap"):
        SharedSegment.adopt(start, heap[1] - heap[0])


def test_a_small_buffer_that_may_share_pages_is_not_moved() -> None:
    small = np.zeros(1000, dtype=np.uint8)  # likely in the heap, beside other objects
    with pytest.raises(TransferError, match="may share pages"):
        SharedSegment.adopt(small.ctypes.data + 1, 999)


@pytest.mark.parametrize("bad", [b"\x93not a frame", "ready again"])
def test_an_export_process_that_breaks_the_protocol_is_replaced_not_believed(bad) -> None:
    """A taken-over export process could send garbage (which must not stop the worker's
    progress thread) or a second agent report (whose metadata would send decode workers
    elsewhere): either ends it, and the worker's next poll starts another."""
    rfd, wfd = os.pipe()
    os.set_blocking(rfd, False)
    proc = subprocess.Popen(["sleep", "60"])
    child = _Child(proc, rfd)
    try:
        ready = ExportReady("P-prefill-0", b"metadata", 0x1000, 0x9000, True)
        frames = [ready, ExportNotifs([("D-0", b"done")])]
        data = b"".join(_HEADER.pack(len(f)) + f for f in map(_encoder.encode, frames))
        if bad == "ready again":
            bad = _encoder.encode(ExportReady("P-prefill-0", b"elsewhere", 0x2000, 0xA000, True))
        os.write(wfd, data + _HEADER.pack(len(bad)) + bad + data)
        got = ExportedTransport._read(child)
        assert got == frames and child.ready == ready  # what came before, then nothing
        assert child.eof and child.failed and proc.wait(10) < 0  # killed
    finally:
        proc.kill()
        proc.wait()
        os.close(rfd)
        os.close(wfd)
