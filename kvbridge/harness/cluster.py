"""Worker processes on this machine, started and reaped by the calling process.

`Cluster` spawns `worker.worker_main` processes (multiprocessing "spawn": no state is
inherited), collects their events and guarantees they are gone when it is closed --
on return, on error, on Ctrl-C (`with Cluster() as c:`) and at interpreter exit.
Every wait takes a timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import msgspec

from kvbridge.errors import WorkerError
from kvbridge.harness.commands import (
    Command,
    Event,
    Failed,
    Ready,
    SetEndpoints,
    SetSiblings,
    Span,
    Stop,
    WorkerSpec,
    recv_event,
    send,
)
from kvbridge.harness.worker import worker_main
from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.plan.layout import InstanceLayout
from kvbridge.transfer.messages import LayoutWire, ModelWire


@dataclass
class WorkerHandle:
    role: str
    rank: int
    instance_id: str
    process: Any
    conn: Connection
    endpoint: str = ""
    pid: int = 0
    agent_name: str = ""
    scratch_addr: int = 0
    sibling: bytes = b""
    alive: bool = True

    def send(self, cmd: Command) -> None:
        send(self.conn, cmd)

    def kill(self) -> None:
        """SIGKILL the process (fault injection) and wait until it is gone."""
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)
        self.alive = False


@dataclass
class Instance:
    instance_id: str
    role: str
    workers: list[WorkerHandle]

    @property
    def endpoint(self) -> str:
        """The instance's side channel: its worker 0's (producers only)."""
        return self.workers[0].endpoint


@dataclass
class Cluster:
    """Worker processes of one or more instances; close() ends all of them."""

    ready_timeout_s: float = 90.0
    workers: list[WorkerHandle] = field(default_factory=list)
    events: list[tuple[WorkerHandle, Event]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._ctx = mp.get_context("spawn")
        atexit.register(self.close)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(
        self,
        role: str,
        model: ModelKVSpec,
        layout: InstanceLayout,
        num_blocks: int,
        instance_id: str,
        *,
        fill: Sequence[Span] = (),
        salt: int = 0,
        **options: Any,
    ) -> Instance:
        """Start every worker of one instance and wait until all are ready.
        `options` are further `WorkerSpec` fields (token, lease_s, transfer_timeout_s, ...)."""
        handles = []
        for w in layout.workers(model, role):
            spec = WorkerSpec(
                role=role,
                model=ModelWire.of(model),
                layout=LayoutWire.of(layout),
                rank=w.rank,
                num_blocks=num_blocks,
                instance_id=instance_id,
                salt=salt + w.rank,
                fill=list(fill),
                **options,
            )
            parent, child = self._ctx.Pipe()
            proc = self._ctx.Process(
                target=worker_main,
                args=(child, msgspec.msgpack.encode(spec)),
                name=f"kvbridge-{instance_id}-{role}-{w.rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            h = WorkerHandle(role, w.rank, instance_id, proc, parent)
            self.workers.append(h)
            handles.append(h)
        for h in handles:
            ev = self.expect(h, Ready, self.ready_timeout_s)
            h.endpoint, h.pid, h.agent_name = ev.endpoint, ev.pid, ev.agent_name
            h.scratch_addr, h.sibling = ev.scratch_addr, ev.sibling
        inst = Instance(instance_id, role, handles)
        for h in handles:
            if role == "prefill":
                h.send(SetEndpoints([x.endpoint for x in handles]))
            else:
                h.send(SetSiblings([x.sibling for x in handles]))
        return inst

    def pump(self, timeout_s: float) -> int:
        """Collect events that arrive within `timeout_s`; returns how many."""
        conns = {h.conn: h for h in self.workers if h.alive}
        if not conns:
            return 0
        n = 0
        for conn in wait(list(conns), timeout_s):
            h = conns[conn]  # type: ignore[index]
            try:
                while conn.poll():  # type: ignore[union-attr]
                    self.events.append((h, recv_event(conn)))  # type: ignore[arg-type]
                    n += 1
            except (EOFError, OSError):
                h.alive = False
        return n

    def wait_until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.pump(min(left, 0.5))
        return True

    def take(self, kind: type, worker: WorkerHandle | None = None) -> list[Any]:
        """Remove and return the collected events of `kind` (from `worker`, if given)."""
        keep: list[tuple[WorkerHandle, Event]] = []
        out: list[tuple[WorkerHandle, Event]] = []
        for h, ev in self.events:
            (out if isinstance(ev, kind) and (worker is None or h is worker) else keep).append(
                (h, ev)
            )
        self.events = keep
        return [ev for _, ev in out]

    def expect(self, worker: WorkerHandle, kind: type, timeout_s: float) -> Any:
        """The next event of `kind` from `worker`; raises WorkerError on timeout, on the
        worker's death or on its `Failed` report."""
        found: list[Any] = []

        def ready() -> bool:
            for i, (h, ev) in enumerate(self.events):
                if h is worker and isinstance(ev, (kind, Failed)):
                    found.append(self.events.pop(i)[1])
                    return True
            return not worker.alive

        if not self.wait_until(ready, timeout_s) or not found:
            why = (
                "exited" if not worker.process.is_alive() else f"did not answer in {timeout_s:g} s"
            )
            raise WorkerError(
                f"{worker.role} worker {worker.rank} of {worker.instance_id} {why}"
                f" (waiting for {kind.__name__})",
                worker.rank,
            )
        ev = found[0]
        if isinstance(ev, Failed) and kind is not Failed:
            raise WorkerError(f"{worker.role} worker {worker.rank}: {ev.error}", worker.rank)
        return ev

    def close(self) -> None:
        """Stop every worker: ask politely, then terminate, then kill. Idempotent."""
        for h in self.workers:
            if h.alive and h.process.is_alive():
                with contextlib.suppress(OSError, ValueError):
                    h.send(Stop())
        deadline = time.monotonic() + 5
        for h in self.workers:
            h.process.join(max(0.0, deadline - time.monotonic()))
        for h in self.workers:
            if h.process.is_alive():
                h.process.terminate()
                h.process.join(2)
            if h.process.is_alive():
                h.process.kill()
                h.process.join(2)
            h.alive = False
            h.conn.close()
        self.workers.clear()
        atexit.unregister(self.close)
