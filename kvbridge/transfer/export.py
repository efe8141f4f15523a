"""KV export: peers read a prefill worker's KV from a process that holds nothing else.

On the software transports used on CPU (same host: CMA; across hosts: UCX over TCP)
UCX does not enforce registration bounds: a peer holding an agent's metadata can read
(and write) any address of the agent's process, and a READ of an unmapped address over
TCP crashes it. So a prefill worker does not give peers its own agent. Its cache lives in
a shared-memory segment (`SharedSegment`, a memfd), and a small *export process* per
worker maps that segment read-only and runs the NIXL agent peers read from
(`ExportedTransport`). What a peer can address there is the exported KV, the export
process's own Python and NIXL state, and nothing of the worker: no secret (its
environment is scrubbed and it is never given the token), no prompt, no weights, no other
request's state than KV. The mapping is read-only (from a read-only descriptor: it cannot
be made writable), so a WRITE into it fails (CMA) or crashes the export process (TCP);
a crash fails only the pulls reading from it at that moment, and the worker starts a new
export process at its next poll (new agent name and metadata: a decode worker whose READ
fails meets the producer afresh). A peer may still write into the export process's own
memory on these transports; once its agent is up the export process runs under a seccomp
filter (`sandbox.py`) that refuses opening files, running programs and reaching other
processes, so taking it over leads nowhere else.

The export process is passive: the worker asks it to poll its agent at the worker's own
cadence (`notifs`, as it polled its own agent before), and it answers with the
notifications that arrived (decode workers' ReadDones). Between polls it blocks on its
control pipe: no spin, no CPU when idle. Wire: the start-up settings as typed JSON on
its command line (no secret in them), frames of typed msgpack on a pipe of its own
(never pickle); it ends when its control pipe closes (the worker closed it or died).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import select
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvbridge.transfer.agent import XferState
from kvbridge.transfer.errors import TransferError
from kvbridge.transfer.fence import SLOTS
from kvbridge.transfer.regions import CacheRegions, MemType

log = logging.getLogger("kvbridge.transfer.export")

#: How long a worker waits for a new export process to report its agent.
START_TIMEOUT_S = 60.0
#: Most bytes one frame from the export process may hold (its agent metadata is ~1 KiB).
MAX_FRAME_BYTES = 16 << 20
#: Most notifications one frame carries (the rest follow in the next).
MAX_NOTIFS_PER_FRAME = 4096
#: Environment variables an export process inherits (UCX's and NIXL's settings, what
#: finds Python and its libraries); nothing else, so no secret passed by environment.
_ENV_PREFIXES = ("UCX_", "NIXL_")
_ENV_NAMES = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "HOME", "TMPDIR", "LANG")
_HEADER = struct.Struct("<I")
#: `SharedSegment.adopt` moves only buffers at least this large (an allocator gives them
#: pages of their own: glibc maps anything above its largest mmap threshold, 32 MiB,
#: apart, unless its heap has that much free), or whose both ends are page-aligned, and
#: never the heap's pages (`heap_range`)
ADOPT_MIN_BYTES = 32 << 20
_MAP_FIXED = 0x10


def heap_range() -> tuple[int, int] | None:
    """This process's heap (the brk area, "[heap]" in /proc/self/maps), or None where
    there is none to read. glibc serves even a buffer over its mmap threshold from there
    when the heap holds that much freed memory (after large buffers were freed: the
    threshold rises to their size), and grows and trims the heap in place: pages of it
    replaced by another mapping break that."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if line.rstrip().endswith("[heap]"):
                    lo, hi = line.split()[0].split("-")
                    return int(lo, 16), int(hi, 16)
    except OSError:
        return None
    return None


class SharedSegment:
    """`size` bytes of shared memory (a memfd), mapped read-write in this process as
    `array` (uint8); an export process maps the same pages read-only. The pages are
    zero-filled and touched here (copies into never-touched pages are slow)."""

    def __init__(self, size: int, name: str = "kvbridge-kv") -> None:
        if size <= 0:
            raise TransferError(f"a shared KV segment needs a positive size; got {size}")
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        self._map: mmap.mmap | None
        try:
            os.ftruncate(self.fd, size)
            self._map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
        except OSError as exc:
            os.close(self.fd)
            raise TransferError(f"cannot map {size} bytes of shared memory: {exc}") from exc
        if hasattr(mmap, "MADV_HUGEPAGE"):  # huge pages where the host allows them for
            self._map.madvise(mmap.MADV_HUGEPAGE)  # shared memory (docs/benchmarks.md)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.array.fill(0)

    @classmethod
    def adopt(cls, address: int, nbytes: int, name: str = "kvbridge-kv") -> SharedSegment:
        """Move `nbytes` of this process's memory at `address` (an engine's KV cache that
        it allocated itself and keeps, e.g. vLLM's) into shared memory in place: the same
        addresses and bytes, now backed by a memfd an export process can map. Whole pages
        move, so up to a page of neighbouring bytes on each side goes with it (for a
        buffer the allocator gave pages of its own, as glibc does for large ones, only
        its header). Call before anything else uses the memory (a write by another
        thread between the copy and the remap would be lost)."""
        import ctypes

        page = mmap.PAGESIZE
        start, end = address // page * page, -(-(address + nbytes) // page) * page
        if nbytes < ADOPT_MIN_BYTES and (start != address or end != address + nbytes):
            raise TransferError(
                f"a buffer of {nbytes} bytes at {address:#x} may share pages with other "
                f"memory (it is smaller than {ADOPT_MIN_BYTES} bytes and not page-aligned), "
                "so it is not moved into shared memory"
            )
        heap = heap_range()
        if heap is not None and start < heap[1] and heap[0] < end:
            raise TransferError(
                f"a buffer of {nbytes} bytes at {address:#x} lies in the process's heap "
                f"({heap[0]:#x}-{heap[1]:#x}: the allocator served it from memory it had "
                "freed), whose pages the allocator keeps using and may give back, so it is "
                "not moved into shared memory; allocate it before other large buffers are "
                "freed, or with mmap"
            )
        seg = cls.__new__(cls)
        seg.size = end - start
        seg.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(seg.fd, seg.size)
            view = memoryview((ctypes.c_char * seg.size).from_address(start)).cast("B")
            done = 0
            while done < seg.size:  # the current bytes, then the pages replaced by them
                done += os.pwrite(seg.fd, view[done : done + (1 << 30)], done)
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            libc.mmap.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
            rw, shared = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED
            got = libc.mmap(start, seg.size, rw, shared, seg.fd, 0)
            if got != start:
                err = ctypes.get_errno()
                raise OSError(err, f"mmap(MAP_FIXED) at {start:#x}: {os.strerror(err)}")
        except OSError as exc:
            os.close(seg.fd)
            raise TransferError(
                f"cannot move {nbytes} bytes at {address:#x} into shared memory: {exc}"
            ) from exc
        seg._map = None
        if hasattr(mmap, "MADV_HUGEPAGE"):
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(seg.size), mmap.MADV_HUGEPAGE)
        seg.array = np.ctypeslib.as_array((ctypes.c_uint8 * seg.size).from_address(start))
        return seg

    @property
    def base(self) -> int:
        return int(self.array.ctypes.data)

    def offsets(self, regions: CacheRegions) -> list[tuple[int, int]]:
        """(offset, length) of each of `regions` in this segment; TransferError if one
        lies outside it."""
        out = []
        for addr, length in zip(regions.addresses, regions.lengths, strict=True):
            off = addr - self.base
            if off < 0 or off + length > self.size:
                raise TransferError(
                    f"cache region at {addr:#x} ({length} bytes) is not in the shared KV "
                    f"segment [{self.base:#x}, +{self.size}); allocate the cache from it"
                )
            out.append((off, length))
        return out


class ExportInit(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The export process's settings (its command line: no secret in them)."""

    agent_name: str
    size: int  # the segment's, registered whole (the cache regions lie in it)
    fd: int  # the segment's memfd, opened read-only, inherited
    events_fd: int  # the pipe it writes frames to, inherited
    fence_fd: int  # the worker's fence words (`fence.py`): a memfd opened read-only
    fence_size: int
    net_device: str | None = None
    backend_params: dict[str, str] = {}


class ExportReady(msgspec.Struct, frozen=True, tag="ready"):
    agent_name: str
    metadata: bytes
    base: int  # where the segment is mapped in the export process
    fence_base: int  # where the fence words are mapped there
    sandboxed: bool  # its seccomp filter is installed (`sandbox.py`)


class ExportFailed(msgspec.Struct, frozen=True, tag="failed"):
    reason: str


class ExportNotifs(msgspec.Struct, frozen=True, tag="notifs"):
    items: list[tuple[str, bytes]]  # (sender agent, notification), in arrival order


ExportEvent = ExportReady | ExportFailed | ExportNotifs
_decoder = msgspec.msgpack.Decoder(ExportEvent)
_encoder = msgspec.msgpack.Encoder()


@dataclass
class _Child:
    proc: subprocess.Popen[bytes]
    events: int  # read end of its events pipe (non-blocking)
    buf: bytearray = field(default_factory=bytearray)
    ready: ExportReady | None = None
    failed: str = ""
    eof: bool = False


class ExportedTransport:
    """The producer-side `Transport` of a worker whose cache is in `segment`: peers read
    from an export process's agent, which registers the whole segment (see the module
    docstring); `peer_regions` says where a region of it lies there. Only what a producer
    uses is served (`metadata`, `notifs`, `peer_regions`, `close`); a producer never
    reads, so the reading methods raise.

    Args:
        name: agent name; the n-th restart's agent is named ``{name}.{n}``.
        regions: the worker's cache regions, all inside `segment`.
        segment: the shared memory holding them.
        backend_params, net_device: as for `NixlTransport`.
    """

    def __init__(
        self,
        name: str,
        regions: CacheRegions,
        segment: SharedSegment,
        backend_params: dict[str, str] | None = None,
        net_device: str | None = None,
    ) -> None:
        if regions.mem_type is not MemType.DRAM:
            raise TransferError("kv_export=process exports host memory (DRAM) only")
        self.regions = regions
        self._segment = segment
        segment.offsets(regions)  # all inside it
        # what the export process gets: the segment opened read-only, so no mapping of
        # it there can ever be made writable (mprotect checks the file's mode)
        self._ro_fd = os.open(f"/proc/self/fd/{segment.fd}", os.O_RDONLY | os.O_CLOEXEC)
        # the fence words the worker writes, exported beside the KV (`fence.py`)
        self._fence = SharedSegment(SLOTS * 8, "kvbridge-fence")
        self._fence_ro_fd = os.open(f"/proc/self/fd/{self._fence.fd}", os.O_RDONLY | os.O_CLOEXEC)
        self._base_name = name
        self._backend_params = dict(backend_params or {})
        self._net_device = net_device
        self.num_restarts = 0
        try:
            self._child = self._start(name)
        except BaseException:
            os.close(self._ro_fd)
            os.close(self._fence_ro_fd)
            os.close(self._fence.fd)
            raise
        self.name = name

    # -- Transport ------------------------------------------------------------------------
    # `name`, `metadata` and `peer_regions` describe the same export process until the
    # next `notifs` (the only call that replaces a dead one), so a Welcome built from
    # them never mixes two processes' agent and addresses.
    def metadata(self) -> bytes:
        assert self._child.ready is not None
        return self._child.ready.metadata

    def peer_regions(self, regions: CacheRegions) -> CacheRegions:
        """Where peers read `regions`: the same offsets of the export process's mapping."""
        assert self._child.ready is not None
        base = self._child.ready.base
        offs = self._segment.offsets(regions)
        return CacheRegions(tuple(base + o for o, _ in offs), regions.lengths, regions.mem_type, 0)

    def fence_words(self) -> tuple[np.ndarray, int]:
        """The worker's fence words (written here) and where peers read them: the
        export process's mapping of them."""
        assert self._child.ready is not None
        return self._fence.array.view(np.uint64), self._child.ready.fence_base

    def notifs(self) -> dict[str, list[bytes]]:
        """Ask the export process to poll its agent; take the notifications it sent so
        far. A dead export process is replaced first (logged with its exit status)."""
        self._check()
        try:
            os.write(self._child.proc.stdin.fileno(), b"p")  # type: ignore[union-attr]
        except BlockingIOError:
            pass  # it has polls queued already
        except OSError:
            self._child.eof = True
        out: dict[str, list[bytes]] = {}
        for ev in self._read(self._child):
            if isinstance(ev, ExportNotifs):
                for sender, msg in ev.items:
                    out.setdefault(sender, []).append(msg)
        return out

    def close(self) -> None:
        _stop(self._child)
        if self._ro_fd >= 0:
            os.close(self._ro_fd)
            os.close(self._fence_ro_fd)
            os.close(self._fence.fd)  # its pages go with the mapping
            self._ro_fd = -1

    def add_peer(self, metadata: bytes) -> str:
        raise self._producer_only("add_peer")

    def remove_peer(self, peer: str) -> None:
        raise self._producer_only("remove_peer")

    def register(self, regions: CacheRegions) -> None:
        raise self._producer_only("register")

    def prep_local(self, descs: np.ndarray, mem_type: MemType | None = None) -> Any:
        raise self._producer_only("prep_local")

    def prep_remote(self, peer: str, descs: np.ndarray, mem_type: MemType) -> Any:
        raise self._producer_only("prep_remote")

    def release_dlist(self, handle: Any) -> None:
        raise self._producer_only("release_dlist")

    def read(
        self, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray, notif: bytes
    ) -> tuple[Any, XferState]:
        raise self._producer_only("read")

    def state(self, xfer: Any) -> XferState:
        raise self._producer_only("state")

    def release(self, xfer: Any) -> bool:
        raise self._producer_only("release")

    def send_notif(self, peer: str, msg: bytes) -> None:
        raise self._producer_only("send_notif")

    @property
    def pid(self) -> int:
        """The export process's pid (for tests and logs)."""
        return int(self._child.proc.pid)

    # -- internals -------------------------------------------------------------------------
    def _producer_only(self, what: str) -> TransferError:
        return TransferError(f"{what}: an exported KV transport serves peers' READs only")

    def _check(self) -> None:
        """Replace the export process if it ended."""
        child = self._child
        if child.proc.poll() is None and not child.eof:
            return
        status = _exit_status(child)
        self.num_restarts += 1
        name = f"{self._base_name}.{self.num_restarts}"
        log.warning(
            "the KV export process of %s ended (%s); pulls reading from it fail and are "
            "recomputed; starting a new one as %s",
            self._base_name,
            status,
            name,
        )
        _stop(child)
        self._child = self._start(name)
        self.name = name

    def _start(self, name: str) -> _Child:
        rfd, wfd = os.pipe()
        init = ExportInit(
            agent_name=name,
            size=self._segment.size,
            fd=self._ro_fd,
            events_fd=wfd,
            fence_fd=self._fence_ro_fd,
            fence_size=self._fence.size,
            net_device=self._net_device,
            backend_params=self._backend_params,
        )
        env = {
            k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES
        }
        # Over TCP, UCX opens /sys/class/net/IF and /proc/net/route at each new connection
        # (the interface's topology and speed); the sandbox refuses the opens, and UCX
        # logs a warning and an error each time and goes on with its defaults. Only its
        # fatal errors show here (a peer's failures show on the peer); a user's level wins.
        env.setdefault("UCX_LOG_LEVEL", "fatal")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvbridge.transfer.export", msgspec.json.encode(init)],
                stdin=subprocess.PIPE,
                stdout=2,  # UCX may log to stdout: onto our stderr, off any pipe of ours
                pass_fds=(self._ro_fd, self._fence_ro_fd, wfd),
                env=env,
            )
        except OSError as exc:
            os.close(rfd)
            raise TransferError(f"cannot start the KV export process: {exc}") from exc
        finally:
            os.close(wfd)
        assert proc.stdin is not None
        os.set_blocking(proc.stdin.fileno(), False)
        os.set_blocking(rfd, False)
        child = _Child(proc, rfd)
        deadline = time.monotonic() + START_TIMEOUT_S
        while child.ready is None:
            for ev in self._read(child, wait_s=0.05):
                if isinstance(ev, ExportFailed):
                    child.failed = ev.reason
                elif isinstance(ev, ExportReady) and not ev.sandboxed:
                    log.warning(
                        "the KV export process %s runs without its seccomp filter (no filter "
                        "for this machine, %s): a peer that takes it over may open files "
                        "and reach other processes of this user",
                        name,
                        os.uname().machine,
                    )
            if child.failed or child.eof or proc.poll() is not None:
                reason = child.failed or _exit_status(child)
                _stop(child)
                raise TransferError(
                    f"the KV export process {name!r} failed to start: {reason}; "
                    "kv_export='inline' (--kv-export inline) lets peers read from the "
                    "worker's own agent instead"
                )
            if time.monotonic() > deadline:
                _stop(child)
                raise TransferError(
                    f"the KV export process {name!r} did not report its agent within "
                    f"{START_TIMEOUT_S:g} s"
                )
        return child

    @staticmethod
    def _read(child: _Child, wait_s: float = 0.0) -> list[ExportEvent]:
        """Frames `child` wrote so far (waiting up to `wait_s` for the first bytes)."""
        if wait_s and not child.buf:
            select.select([child.events], [], [], wait_s)
        while True:
            try:
                data = os.read(child.events, 1 << 16)
            except BlockingIOError:
                break
            if not data:
                child.eof = True
                break
            child.buf += data
        out: list[ExportEvent] = []
        while len(child.buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(child.buf)
            if n > MAX_FRAME_BYTES:
                _broke_protocol(child, f"sent a frame of {n} bytes (at most {MAX_FRAME_BYTES})")
                break
            if len(child.buf) < _HEADER.size + n:
                break
            frame = bytes(child.buf[_HEADER.size : _HEADER.size + n])
            del child.buf[: _HEADER.size + n]
            try:
                ev = _decoder.decode(frame)
            except msgspec.DecodeError as exc:
                _broke_protocol(child, f"sent a malformed frame ({exc})")
                break
            if isinstance(ev, ExportReady) and child.ready is not None:
                _broke_protocol(child, "reported its agent twice")  # never believed
                break
            if isinstance(ev, ExportReady):
                child.ready = ev
            out.append(ev)
        return out


def _broke_protocol(child: _Child, reason: str) -> None:
    """`child` broke the pipe's protocol: it is killed and replaced, never believed."""
    child.failed = reason
    child.eof = True
    child.proc.kill()


def _exit_status(child: _Child) -> str:
    code = child.proc.poll()
    if code is None:
        return child.failed or "its event pipe closed"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}" + (f": {child.failed}" if child.failed else "")


def _stop(child: _Child) -> None:
    """End `child` (closing its control pipe ends it; killed if it does not) and close
    our end of its pipes."""
    if child.proc.stdin is not None and not child.proc.stdin.closed:
        with contextlib.suppress(OSError):
            child.proc.stdin.close()
    try:
        child.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        child.proc.kill()
        child.proc.wait(timeout=5)
    if child.events >= 0:
        os.close(child.events)
        child.events = -1


# -- the export process ---------------------------------------------------------------------
def _send(fd: int, ev: ExportEvent) -> None:
    data = _encoder.encode(ev)
    data = _HEADER.pack(len(data)) + data
    while data:
        data = data[os.write(fd, data) :]


def main(argv: list[str]) -> int:
    """The export process: map the segment read-only, register it, report the agent,
    then poll the agent whenever asked until the control pipe (stdin) closes."""
    import resource

    init = msgspec.json.decode(argv[1].encode(), type=ExportInit)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash leaves no core of the KV
    try:
        from kvbridge.transfer.agent import NixlTransport

        seg = mmap.mmap(init.fd, init.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        os.close(init.fd)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # map the worker's huge pages as such
            seg.madvise(mmap.MADV_HUGEPAGE)
        view = np.frombuffer(seg, dtype=np.uint8)
        int(view[:: mmap.PAGESIZE].sum())  # map every page now, not at peers' first READs
        base = int(view.ctypes.data)
        fence = mmap.mmap(
            init.fence_fd, init.fence_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ
        )
        os.close(init.fence_fd)
        fence_base = int(np.frombuffer(fence, dtype=np.uint8).ctypes.data)
        agent = NixlTransport(
            init.agent_name,
            CacheRegions((base, fence_base), (init.size, init.fence_size)),
            init.backend_params,
            init.net_device,
        )
        metadata = agent.metadata()
        from kvbridge.transfer.sandbox import deny_escape

        sandboxed = deny_escape()  # from here on: no file opened, no other process reached
        _send(init.events_fd, ExportReady(init.agent_name, metadata, base, fence_base, sandboxed))
    except Exception as exc:
        _send(init.events_fd, ExportFailed(f"{type(exc).__name__}: {exc}"))
        return 1
    while True:
        try:
            asked = os.read(0, 4096)
        except InterruptedError:
            continue
        if not asked:  # the worker closed the pipe or died
            agent.close()
            return 0
        items = [(s, m) for s, msgs in agent.notifs().items() for m in msgs]
        for i in range(0, len(items), MAX_NOTIFS_PER_FRAME):
            try:
                _send(init.events_fd, ExportNotifs(items[i : i + MAX_NOTIFS_PER_FRAME]))
            except BrokenPipeError:
                return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
