"""`kvbridge.vllm.launch.stop` removes the shared memory vLLM's ended processes left (its
shm_broadcast segments, multiprocessing's semaphores, the CPU backend's tp buffers), and
only that."""

from __future__ import annotations

import mmap

from kvbridge.vllm.launch import remove_orphaned_shm, vllm_shm_files


def test_only_new_unused_vllm_files_are_removed(tmp_path) -> None:
    for name in ("psm_old", "psm_left", "psm_mapped", "sem.mp-left", "vllm_dist_x-tp", "other"):
        (tmp_path / name).write_bytes(b"\0" * 4096)
    before = {"psm_old"}
    with open(tmp_path / "psm_mapped", "r+b") as f:  # another instance still uses it
        live = mmap.mmap(f.fileno(), 4096)
    try:
        removed = ["psm_left", "sem.mp-left", "vllm_dist_x-tp"]
        assert remove_orphaned_shm(before, tmp_path) == removed
        assert vllm_shm_files(tmp_path) == {"psm_old", "psm_mapped"}
        assert (tmp_path / "other").exists()
    finally:
        live.close()
