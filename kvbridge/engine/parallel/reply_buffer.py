"""Shared-memory buffers for large call payloads and replies between driver and workers.

Pipes move a few hundred MB/s on a busy 2-core host, and a pipe write blocks once its
64 KiB fill up. So bytes of at least `SHM_MIN_BYTES` travel through shared memory and
only their length goes through the pipe:

- `CallBuffer` (one per group): the driver writes a call's payload once for all workers;
  each worker copies it out when it reads the CALL frame and then sets its `consumed`
  word. The driver reuses the buffer only when every worker has consumed the last one
  (it handles replies meanwhile, so nothing can deadlock).
- `ReplyBuffer` (one per worker): the worker writes a large reply there if the driver
  has copied out the previous one (`consumed` == its seq), else it falls back to the
  pipe: a worker never waits for the driver.

    offset              size        content
    0                   8 * slots   consumed words (seq of the last payload taken out;
                                    CallBuffer: one per rank; ReplyBuffer: one)
    data_offset (64k)   capacity    the bytes

Ordering as in shm_sync.py: data, fence, then the pipe frame; frame, data, fence, then
the consumed word.
"""

from __future__ import annotations

import mmap
import os
import secrets
import weakref

from kvbridge.engine.parallel.errors import ParallelError
from kvbridge.engine.parallel.shm_segment import SHM_DIR, unlink_segment
from kvbridge.engine.parallel.shm_sync import memory_fence

SHM_MIN_BYTES = 64 << 10
DEFAULT_REPLY_MAX_BYTES = 64 << 20
DEFAULT_CALL_MAX_BYTES = 16 << 20


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class _SharedBytes:
    """A file-backed mapping with `slots` consumed words and a data area."""

    def __init__(self, name: str, mm: mmap.mmap, slots: int) -> None:
        self.name = name
        self.data_offset = _round_up(8 * slots, 64)
        self.capacity = len(mm) - self.data_offset
        self._mm = mm
        self._words = memoryview(mm).cast("q")
        self.last_seq = 0  # writer side: seq of the last payload written here

    @classmethod
    def _create_file(cls, kind: str, slots: int, capacity: int) -> tuple[str, mmap.mmap]:
        name = f"kvbridge-{kind}-{os.getpid()}-{secrets.token_hex(6)}"
        size = _round_up(8 * slots, 64) + capacity
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            return name, mmap.mmap(fd, size)
        finally:
            os.close(fd)

    @staticmethod
    def _map_file(name: str) -> mmap.mmap:
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        try:
            return mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def _write(self, seq: int, data: bytes) -> None:
        self._mm[self.data_offset : self.data_offset + len(data)] = data
        memory_fence()
        self.last_seq = seq

    def _read(self, slot: int, seq: int, nbytes: int) -> bytes:
        if not 0 <= nbytes <= self.capacity:
            raise ParallelError(f"{self.name}: {nbytes} bytes exceed its {self.capacity}")
        memory_fence()
        data = self._mm[self.data_offset : self.data_offset + nbytes]
        memory_fence()
        self._words[slot] = seq
        return data

    def close(self) -> None:
        """Unmap and remove the file if still there; idempotent."""
        if not self._mm.closed:
            self._words.release()
            self._mm.close()
        unlink_segment(self.name)


class CallBuffer(_SharedBytes):
    """The driver's buffer for large call payloads, read by every worker."""

    def __init__(self, name: str, mm: mmap.mmap, world_size: int) -> None:
        super().__init__(name, mm, world_size)
        self.world_size = world_size

    @classmethod
    def create(cls, world_size: int, capacity: int) -> CallBuffer:
        name, mm = cls._create_file("call", world_size, capacity)
        buffer = cls(name, mm, world_size)
        weakref.finalize(buffer, unlink_segment, name)
        return buffer

    @classmethod
    def attach(cls, name: str, world_size: int) -> CallBuffer:
        return cls(name, cls._map_file(name), world_size)

    def is_free(self) -> bool:
        """Driver side: every worker took out the last payload."""
        return all(self._words[r] == self.last_seq for r in range(self.world_size))

    def write(self, seq: int, data: bytes) -> None:
        """Driver side; call only when `is_free()`."""
        assert self.is_free(), "CallBuffer overwritten before every worker read it"
        self._write(seq, data)

    def read(self, rank: int, seq: int, nbytes: int) -> bytes:
        """Worker side: copy out the payload of call `seq` and mark it consumed."""
        return self._read(rank, seq, nbytes)


class ReplyBuffer(_SharedBytes):
    """One worker's buffer for large replies, read by the driver."""

    @classmethod
    def create(cls, capacity: int) -> ReplyBuffer:
        name, mm = cls._create_file("reply", 1, capacity)
        buffer = cls(name, mm, 1)
        weakref.finalize(buffer, unlink_segment, name)
        return buffer

    @classmethod
    def attach(cls, name: str) -> ReplyBuffer:
        return cls(name, cls._map_file(name), 1)

    def try_write(self, seq: int, data: bytes) -> bool:
        """Worker side: store the reply to call `seq` if it fits and the driver took the
        previous one; False means "send it through the pipe"."""
        if len(data) > self.capacity or self._words[0] != self.last_seq:
            return False
        self._write(seq, data)
        return True

    def read(self, seq: int, nbytes: int) -> bytes:
        """Driver side: copy out the reply to call `seq`, freeing the buffer."""
        return self._read(0, seq, nbytes)
