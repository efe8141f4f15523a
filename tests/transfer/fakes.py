"""A fake transport for unit tests of the producer and consumer state machines.

It moves no bytes; tests inject notifications and READ outcomes. It is used beside
the real NIXL tests (test_transfers.py, test_faults.py), never instead of them. Also the
small model, layouts and helpers the state-machine tests share (a settable clock, fake
cache regions, polling, signed notifications) and a host tensor that says it lies on a
GPU (`OnDevice`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from kvbridge.plan.geometry import AttentionKind, ModelKVSpec
from kvbridge.plan.layout import InstanceLayout, num_regions, region_nbytes
from kvbridge.transfer.agent import XferState
from kvbridge.transfer.messages import ReadDone
from kvbridge.transfer.regions import CacheRegions, MemType

if TYPE_CHECKING:
    from kvbridge.transfer.consumer import KVConsumer, TransferResult
    from kvbridge.transfer.peers import ProducerWorker
    from kvbridge.transfer.producer import KVProducer


class FakeTransport:
    def __init__(self, name: str = "fake") -> None:
        self.name = name
        self.inbox: dict[str, list[bytes]] = {}
        self.peers: list[str] = []
        self.reads: list[tuple[np.ndarray, np.ndarray, bytes]] = []
        self.read_state = XferState.PROC  # of every READ not in xfer_states
        self.xfer_states: dict[int, XferState] = {}  # READ handle (1, 2, ...) -> state
        self.released_dlists: list[Any] = []
        self.cancellable = True  # what `release` of a READ answers
        self.sent: list[tuple[str, bytes]] = []
        self.registered: list[CacheRegions] = []

    def metadata(self) -> bytes:
        return f"md:{self.name}".encode()

    def peer_regions(self, regions: CacheRegions) -> CacheRegions:
        return regions

    def register(self, regions: CacheRegions) -> None:
        self.registered.append(regions)

    def add_peer(self, metadata: bytes) -> str:
        name = metadata.decode().removeprefix("md:")
        self.peers.append(name)
        return name

    def remove_peer(self, peer: str) -> None:
        self.peers.remove(peer)

    def prep_local(self, descs: np.ndarray, mem_type: MemType | None = None) -> Any:
        return ("local", len(descs))

    def prep_remote(self, peer: str, descs: np.ndarray, mem_type: MemType) -> Any:
        return ("remote", peer, len(descs))

    def release_dlist(self, handle: Any) -> None:
        self.released_dlists.append(handle)

    def read(
        self, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray, notif: bytes
    ) -> tuple[Any, XferState]:
        self.reads.append((local_idx, remote_idx, notif))
        return len(self.reads), XferState.PROC

    def state(self, xfer: Any) -> XferState:
        return self.xfer_states.get(xfer, self.read_state)

    def release(self, xfer: Any) -> bool:
        return self.cancellable

    def send_notif(self, peer: str, msg: bytes) -> None:
        self.sent.append((peer, msg))

    def notifs(self) -> dict[str, list[bytes]]:
        out, self.inbox = self.inbox, {}
        return out

    def fence_words(self) -> None:
        return None  # no fence words: its pulls wait for ReadAcks, which tests inject

    def close(self) -> None:
        pass


MODEL = ModelKVSpec(4, 4, 2, 8, "float16", AttentionKind.GQA, "tiny")
PREFILL = InstanceLayout(tp_size=1)
DECODE = InstanceLayout(tp_size=2)
NUM_BLOCKS = 8


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


#: the memory of every cache `regions` made, kept for the whole session (a few KiB each)
_CACHES: list[np.ndarray] = []


def regions(layout: InstanceLayout, rank: int, model: ModelKVSpec = MODEL) -> CacheRegions:
    """Worker `rank`'s cache regions in memory of their own (a producer clears a
    request's slots past its last token at expose; the fake transport reads nothing)."""
    shard = layout.workers(model)[rank]
    n, size = num_regions(model, layout, shard), region_nbytes(model, layout, shard, NUM_BLOCKS)
    _CACHES.append(np.zeros(n * size, dtype=np.uint8))
    return CacheRegions.from_array(_CACHES[-1], n)


def drive(p: KVProducer, consumers: list[KVConsumer], rounds: int = 20) -> list[TransferResult]:
    out: list[TransferResult] = []
    for _ in range(rounds):
        p.poll(timeout_ms=5)
        for c in consumers:
            out += c.poll()
    return out


def session(c: KVConsumer, p: KVProducer) -> ProducerWorker:
    """Decode worker `c`'s handshake session with prefill worker `p` (tp 1: worker 0)."""
    w = c.directory.instance(p.endpoint).worker0
    assert w.session_key and w.session_id
    return w


def signed(c: KVConsumer, p: KVProducer, request_id: str, **fields: Any) -> bytes:
    """What decode worker `c` sends `p` when done with `request_id` (fields overridden)."""
    msg = ReadDone(
        request_id=request_id,
        instance_id=c.instance_id,
        rank=c.rank,
        to_instance=p.instance_id,
        to_rank=p.rank,
        sent_at=time.time(),
    )
    return session(c, p).sign(msgspec.structs.replace(msg, **fields))


def deliver(p: KVProducer, data: bytes) -> None:
    """Hand `p` a notification, as NIXL delivers one."""
    assert isinstance(p.transport, FakeTransport)
    p.transport.inbox.setdefault("decode", []).append(data)


class OnDevice:
    """A host tensor that says it lies on `device` ("cuda:1": torch names a device that
    is not there): what kvbridge reads of a GPU cache (its device, addresses, shape,
    strides, dtype) without one. Its bytes are never read as device memory here."""

    def __init__(self, tensor: Any, device: str) -> None:
        import torch

        self._t, self.device = tensor, torch.device(device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)
