"""Collectives among the tp workers of one host through a shared-memory segment.

Protocol of one collective (all ranks count collectives alike: seq = 2, 3, ...; the
connect barrier is seq 1), with buffer b = seq % 2 and W ranks:

    every rank r (writer side)              every rank r (reader side)
    1. copy its tensor -> slot[b][r].data
    2. slot[b][r].header = (seq, op, nbytes, dtype)
    3. fence
    4. ctrl[r].arrived = seq  ------------> 5. wait until ctrl[j].arrived >= seq, all j
                                            6. fence
                                            7. check slot[b][j].header == (seq, op, ...)
                                            8. read slot[b][0..W-1] in rank order

Why two buffers and no "done reading" flags: rank r writes buffer b again at seq + 2
only after passing step 5 of seq + 1, i.e. after every rank arrived at seq + 1; a rank
arrives at seq + 1 only after it finished step 8 of seq. So nobody still reads buffer b
when it is overwritten, however ranks are delayed or preempted. The other buffer lets a
fast rank publish seq + 1 while slow ones still read seq. Step 7 turns any violation of
this (or an SPMD mismatch between ranks) into an error instead of silently stale data.

Ordering: x86-64 keeps stores in order and loads in order (TSO), and the fence (a lock
acquire/release, a locked instruction) also orders them on weaker CPUs. Flags are
aligned int64 written by one rank only, so their loads and stores are single-copy atomic.

Sums run in rank order 0, 1, ..., W-1 on every rank over the same bytes, so every rank
gets bit-identical results, the same on every run; half types accumulate in float32.

Waiting spins `spin_iters` polls, then yields the core (`os.sched_yield`, essential when
ranks outnumber cores), then sleeps briefly once a wait passes 20 ms. Every ~100 ms of
waiting it checks the pids of the ranks it waits for, so a dead peer fails the collective
within ~0.1-0.2 s; any failure aborts the group (a flag every waiter polls), so the other
ranks fail promptly too, naming the rank at the root of it.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time

import numpy as np
import torch

from kvbridge.engine.parallel.base import Communicator
from kvbridge.engine.parallel.errors import (
    CommError,
    CommMismatchError,
    CommTimeoutError,
    CommUsageError,
    PeerAbortedError,
    PeerDiedError,
)
from kvbridge.engine.parallel.shm_segment import (
    C_ARRIVED,
    C_PID,
    CTRL_BYTES,
    H_ABORT,
    REASON_BYTES,
    SLOT_HEADER_BYTES,
    is_process_alive,
    map_segment,
    unlink_segment,
)

OP_CONNECT, OP_BARRIER, OP_ALL_REDUCE, OP_ALL_GATHER, OP_BROADCAST = 1, 2, 3, 4, 5
_OP_NAMES = {1: "connect", 2: "barrier", 3: "all_reduce", 4: "all_gather", 5: "broadcast"}
#: dtype -> (code in slot headers, numpy dtype its bytes are moved as)
_DTYPES: dict[torch.dtype, tuple[int, type[np.generic]]] = {
    torch.float32: (1, np.float32),
    torch.bfloat16: (2, np.uint16),  # numpy has no bfloat16: move bits, sum in torch
    torch.float16: (3, np.float16),
    torch.int64: (4, np.int64),
    torch.int32: (5, np.int32),
    torch.uint8: (6, np.uint8),
}
_HEADER = struct.Struct("<4q")
PROBE_INTERVAL_S = 0.1
YIELD_PHASE_S = 0.02
MAX_SLEEP_S = 0.001

_fence_lock = threading.Lock()


def memory_fence() -> None:
    """A full memory barrier: acquiring an uncontended lock is a locked (fenced) instruction."""
    _fence_lock.acquire()
    _fence_lock.release()


class ShmCommunicator(Communicator):
    """Collectives over the `world_size` processes of one host, through `/dev/shm/<name>`.

    One instance per rank, created in that rank's process with the segment name its
    creator (`ShmSegment` or `make_communicator`) handed out. The constructor waits (up to
    `connect_timeout`) until every rank attached. Tensors: contiguous CPU tensors of
    float32, bfloat16, float16, int64, int32 or uint8, of any size: a tensor larger than
    `max_bytes` (the slot size the segment was made with) goes in slot-sized pieces, one
    collective each. Not thread-safe: one thread per rank calls the collectives.
    After any `CommError` the communicator (and the whole group) is unusable.
    """

    def __init__(
        self,
        name: str,
        rank: int,
        world_size: int,
        *,
        timeout: float = 60.0,
        connect_timeout: float | None = None,
        spin_iters: int = 16,
    ) -> None:
        if not 0 <= rank < world_size:
            raise CommUsageError(f"rank={rank} is outside [0, world_size={world_size})")
        if timeout <= 0:
            raise CommUsageError(f"timeout={timeout} must be > 0 seconds")
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.spin_iters = spin_iters
        self._broken: str | None = None
        self._seq = 0
        self._mm, layout = map_segment(name, world_size)
        self._layout = layout
        self.max_bytes = layout.slot_bytes
        # int64 words of the segment: flags are read and written one aligned word at a time
        self._words = memoryview(self._mm).cast("q")
        self._abort_word = H_ABORT
        ctrl_words = [(layout.ctrl_offset + r * CTRL_BYTES) // 8 for r in range(world_size)]
        self._pid_words = [w + C_PID for w in ctrl_words]
        self._arrived_words = [w + C_ARRIVED for w in ctrl_words]
        # slot_headers[b]: (W, 4) int64 view of the slot headers of buffer b
        self._slot_headers = [
            np.ndarray(
                (world_size, 4),
                dtype=np.int64,
                buffer=self._mm,
                offset=layout.slot_offset(b, 0),
                strides=(layout.slot_stride, 8),
            )
            for b in range(2)
        ]
        self._slot_bytes = [
            [
                np.ndarray(
                    (layout.slot_bytes,),
                    dtype=np.uint8,
                    buffer=self._mm,
                    offset=layout.slot_offset(b, r) + SLOT_HEADER_BYTES,
                )
                for r in range(world_size)
            ]
            for b in range(2)
        ]
        self._typed: dict[tuple[int, torch.dtype], list[np.ndarray]] = {}
        self._words[self._pid_words[rank]] = os.getpid()
        try:
            self._collective(OP_CONNECT, 0, 0, connect_timeout or timeout)
        except BaseException:
            unlink_segment(name)  # the group cannot start: leave no file behind
            self.close()
            raise
        if rank == 0:
            unlink_segment(name)  # every rank has it mapped now

    # ---- public collectives -------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        code = self._check_tensor(tensor, "all_reduce")
        if tensor.dtype == torch.uint8:
            raise CommUsageError("all_reduce of uint8 would overflow; use int32 or int64")
        for part in self._chunks(_flat_numpy(tensor)):
            views = self._views(self._seq + 1, tensor.dtype, part.size)
            np.copyto(views[self.rank], part)
            self._collective(OP_ALL_REDUCE, part.nbytes, code)
            _sum_in_rank_order(views, part, tensor.dtype)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        code = self._check_tensor(tensor, "all_gather")
        if tensor.dim() == 0:
            raise CommUsageError("all_gather of a 0-d tensor: unsqueeze it first")
        flat = _flat_numpy(tensor)
        gathered = np.empty((self.world_size, flat.size), dtype=flat.dtype)  # [rank, element]
        start = 0
        for part in self._chunks(flat):
            views = self._views(self._seq + 1, tensor.dtype, part.size)
            np.copyto(views[self.rank], part)
            self._collective(OP_ALL_GATHER, part.nbytes, code)
            for peer, view in enumerate(views):
                gathered[peer, start : start + part.size] = view
            start += part.size
        shape = tuple(tensor.shape)
        axis = dim % tensor.dim()
        if axis == 0:  # [rank, element] already is the concatenation along dim 0
            out = gathered.reshape((self.world_size * shape[0], *shape[1:]))
        else:
            out = np.concatenate([row.reshape(shape) for row in gathered], axis=axis)
        result = torch.from_numpy(out)
        return result.view(tensor.dtype) if tensor.dtype == torch.bfloat16 else result

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if not 0 <= src < self.world_size:
            raise CommUsageError(f"broadcast src={src} is outside [0, {self.world_size})")
        code = self._check_tensor(tensor, "broadcast")
        for part in self._chunks(_flat_numpy(tensor)):
            views = self._views(self._seq + 1, tensor.dtype, part.size)
            if self.rank == src:
                np.copyto(views[src], part)
            self._collective(OP_BROADCAST, part.nbytes, code)
            if self.rank != src:
                np.copyto(part, views[src])
        return tensor

    def barrier(self) -> None:
        self._check_usable()
        self._collective(OP_BARRIER, 0, 0)

    def abort(self, reason: str) -> None:
        """Give up on the group: every rank waiting in (or entering) a collective fails
        with a `PeerAbortedError` quoting `reason`. Call it when this rank will not make
        the collectives its peers expect (e.g. its handler raised). Idempotent."""
        if self._broken is None:
            self._broken = f"rank {self.rank} aborted the group: {reason}"
        if self._mm.closed:
            return
        raw = reason.encode("utf-8", "replace")[: REASON_BYTES - 1]
        start = self._reason_offset(self.rank)
        self._mm[start : start + len(raw) + 1] = raw + b"\0"
        memory_fence()
        if self._words[self._abort_word] == 0:
            self._words[self._abort_word] = self.rank + 1

    def close(self) -> None:
        if self._mm.closed:
            return
        self._broken = self._broken or "the communicator was closed"
        # drop every view of the mapping first, or mmap.close() refuses
        self._words.release()
        self._slot_headers = []
        self._slot_bytes = []
        self._typed = {}
        # BufferError: a caller still holds a view; the mapping goes with the last reference
        with contextlib.suppress(BufferError):
            self._mm.close()

    # ---- protocol -------------------------------------------------------------------

    def _reason_offset(self, rank: int) -> int:
        return self._layout.ctrl_offset + rank * CTRL_BYTES + 64

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise CommError(f"communicator rank {self.rank} is unusable: {self._broken}")

    def _check_tensor(self, tensor: torch.Tensor, what: str) -> int:
        self._check_usable()
        spec = _DTYPES.get(tensor.dtype)
        if spec is None:
            raise CommUsageError(
                f"{what} of dtype {tensor.dtype} is not supported; use one of "
                f"{', '.join(str(d) for d in _DTYPES)}"
            )
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise CommUsageError(
                f"{what} needs a contiguous CPU tensor, got device={tensor.device} "
                f"contiguous={tensor.is_contiguous()}; call .contiguous() first"
            )
        return spec[0]

    def _views(self, seq: int, dtype: torch.dtype, numel: int) -> list[np.ndarray]:
        """Every rank's slot in the buffer of collective `seq`, as 1-D arrays of `numel`."""
        key = (seq % 2, dtype)
        typed = self._typed.get(key)
        if typed is None:
            np_dtype = _DTYPES[dtype][1]
            typed = [slot.view(np_dtype) for slot in self._slot_bytes[seq % 2]]
            self._typed[key] = typed
        return [t[:numel] for t in typed]

    def _chunks(self, flat: np.ndarray) -> list[np.ndarray]:
        """`flat` in slot-sized pieces (views); an empty tensor is one empty piece, so
        every rank still makes the collective."""
        per = self.max_bytes // flat.itemsize
        return [flat[start : start + per] for start in range(0, max(flat.size, 1), per)]

    def _collective(
        self, op: int, nbytes: int, dtype_code: int, timeout: float | None = None
    ) -> None:
        """Steps 2-7 of the protocol for this rank's next collective (data already copied)."""
        self._seq += 1
        seq = self._seq
        try:
            headers = self._slot_headers[seq % 2]
            expected = (seq, op, nbytes, dtype_code)
            headers[self.rank] = expected
            memory_fence()
            self._words[self._arrived_words[self.rank]] = seq
            self._wait_arrived(seq, op, timeout or self.timeout)
            memory_fence()
            if headers.tobytes() != _HEADER.pack(*expected) * self.world_size:
                self._raise_mismatch(headers, expected)
        except CommError as exc:
            self.abort(str(exc))
            raise

    def _wait_arrived(self, seq: int, op: int, timeout: float) -> None:
        words = self._words
        for word in self._arrived_words:
            if words[word] >= seq:
                continue
            for _ in range(self.spin_iters):
                if words[word] >= seq:
                    break
            else:
                self._wait_slow(seq, op, timeout)
                return

    def _wait_slow(self, seq: int, op: int, timeout: float) -> None:
        words = self._words
        start = time.monotonic()
        next_probe = start + PROBE_INTERVAL_S
        sleep_s = 0.0001
        while any(words[word] < seq for word in self._arrived_words):
            if words[self._abort_word]:
                self._raise_aborted(seq, op)
            now = time.monotonic()
            if now >= next_probe:
                self._probe_peers(seq, op, now - start, timeout)
                next_probe = now + PROBE_INTERVAL_S
            if now - start < YIELD_PHASE_S:
                os.sched_yield()
            else:
                time.sleep(sleep_s)
                sleep_s = min(sleep_s * 2, MAX_SLEEP_S)

    def _probe_peers(self, seq: int, op: int, waited: float, timeout: float) -> None:
        missing = [r for r in range(self.world_size) if self._words[self._arrived_words[r]] < seq]
        for peer in missing:
            pid = self._words[self._pid_words[peer]]
            if pid and not is_process_alive(pid):
                raise PeerDiedError(
                    f"rank {self.rank}: {_OP_NAMES[op]} #{seq} cannot complete: "
                    f"rank {peer} (pid {pid}) died",
                    rank=peer,
                )
        if waited >= timeout and missing:
            raise CommTimeoutError(
                f"rank {self.rank}: {_OP_NAMES[op]} #{seq} timed out after {timeout:.1f} s "
                f"waiting for ranks {missing} (timeout={timeout} s); are all ranks making "
                "the same collectives?",
                missing_ranks=missing,
            )

    def _raise_aborted(self, seq: int, op: int) -> None:
        peer = self._words[self._abort_word] - 1
        start = self._reason_offset(peer)
        raw = bytes(self._mm[start : start + REASON_BYTES])
        reason = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
        raise PeerAbortedError(
            f"rank {self.rank}: {_OP_NAMES[op]} #{seq} cannot complete: rank {peer} "
            f"aborted the group: {reason}",
            rank=peer,
        )

    def _raise_mismatch(self, headers: np.ndarray, expected: tuple[int, int, int, int]) -> None:
        seq, op, nbytes, code = expected
        for peer in range(self.world_size):
            got = tuple(int(v) for v in headers[peer])
            if got[0] != seq:
                raise CommError(
                    f"rank {self.rank}: slot of rank {peer} holds collective #{got[0]} "
                    f"while #{seq} was expected (protocol violation)"
                )
            if got != expected:
                raise CommMismatchError(
                    f"rank {self.rank}: collective #{seq} mismatch: this rank called "
                    f"{_OP_NAMES[op]}(nbytes={nbytes}, dtype code {code}) but rank {peer} "
                    f"called {_OP_NAMES.get(got[1], '?')}(nbytes={got[2]}, dtype code "
                    f"{got[3]}); all ranks must call the same collectives with the same shapes"
                )


def _sum_in_rank_order(views: list[np.ndarray], out: np.ndarray, dtype: torch.dtype) -> None:
    """out = views[0] + views[1] + ... in this order (half types accumulate in float32)."""
    if dtype == torch.bfloat16:
        acc = torch.from_numpy(views[0]).view(torch.bfloat16).float()
        for view in views[1:]:
            acc.add_(torch.from_numpy(view).view(torch.bfloat16))
        torch.from_numpy(out).view(torch.bfloat16).copy_(acc)
    elif dtype == torch.float16:
        acc32 = views[0].astype(np.float32)
        for view in views[1:]:
            np.add(acc32, view, out=acc32)
        np.copyto(out, acc32, casting="same_kind")
    else:
        np.copyto(out, views[0])
        for view in views[1:]:
            np.add(out, view, out=out)


def _flat_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A 1-D numpy view of a contiguous CPU tensor (bfloat16 as its uint16 bits)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.uint16)
    return tensor.detach().numpy().reshape(-1)
