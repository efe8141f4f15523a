"""A minimal multi-process tensor-parallel executor: torch.distributed (gloo) collectives,
socketpairs to the driver.

This is the stop-gap behind the `Executor` seam until kvbridge.engine.parallel's
shared-memory `WorkerGroup` replaces it (gloo all-reduce costs ~1.5 ms at tp 3 and ~25 ms
at tp 9 here). Everything between processes is msgspec bytes (`send_bytes`/`recv_bytes`,
dist.broadcast of uint8 tensors); nothing is unpickled.

    driver ──StepBatch bytes──▶ pipe ─▶ worker r (ModelRunner, GlooCommunicator) ─┐
       ▲                                                     gloo all-reduce/gather│
       └──────── WorkerReply (rank 0: StepResult bytes; others: ack) ◀────────────┘
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path

import msgspec
import numpy as np
import torch
import torch.distributed as dist

import kvbridge
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.errors import WorkerError
from kvbridge.engine.executor import Executor
from kvbridge.engine.gloo_comm import GlooCommunicator
from kvbridge.engine.model_runner import ModelRunner
from kvbridge.engine.step import (
    RunnerInfo,
    StepBatch,
    StepResult,
    encode,
    info_decoder,
    result_decoder,
    step_decoder,
)
from kvbridge.engine.weights import Progress

#: Largest message a worker accepts from the driver (a 4096-token prefill is ~100 KiB).
MAX_MESSAGE_BYTES = 64 << 20


class WorkerCall(msgspec.Struct, frozen=True):
    kind: str  # "step" | "close"
    payload: bytes = b""


class WorkerReply(msgspec.Struct, frozen=True):
    ok: bool
    payload: bytes = b""
    error: str = ""


_call_decoder = msgspec.msgpack.Decoder(WorkerCall)
_reply_decoder = msgspec.msgpack.Decoder(WorkerReply)


def _config_to_json(config: EngineConfig) -> bytes:
    fields = {f: getattr(config, f) for f in config.__dataclass_fields__}
    fields["cache_layout"] = config.cache_layout.value
    return msgspec.json.encode(fields)


def _config_from_json(data: bytes) -> EngineConfig:
    return EngineConfig(**msgspec.json.decode(data))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_main(
    rank: int, world_size: int, port: int, model_path: str, config_json: bytes, conn: Connection
) -> None:
    """Entry of a spawned worker: load the shard, then serve step calls until "close"."""
    comm: GlooCommunicator | None = None
    try:
        config = _config_from_json(config_json)
        torch.set_num_threads(config.num_threads or 1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=config.worker_timeout_s),
        )
        comm = GlooCommunicator()
        runner = ModelRunner(Path(model_path), config, comm)
        conn.send_bytes(encode(WorkerReply(True, encode(runner.info()))))
        while True:
            call = _call_decoder.decode(conn.recv_bytes(MAX_MESSAGE_BYTES))
            if call.kind == "close":
                break
            logits = runner.execute(step_decoder.decode(call.payload))
            payload = encode(StepResult.from_array(logits)) if rank == 0 else b""
            conn.send_bytes(encode(WorkerReply(True, payload)))
    except (EOFError, KeyboardInterrupt):
        pass  # the driver went away: exit quietly
    except BaseException as exc:  # report any failure to the driver, then exit
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        tb = traceback.format_exc(limit=4)
        with contextlib.suppress(OSError):
            conn.send_bytes(encode(WorkerReply(False, error=f"{detail}\n{tb}")))
    finally:
        if comm is not None:
            comm.close()
        conn.close()


class ProcessExecutor(Executor):
    """Starts tp_size worker processes (`python -m kvbridge.engine.tp_launcher`, one
    socketpair each, gloo on 127.0.0.1); owned by one LLMEngine.

    Every call waits at most `config.worker_timeout_s`; a worker that raises, dies or does
    not answer in time makes the call raise WorkerError naming the rank and the reason,
    and every worker is then stopped.
    """

    def __init__(
        self, model_path: Path, config: EngineConfig, progress: Progress | None = None
    ) -> None:
        self.timeout = config.worker_timeout_s
        port = _free_port()
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        cfg = _config_to_json(config).decode()
        env = dict(os.environ)
        # The workers import kvbridge from wherever this process did.
        root = str(Path(kvbridge.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        for rank in range(config.tp_size):
            ours, theirs = socket.socketpair()
            # A fresh interpreter (not multiprocessing's spawn): it does not re-import the
            # caller's __main__, so scripts without a main guard work too.
            cmd = [
                sys.executable,
                "-m",
                "kvbridge.engine.tp_launcher",
                str(rank),
                str(config.tp_size),
                str(port),
                str(theirs.fileno()),
                str(model_path),
                cfg,
            ]
            self._procs.append(subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), env=env))
            theirs.close()
            self._conns.append(Connection(ours.detach()))
        if progress is not None:
            progress("starting tp workers", 0, config.tp_size)
        infos = [info_decoder.decode(r) for r in self._gather("start", progress)]
        self.info: RunnerInfo = infos[0]
        if any(i.num_blocks != self.info.num_blocks for i in infos):
            self.close()
            raise WorkerError(f"workers disagree on num_blocks: {[i.num_blocks for i in infos]}")

    def execute(self, batch: StepBatch) -> np.ndarray:
        msg = encode(WorkerCall("step", encode(batch)))
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(msg)
            except OSError as exc:
                code = self._procs[rank].poll()
                self.close()
                raise WorkerError(
                    f"tp worker {rank} died (exit code {code}; sending the step: {exc}); "
                    "restart the engine"
                ) from None
        replies = self._gather("step")
        return result_decoder.decode(replies[0]).array()

    def _gather(self, what: str, progress: Progress | None = None) -> list[bytes]:
        """One reply per rank, in rank order, within the timeout, or WorkerError."""
        deadline = time.monotonic() + self.timeout
        replies: list[bytes | None] = [None] * len(self._conns)
        rank_of = {id(c): r for r, c in enumerate(self._conns)}
        while any(r is None for r in replies):
            pending = [c for r, c in enumerate(self._conns) if replies[r] is None]
            for conn in wait(pending, timeout=1.0):
                assert isinstance(conn, Connection)
                rank = rank_of[id(conn)]
                try:
                    reply = _reply_decoder.decode(conn.recv_bytes(MAX_MESSAGE_BYTES))
                except (EOFError, OSError):
                    reply = WorkerReply(False, error="its pipe closed")
                if not reply.ok:
                    self.close()
                    raise WorkerError(f"tp worker {rank} failed during {what}: {reply.error}")
                replies[rank] = reply.payload
                if progress is not None:
                    progress(
                        "starting tp workers", sum(r is not None for r in replies), len(replies)
                    )
            for rank, proc in enumerate(self._procs):
                if (
                    replies[rank] is None
                    and proc.poll() is not None
                    and not self._conns[rank].poll()
                ):
                    self.close()
                    raise WorkerError(
                        f"tp worker {rank} died (exit code {proc.returncode}) during {what}"
                    )
            if time.monotonic() > deadline:
                late = [r for r, x in enumerate(replies) if x is None]
                self.close()
                raise WorkerError(
                    f"tp workers {late} did not answer {what} within "
                    f"worker_timeout_s={self.timeout}"
                )
        return [r for r in replies if r is not None]

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(encode(WorkerCall("close")))
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []


if __name__ == "__main__":
    # python -m kvbridge.engine.tp_launcher RANK WORLD PORT FD MODEL CONFIG_JSON
    _rank, _world, _port, _fd = (int(x) for x in sys.argv[1:5])
    _worker_main(_rank, _world, _port, sys.argv[5], sys.argv[6].encode(), Connection(_fd))
