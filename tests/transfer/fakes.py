"""A fake transport for unit tests of the producer and consumer state machines.

It moves no bytes; tests inject notifications and READ outcomes. It is used beside
the real NIXL tests (test_transfers.py, test_faults.py), never instead of them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvbridge.transfer.agent import XferState
from kvbridge.transfer.regions import MemType


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

    def metadata(self) -> bytes:
        return f"md:{self.name}".encode()

    def add_peer(self, metadata: bytes) -> str:
        name = metadata.decode().removeprefix("md:")
        self.peers.append(name)
        return name

    def remove_peer(self, peer: str) -> None:
        self.peers.remove(peer)

    def prep_local(self, descs: np.ndarray) -> Any:
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

    def close(self) -> None:
        pass
