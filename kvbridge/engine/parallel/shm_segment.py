"""The shared-memory segment behind `ShmCommunicator`: its layout, creation and cleanup.

A segment is a file in /dev/shm mapped by every rank of one tp group. Layout (bytes;
every region starts on a 64-byte boundary, each rank's control block on its own lines):

    offset                              size              content
    0                                   4096              header: magic, version,
                                                          world_size, slot_bytes,
                                                          abort (0, or rank + 1),
                                                          woken seq of wake FIFO 0, 1
    4096 + r*CTRL_BYTES                 CTRL_BYTES        control block of rank r:
                                                          [0] pid, [1] arrived seq,
                                                          [2] sleeping seq,
                                                          [8:] abort reason (utf-8)
    data_offset + (b*W + r)*slot_stride slot_stride       slot of rank r in buffer b
                                                          (b = seq % 2): 64-byte slot
                                                          header [seq, op, nbytes,
                                                          dtype], then slot_bytes data

Beside the file, two FIFOs `<name>.wake0` and `<name>.wake1` (one per buffer) let
waiting ranks sleep until the last rank arrives (see shm_sync.py).

`max_bytes` (slot_bytes) bounds one collective's bytes per rank; larger tensors are
split into slot-sized pieces by the communicator. Memory: 2 * world_size slots.

Lifetime: the creator makes the file (unique name); ranks attach by name; once every
rank has attached, rank 0 unlinks the file (the mappings stay valid), so a crash after
start-up leaks nothing. The creator also unlinks on `close()` and at interpreter exit,
which covers a group that never finished starting.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import weakref
from pathlib import Path

import numpy as np

from kvbridge.engine.parallel.errors import CommError, CommUsageError

SHM_DIR = Path("/dev/shm")
MAGIC = int.from_bytes(b"KVBSHM01", "little")
VERSION = 2
HEADER_BYTES = 4096
CTRL_BYTES = 256  # four cache lines: no false sharing between ranks' flags
SLOT_HEADER_BYTES = 64
REASON_BYTES = CTRL_BYTES - 64
NUM_BUFFERS = 2  # double buffering: see the protocol in shm_comm.py
DEFAULT_MAX_BYTES = 4 << 20

# header int64 indices
H_MAGIC, H_VERSION, H_WORLD, H_SLOT_BYTES, H_ABORT, H_WOKEN = range(6)  # H_WOKEN + buffer
# control block int64 indices
C_PID, C_ARRIVED, C_SLEEPING = 0, 1, 2
#: the wake FIFOs beside a segment file, one per buffer
WAKE_SUFFIXES = (".wake0", ".wake1")
# slot header int64 indices
S_SEQ, S_OP, S_NBYTES, S_DTYPE = range(4)


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class SegmentLayout:
    """Offsets of one segment; identical in every process that maps it."""

    def __init__(self, world_size: int, slot_bytes: int) -> None:
        if world_size < 1:
            raise CommUsageError(f"world_size={world_size} must be >= 1")
        if slot_bytes < 64:
            raise CommUsageError(f"max_bytes={slot_bytes} must be >= 64")
        self.world_size = world_size
        self.slot_bytes = _round_up(slot_bytes, 64)
        self.ctrl_offset = HEADER_BYTES
        self.data_offset = _round_up(HEADER_BYTES + world_size * CTRL_BYTES, 4096)
        self.slot_stride = SLOT_HEADER_BYTES + self.slot_bytes
        self.total_bytes = self.data_offset + NUM_BUFFERS * world_size * self.slot_stride

    def slot_offset(self, buffer: int, rank: int) -> int:
        return self.data_offset + (buffer * self.world_size + rank) * self.slot_stride


def sweep_stale_segments() -> list[str]:
    """Remove kvbridge files in /dev/shm whose creator process is gone; returns their names.

    Names carry the creator's pid (kvbridge-<kind>-<pid>-<token>). Files are unlinked as
    soon as every rank attached, so one that outlived its creator belongs to a group that
    never finished starting (all its processes were killed): nobody can use it any more.
    """
    removed = []
    for path in SHM_DIR.glob("kvbridge-*-*-*"):
        parts = path.name.split("-")
        if len(parts) != 4 or not parts[2].isdigit():
            continue
        if not is_process_alive(int(parts[2])):
            unlink_segment(path.name)
            removed.append(path.name)
    return removed


def create_segment_file(world_size: int, max_bytes: int) -> str:
    """Create and initialise a segment file; returns its name (not path). Caller unlinks."""
    layout = SegmentLayout(world_size, max_bytes)
    sweep_stale_segments()
    name = f"kvbridge-comm-{os.getpid()}-{secrets.token_hex(6)}"
    path = SHM_DIR / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        for suffix in WAKE_SUFFIXES:
            os.mkfifo(SHM_DIR / f"{name}{suffix}", 0o600)
        os.ftruncate(fd, layout.total_bytes)
        with mmap.mmap(fd, HEADER_BYTES) as mm:
            header = np.ndarray((8,), dtype=np.int64, buffer=mm)
            header[H_VERSION] = VERSION
            header[H_WORLD] = world_size
            header[H_SLOT_BYTES] = layout.slot_bytes
            header[H_ABORT] = 0
            # magic last: an attacher that sees it sees a complete header
            header[H_MAGIC] = MAGIC
            del header
    except BaseException:
        os.close(fd)
        unlink_segment(name)
        raise
    os.close(fd)
    return name


def unlink_segment(name: str) -> None:
    """Remove a segment's file and its wake FIFOs if still there (idempotent)."""
    for suffix in ("", *WAKE_SUFFIXES):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_DIR / f"{name}{suffix}")


class ShmSegment:
    """A segment created by a process that may not be a rank itself (e.g. the driver).

    Owned by its creator; `close()` (and interpreter exit) unlinks the file if the
    ranks have not done so already. Pass `name` to every rank's `ShmCommunicator`.
    """

    def __init__(self, world_size: int, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.world_size = world_size
        self.max_bytes = max_bytes
        self.name = create_segment_file(world_size, max_bytes)
        self._finalizer = weakref.finalize(self, unlink_segment, self.name)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> ShmSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def map_segment(name: str, world_size: int) -> tuple[mmap.mmap, SegmentLayout]:
    """Map an existing segment and check it was made for `world_size` ranks."""
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise CommError(
            f"shared-memory segment {path} does not exist; it is created by the group's "
            "creator and removed once all ranks attached (was the group already started?)"
        ) from None
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    header = np.ndarray((8,), dtype=np.int64, buffer=mm)
    magic, version, seg_world, slot_bytes = (int(v) for v in header[:4])
    del header
    if magic != MAGIC or version != VERSION:
        mm.close()
        raise CommError(f"{path} is not a kvbridge v{VERSION} communicator segment")
    if seg_world != world_size:
        mm.close()
        raise CommError(
            f"world_size={world_size} but segment {name} was created for {seg_world} ranks"
        )
    layout = SegmentLayout(seg_world, slot_bytes)
    if layout.total_bytes != size:
        mm.close()
        raise CommError(f"segment {name} has {size} bytes, expected {layout.total_bytes}")
    return mm, layout


def is_process_alive(pid: int) -> bool:
    """True while `pid` runs. A zombie (exited, not yet reaped) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        # no /proc: fall back to a signal-0 probe (cannot tell zombies apart)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    # "pid (comm) S ..." — comm may contain spaces or parentheses, so split at the last ')'
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X", b"x")
