"""The worker side of a `WorkerGroup`: process entry point, `WorkerContext`, wire frames.

Driver and workers talk over one duplex pipe per worker (multiprocessing Connection,
raw bytes, never pickle). A frame is a fixed header then two byte strings:

    offset  size  field
    0       1     kind (Kind)
    1       3     padding
    4       4     len(method) in bytes (UTF-8)
    8       8     seq: the call number (0 for start-up messages)
    16      m     method
    16+m    ...   payload

driver -> worker: CALL (method, payload), CALL_NO_REPLY (same; the reply is an empty
acknowledgement), STOP. worker -> driver: PROGRESS (text), READY, REPLY (bytes), ERROR
(JSON: error type, message, traceback, whether it is only a consequence of another
rank's failure). The *_SHM variants of CALL, CALL_NO_REPLY and REPLY carry only a u64
length: the bytes are in the group's `CallBuffer` or the worker's `ReplyBuffer`.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import json
import os
import signal
import struct
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from kvbridge.engine.parallel.errors import PeerAbortedError, PeerDiedError
from kvbridge.engine.parallel.reply_buffer import SHM_MIN_BYTES, CallBuffer, ReplyBuffer
from kvbridge.engine.parallel.shm_comm import ShmCommunicator
from kvbridge.engine.parallel.shm_segment import unlink_segment
from kvbridge.heap import freeze_start_up

_FRAME = struct.Struct("<B3xIQ")
_LENGTH = struct.Struct("<Q")
PARENT_CHECK_S = 1.0

#: A worker's call handler: (method, payload) -> reply bytes.
Handler = Callable[[str, bytes], bytes | None]


class Kind(enum.IntEnum):
    CALL = 1
    CALL_NO_REPLY = 2
    STOP = 3
    CALL_SHM = 4
    CALL_NO_REPLY_SHM = 5
    PROGRESS = 10
    READY = 11
    REPLY = 12
    ERROR = 13
    REPLY_SHM = 14


def encode_frame(kind: Kind, seq: int = 0, method: str = "", payload: bytes = b"") -> bytes:
    raw_method = method.encode()
    return _FRAME.pack(kind, len(raw_method), seq) + raw_method + payload


def decode_frame(frame: bytes) -> tuple[Kind, int, str, bytes]:
    """Split a frame into (kind, seq, method, payload); raises ValueError if malformed."""
    if len(frame) < _FRAME.size:
        raise ValueError(
            f"frame of {len(frame)} bytes is shorter than its {_FRAME.size}-byte header"
        )
    kind, method_len, seq = _FRAME.unpack_from(frame)
    end = _FRAME.size + method_len
    if end > len(frame):
        raise ValueError(f"frame says method is {method_len} bytes but has {len(frame)} in all")
    return Kind(kind), seq, frame[_FRAME.size : end].decode(), frame[end:]


def error_payload(exc: BaseException) -> bytes:
    return json.dumps(
        {
            "type": type(exc).__name__,
            "message": str(exc),
            "traceback": traceback.format_exc(),
            "secondary": isinstance(exc, PeerAbortedError | PeerDiedError),
        }
    ).encode()


@dataclass
class WorkerContext:
    """What a worker's target function receives: its place in the group and the means
    to serve the driver. Owned by the worker process; `comm` is already connected."""

    rank: int
    world_size: int
    comm: ShmCommunicator
    init_payload: bytes
    conn: Connection
    parent_pid: int
    call_buffer: CallBuffer | None = None
    reply_buffer: ReplyBuffer | None = None

    def report_progress(self, text: str) -> None:
        """Tell the driver about start-up progress (shown by its `on_progress` callback)."""
        self.conn.send_bytes(encode_frame(Kind.PROGRESS, payload=text.encode()))

    def serve(
        self,
        handler: Handler,
        idle: Callable[[], float | None] | None = None,
        idle_interval_s: float = 0.001,
    ) -> None:
        """Report ready, then run calls until the driver says stop or goes away.

        `idle`, if given, runs whenever no call arrived for a while (e.g. to progress
        transfers that need this process to poll): `idle_interval_s` after a call, then
        after whatever delay its last run returned (None: `idle_interval_s` again), so an
        idle worker can sleep longer than a busy one. An exception it raises is fatal to
        the worker, like a handler's.

        Every call gets exactly one answer: REPLY with the handler's bytes, or ERROR with
        its traceback. A handler that raises aborts the communicator first, so peers that
        wait for this rank in a collective fail at once instead of timing out; the group
        is unusable afterwards (the driver reports it broken).
        """
        conn = self.conn
        freeze_start_up()  # later full collections skip the model and what loaded it
        conn.send_bytes(encode_frame(Kind.READY))
        idle_wait_s = idle_interval_s
        last_check = time.monotonic()
        while True:
            wait_s = PARENT_CHECK_S if idle is None else min(idle_wait_s, PARENT_CHECK_S)
            if not conn.poll(wait_s):
                now = time.monotonic()
                if now - last_check >= PARENT_CHECK_S:
                    last_check = now
                    if not self._driver_alive():
                        return  # the driver died without closing its pipe end
                if idle is not None:
                    next_wait = idle()
                    idle_wait_s = idle_interval_s if next_wait is None else max(0.0, next_wait)
                continue
            idle_wait_s = idle_interval_s  # a call may have started work to progress
            try:
                kind, seq, method, payload = decode_frame(conn.recv_bytes())
            except EOFError:
                return  # the driver is gone
            if kind == Kind.STOP:
                return
            if kind in (Kind.CALL_SHM, Kind.CALL_NO_REPLY_SHM):
                # take the payload out at once: the driver reuses the buffer after that
                assert self.call_buffer is not None, "driver used a CallBuffer we lack"
                payload = self.call_buffer.read(self.rank, seq, decode_length(payload))
                kind = Kind.CALL if kind == Kind.CALL_SHM else Kind.CALL_NO_REPLY
            try:
                reply = handler(method, payload) or b""
                if not isinstance(reply, bytes | bytearray | memoryview):
                    raise TypeError(
                        f"handler for {method!r} returned {type(reply).__name__}; return bytes"
                    )
                frame = self._reply_frame(seq, reply if kind == Kind.CALL else b"")
            except Exception as exc:
                self.comm.abort(f"its {method!r} handler raised {type(exc).__name__}: {exc}")
                frame = encode_frame(Kind.ERROR, seq, method, error_payload(exc))
            try:
                conn.send_bytes(frame)
            except (BrokenPipeError, ConnectionResetError):
                return

    def _driver_alive(self) -> bool:
        """Whether the driver's process still exists (this worker is a child of the fork
        server, not of the driver, so the driver's death does not show in its ppid)."""
        try:
            os.kill(self.parent_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # a process of another user took the pid: ours is gone
            return False
        return True

    def _reply_frame(self, seq: int, reply: bytes | bytearray | memoryview) -> bytes:
        data = bytes(reply)
        buffer = self.reply_buffer
        if buffer is not None and len(data) >= SHM_MIN_BYTES and buffer.try_write(seq, data):
            return encode_frame(Kind.REPLY_SHM, seq, payload=encode_length(len(data)))
        return encode_frame(Kind.REPLY, seq, payload=data)


def encode_length(nbytes: int) -> bytes:
    """The payload of a *_SHM frame."""
    return _LENGTH.pack(nbytes)


def decode_length(payload: bytes) -> int:
    (nbytes,) = _LENGTH.unpack(payload)
    return int(nbytes)


def resolve_target(target: str) -> Callable[[WorkerContext], None]:
    module_name, sep, func_name = target.partition(":")
    if not sep or not module_name or not func_name:
        raise ValueError(f"target={target!r} must look like 'package.module:function'")
    func = getattr(importlib.import_module(module_name), func_name, None)
    if not callable(func):
        raise ValueError(f"target={target!r}: {module_name} has no function {func_name!r}")
    return func


def worker_main(
    rank: int,
    world_size: int,
    target: str,
    init_payload: bytes,
    shm_name: str,
    conn: Connection,
    parent_pid: int,
    comm_timeout: float,
    connect_timeout: float,
    num_threads: int,
    call_buffer_name: str,
    reply_buffer_name: str,
    environment: dict[str, str],
) -> None:
    """Entry point of a worker process (see `WorkerGroup`): forked from the fork server,
    whose environment is the driver's as it was at the server's start; `environment` is
    the driver's as the group started, as a spawned process would have it."""
    # Ctrl-C reaches the whole process group; the driver alone decides how to shut down
    # (it stops or kills its workers), so a worker ignores it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    comm: ShmCommunicator | None = None
    call_buffer: CallBuffer | None = None
    reply_buffer: ReplyBuffer | None = None
    try:  # from here on, any failure reaches the driver with its reason
        if os.environ != environment:
            os.environ.clear()
            os.environ.update(environment)
        import torch

        torch.set_num_threads(num_threads)
        reply_buffer = ReplyBuffer.attach(reply_buffer_name)
        unlink_segment(reply_buffer_name)  # the driver has it mapped too
        call_buffer = CallBuffer.attach(call_buffer_name, world_size)
        comm = ShmCommunicator(
            shm_name, rank, world_size, timeout=comm_timeout, connect_timeout=connect_timeout
        )
        if rank == 0:
            unlink_segment(call_buffer_name)  # every rank mapped it before connecting
        conn.send_bytes(encode_frame(Kind.PROGRESS, payload=b"communicator connected"))
        func = resolve_target(target)
        func(
            WorkerContext(
                rank,
                world_size,
                comm,
                init_payload,
                conn,
                parent_pid,
                call_buffer=call_buffer,
                reply_buffer=reply_buffer,
            )
        )
    except BaseException as exc:
        if comm is not None:
            comm.abort(f"start-up failed: {type(exc).__name__}: {exc}")
        with contextlib.suppress(OSError):
            conn.send_bytes(encode_frame(Kind.ERROR, 0, "<start>", error_payload(exc)))
        raise SystemExit(1) from None
    finally:
        if comm is not None:
            comm.close()
        for buffer in (call_buffer, reply_buffer):
            if buffer is not None:
                buffer.close()
        conn.close()
