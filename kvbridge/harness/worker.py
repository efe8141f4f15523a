"""A stand-alone transfer worker process: one NIXL agent, a pattern-filled cache and a
producer or consumer, driven by a parent over a pipe (used by `transfer-check`, the
benchmark and the tests; an engine embeds `KVProducer`/`KVConsumer` instead).

The parent talks to it with the msgspec-encoded commands of `commands.py`, never pickle.
The worker exits when told to, when the pipe closes (its parent died) or on SIGINT.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from kvbridge.errors import KVBridgeError
from kvbridge.harness.commands import (
    Command,
    Expose,
    Failed,
    Finished,
    Pull,
    RawDone,
    RawRead,
    Ready,
    Released,
    SetEndpoints,
    SetSiblings,
    Status,
    StatusReply,
    Stop,
    Verified,
    Verify,
    WorkerSpec,
    cmd_decoder,
    send,
)
from kvbridge.plan.layout import cache_shape, num_regions
from kvbridge.plan.verifier import expected_decode_cache, fill_worker_cache, uint_dtype
from kvbridge.transfer.config import FanOut, TransferConfig
from kvbridge.transfer.integrity import Integrity

if TYPE_CHECKING:
    from kvbridge.transfer.agent import Transport
    from kvbridge.transfer.consumer import KVConsumer
    from kvbridge.transfer.producer import KVProducer, Release


def _mismatch(got: np.ndarray, want: np.ndarray, rank: int, order: str) -> str:
    bad = np.nonzero(got != want)
    first = tuple(int(i[0]) for i in bad)
    return (
        f"decode rank {rank}: {len(bad[0])} elements differ, first at index {first} of "
        f"the cache's axes {order}"
    )


def worker_main(conn: Connection, spec_bytes: bytes) -> None:
    """Entry point of a spawned worker process."""
    # stdout belongs to the parent (`--json` prints exactly one object there): send
    # everything a worker or NIXL/UCX might print to stderr instead.
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(levelname)s worker %(process)d %(name)s: %(message)s",
    )
    spec = msgspec.msgpack.decode(spec_bytes, type=WorkerSpec)
    try:
        if spec.netns:  # before any socket or agent exists
            from kvbridge.harness.hosts import become

            become(spec.netns, spec.hostname, spec.host_pid)
        _Worker(conn, spec).run()
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        pass
    except Exception as exc:  # report anything to the parent rather than die silently
        with contextlib.suppress(OSError):
            send(conn, Failed(spec.rank, f"{type(exc).__name__}: {exc}"))
        raise


class _Worker:
    """One worker process's state: cache, transport and producer or consumer."""

    def __init__(self, conn: Connection, spec: WorkerSpec) -> None:
        from kvbridge.transfer.agent import NixlTransport
        from kvbridge.transfer.consumer import KVConsumer
        from kvbridge.transfer.identity import Identity
        from kvbridge.transfer.netdev import device_of
        from kvbridge.transfer.producer import KVProducer
        from kvbridge.transfer.regions import CacheRegions

        self.conn, self.spec = conn, spec
        model, self.layout = spec.model.to_spec(), spec.layout.to_layout()
        self.shard = self.layout.workers(model, spec.role)[spec.rank]
        self.kv_model = model.with_dtype(self.layout.kv_dtype(model))
        fills = [s.to_request() for s in spec.fill]
        shape = cache_shape(self.kv_model, self.layout, self.shard, spec.num_blocks)
        dtype = np.dtype(uint_dtype(self.kv_model.itemsize))
        segment = None
        if spec.role == "prefill" and spec.kv_export == "process":  # cache, scratch in it
            from kvbridge.transfer.export import SharedSegment

            nbytes = int(np.prod(shape)) * dtype.itemsize
            segment = SharedSegment(nbytes + max(spec.scratch_bytes, 1))
            self.cache = segment.array[:nbytes].view(dtype).reshape(shape)
            self.scratch = segment.array[nbytes:]
        else:
            self.cache = np.empty(shape, dtype=dtype)
            self.scratch = np.empty(max(spec.scratch_bytes, 1), dtype=np.uint8)
        if spec.pattern:
            # touched up front: registering and reading never-touched pages is slow
            self.cache[...] = fill_worker_cache(
                self.kv_model, self.layout, self.shard, spec.num_blocks, fills, spec.salt
            )
        else:
            self.cache.fill(spec.salt)
        self.scratch.fill(1)  # touched
        self.initial = self.cache.copy() if spec.role == "decode" and spec.pattern else None
        n = num_regions(self.kv_model, self.layout, self.shard)
        self.on_device: Any = None  # the cache on `spec.device`, where one is named
        if spec.device:
            if segment is not None:
                raise KVBridgeError(
                    f"device={spec.device!r} with kv_export='process': an export process "
                    "maps host memory only; use kv_export='inline'"
                )
            import torch

            flat = torch.from_numpy(self.cache.reshape(-1).view(np.uint8))
            self.on_device = flat.to(spec.device, copy=True)
            regions = CacheRegions.from_tensor(self.on_device, n)
        else:
            regions = CacheRegions.from_array(self.cache, n)
        name = f"{spec.instance_id}-{spec.role}-{spec.rank}-{os.getpid()}"
        scratch = CacheRegions.from_array(self.scratch[None, :])
        self.transport: Transport
        if segment is not None:
            from kvbridge.transfer.export import ExportedTransport

            self.transport = ExportedTransport(
                name, regions, segment, spec.backend_params, device_of(spec.host)
            )
        else:
            nixl = NixlTransport(name, regions, spec.backend_params, device_of(spec.host))
            if spec.scratch_bytes:
                nixl.register(scratch)
            self.transport = nixl
        #: where peers read the scratch buffer (the export process maps it elsewhere)
        self.scratch_addr = self.transport.peer_regions(scratch).addresses[0]
        config = TransferConfig(
            host=spec.host,
            base_port=spec.base_port,
            token=spec.token,
            lease_s=spec.lease_s,
            transfer_timeout_s=spec.transfer_timeout_s,
            handshake_timeout_s=spec.handshake_timeout_s,
            liveness_timeout_s=spec.liveness_timeout_s,
            max_units=spec.max_units,
            integrity=Integrity(spec.integrity),
            fan_out=FanOut(spec.fan_out),
        )
        self.producer: KVProducer | None = None
        self.consumer: KVConsumer | None = None
        common: dict[str, Any] = dict(
            model=model,
            layout=self.layout,
            rank=spec.rank,
            regions=regions,
            num_blocks=spec.num_blocks,
            transport=self.transport,
            config=config,
            instance_id=spec.instance_id,
        )
        if spec.role == "prefill":
            self.producer = KVProducer(**common, on_release=self._on_release)
        else:
            identity = Identity(spec.identity) if spec.identity is not None else None
            self.consumer = KVConsumer(**common, identity=identity)

    def _on_release(self, rel: Release) -> None:
        send(
            self.conn,
            Released(
                self.spec.rank, rel.request_id, rel.cause.value, rel.reason, len(rel.block_ids)
            ),
        )

    def run(self) -> None:
        endpoint = self.producer.endpoint if self.producer is not None else ""
        send(
            self.conn,
            Ready(
                self.spec.rank,
                endpoint,
                os.getpid(),
                self.transport.name,
                self.scratch_addr if self.spec.scratch_bytes else 0,
                self.consumer.sibling() if self.consumer is not None else b"",
            ),
        )
        # A producer polls its side channel with a 1 ms timeout (that is its sleep); a
        # consumer sleeps in the pipe poll instead.
        # After a command the worker polls at once, as new work wakes a connector's
        # progress thread (`ProgressThread.wake`).
        idle = 0.0 if self.producer is not None else 0.0005
        try:
            while True:
                wait = idle
                while self.conn.poll(wait):
                    cmd = cmd_decoder.decode(self.conn.recv_bytes())
                    if isinstance(cmd, Stop):
                        return
                    self._command(cmd)
                    wait = 0.0
                if self.producer is not None:
                    self.producer.poll(timeout_ms=1)
                elif self.consumer is not None:
                    for r in self.consumer.poll():
                        send(
                            self.conn,
                            Finished(
                                self.spec.rank,
                                r.request_id,
                                r.state.value,
                                r.reason,
                                list(r.local_block_ids),
                                r.nbytes,
                                r.num_descriptors,
                                r.num_unmerged,
                                r.num_indices,
                                r.failure.value if r.failure is not None else "",
                                r.local_nbytes,
                                r.checked,
                                dataclasses.asdict(r.phases),
                                r.fenced,
                            ),
                        )
        finally:
            if self.producer is not None:
                self.producer.on_release = None
                self.producer.close()
            if self.consumer is not None:
                self.consumer.close()
            self.transport.close()

    def _raw_read(self, cmd: RawRead) -> None:
        from kvbridge.transfer.agent import NixlTransport, XferState
        from kvbridge.transfer.regions import MemType

        t = self.transport
        assert isinstance(t, NixlTransport), "a raw READ is posted by a decode worker's agent"
        local = t.prep_local(np.array([[self.scratch.ctypes.data, cmd.nbytes, 0]], np.uint64))
        remote = t.prep_remote(
            cmd.agent_name, np.array([[cmd.remote_addr, cmd.nbytes, 0]], np.uint64), MemType.DRAM
        )
        idx = np.zeros(1, dtype=np.int32)
        t0 = time.perf_counter()
        post = t.write if cmd.write else t.read
        xfer, state = post(local, idx, remote, idx, b"")
        deadline = time.monotonic() + 60
        while state is XferState.PROC and time.monotonic() < deadline:
            state = t.state(xfer)
        seconds = time.perf_counter() - t0
        t.release(xfer)
        t.release_dlist(local)
        t.release_dlist(remote)
        send(self.conn, RawDone(self.spec.rank, state.value, seconds))

    def _command(self, cmd: Command) -> None:
        spec, producer, consumer = self.spec, self.producer, self.consumer
        try:
            if isinstance(cmd, SetEndpoints) and producer is not None:
                producer.set_worker_endpoints(cmd.endpoints)
            elif isinstance(cmd, SetSiblings) and consumer is not None:
                consumer.set_siblings(cmd.siblings)
            elif isinstance(cmd, Expose) and producer is not None:
                producer.expose(**msgspec.structs.asdict(cmd))  # its fields are the call's
            elif isinstance(cmd, Pull) and consumer is not None:
                consumer.pull(**msgspec.structs.asdict(cmd))  # its fields are the call's
            elif isinstance(cmd, Verify) and self.initial is not None:
                if self.on_device is not None:  # what the device cache holds now
                    self.cache.reshape(-1).view(np.uint8)[:] = self.on_device.cpu().numpy()
                want = expected_decode_cache(
                    self.kv_model,
                    self.layout,
                    self.shard,
                    self.initial,
                    [s.to_request() for s in cmd.requests],
                )
                ok = bool(np.array_equal(self.cache, want))
                detail = (
                    ""
                    if ok
                    else _mismatch(self.cache, want, spec.rank, self.layout.cache_layout.order)
                )
                send(self.conn, Verified(spec.rank, ok, detail))
            elif isinstance(cmd, Status) and producer is not None:
                send(
                    self.conn,
                    StatusReply(
                        spec.rank,
                        producer.num_pinned_blocks,
                        list(producer.refusals),
                        producer.num_rejected,
                    ),
                )
            elif isinstance(cmd, RawRead):
                self._raw_read(cmd)
            elif isinstance(cmd, Status) and consumer is not None:
                send(self.conn, StatusReply(spec.rank, consumer.num_held_blocks, [], 0))
            else:
                send(
                    self.conn,
                    Failed(spec.rank, f"{type(cmd).__name__} is not a {spec.role} command"),
                )
        except KVBridgeError as exc:
            send(self.conn, Failed(spec.rank, str(exc)))
