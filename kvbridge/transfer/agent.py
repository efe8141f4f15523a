"""The transport: one NIXL agent per worker process (UCX backend).

`Transport` is the small surface the producer and consumer use; `NixlTransport`
implements it with NIXL, and unit tests may pass a fake beside the real one. The
agent is created without NIXL's progress thread (it keeps a core busy even when
idle), so the process that owns registered memory must keep calling `notifs()` for
reads of that memory to progress: `KVProducer.poll` does.

Not thread-safe: NIXL's sync mode is NONE here (no lock in the agent; UCX runs its
worker SERIALIZED), so one thread at a time may call a transport: the owner's lock
(`WorkerConnector.lock`) or a single owning thread.
"""

from __future__ import annotations

import enum
import logging
import os
from typing import Any, Protocol

import numpy as np

from kvbridge.transfer.errors import TransferError
from kvbridge.transfer.regions import CacheRegions, MemType

log = logging.getLogger("kvbridge.transfer.agent")

#: UCX settings a worker takes unless its environment sets them (the user's value wins).
#: UCT's TCP transport has no GET: UCX answers each READ across hosts with active
#: messages copied through segments of this size at both ends. With UCX's 8 KiB, 256 MiB
#: crossed two test hosts in 201-224 ms; with 64 KiB to 512 KiB in 114-148 ms (no change
#: on one host, where CMA reads; docs/benchmarks.md, 2026-12-05).
UCX_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "256k", "UCX_TCP_RX_SEG_SIZE": "256k"}


class XferState(enum.Enum):
    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


class Transport(Protocol):
    """What the runtime needs from a transport; handles are opaque."""

    name: str

    def metadata(self) -> bytes: ...
    def register(self, regions: CacheRegions) -> None: ...
    def peer_regions(self, regions: CacheRegions) -> CacheRegions: ...
    def add_peer(self, metadata: bytes) -> str: ...
    def remove_peer(self, peer: str) -> None: ...
    def prep_local(self, descs: np.ndarray, mem_type: MemType | None = None) -> Any: ...
    def prep_remote(self, peer: str, descs: np.ndarray, mem_type: MemType) -> Any: ...
    def release_dlist(self, handle: Any) -> None: ...
    def read(
        self, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray, notif: bytes
    ) -> tuple[Any, XferState]: ...
    def state(self, xfer: Any) -> XferState: ...
    def release(self, xfer: Any) -> bool: ...
    def send_notif(self, peer: str, msg: bytes) -> None: ...
    def notifs(self) -> dict[str, list[bytes]]: ...
    def fence_words(self) -> tuple[np.ndarray, int] | None: ...
    def close(self) -> None: ...


class NixlTransport:
    """A NIXL agent with this worker's cache regions registered once.

    Args:
        name: agent name, unique among the peers it talks to.
        regions: the cache regions to register (DRAM or VRAM).
        backend_params: UCX backend parameters (e.g. ``{"ucx_error_handling_mode": "none"}``).
        net_device: keep UCX to this network interface (its TCP listener included), set
            as UCX_NET_DEVICES for this process unless the user set that variable; it
            must be set before the process's first agent is created.
    """

    def __init__(
        self,
        name: str,
        regions: CacheRegions,
        backend_params: dict[str, str] | None = None,
        net_device: str | None = None,
    ) -> None:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        for key, value in UCX_DEFAULTS.items():  # read when the process's UCX starts
            os.environ.setdefault(key, value)
        if net_device:
            os.environ.setdefault("UCX_NET_DEVICES", net_device)
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self.name = name
        self.regions = regions
        self._mem = regions.mem_type.value
        self._fence: np.ndarray | None = None
        cfg = nixl_agent_config(enable_prog_thread=False, backends=[], capture_telemetry=False)
        try:
            self._agent = nixl_agent(name, cfg)
            self._agent.create_backend("UCX", dict(backend_params or {}))
            self._regs = [self._agent.register_memory(regions.as_array(), self._mem)]
        except Exception as exc:  # NIXL raises its own types (nixlBackendError, RuntimeError)
            raise TransferError(f"cannot create NIXL agent {name!r} with UCX: {exc}") from exc

    def register(self, regions: CacheRegions) -> None:
        """Register more memory (e.g. a benchmark's scratch buffer); call before handshakes,
        since peers learn registrations from the metadata they load."""
        try:
            self._regs.append(
                self._agent.register_memory(regions.as_array(), regions.mem_type.value)
            )
        except Exception as exc:
            raise TransferError(
                f"NIXL could not register {regions.num_regions} regions: {exc}"
            ) from exc

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def fence_words(self) -> tuple[np.ndarray, int]:
        """This worker's fence words (`fence.SLOTS` uint64 of host memory, registered at
        the first call: make it before handshakes) and where peers read them: a
        producer's, written as it exposes and releases; a consumer's, where its READs of
        producers' words land (`fence.py`)."""
        if self._fence is None:
            from kvbridge.transfer.fence import SLOTS  # (fence.py reads through a Transport)

            words = np.zeros(SLOTS, dtype=np.uint64)
            self.register(CacheRegions.from_array(words))
            self._fence = words
        return self._fence, int(self._fence.ctypes.data)

    def peer_regions(self, regions: CacheRegions) -> CacheRegions:
        """Where peers address `regions` (registered here: the same addresses)."""
        return regions

    def add_peer(self, metadata: bytes) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise TransferError(f"NIXL rejected the peer's agent metadata: {exc}") from exc
        name = name.decode() if isinstance(name, bytes) else str(name)
        try:  # connect now, not on the first READ (it completes while we progress)
            self._agent.make_connection(name)
        except Exception as exc:  # the first READ connects, as without it
            log.debug("NIXL could not connect to %s ahead: %s", name, exc)
        return name

    def remove_peer(self, peer: str) -> None:
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as exc:  # the peer may be gone already
            log.debug("remove_remote_agent(%s): %s", peer, exc)

    def prep_local(self, descs: np.ndarray, mem_type: MemType | None = None) -> Any:
        """Prepare descriptors of our memory: the cache's type unless `mem_type` says
        (host memory beside a GPU cache, e.g. the fence words)."""
        mem = self._mem if mem_type is None else mem_type.value
        try:
            return self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, mem)
        except Exception as exc:
            raise TransferError(
                f"NIXL could not prepare {len(descs)} descriptors: {type(exc).__name__}: {exc}"
            ) from exc

    def prep_remote(self, peer: str, descs: np.ndarray, mem_type: MemType) -> Any:
        """Prepare descriptors of `peer`'s memory (of the peer's memory type: a DRAM
        consumer may read a VRAM producer)."""
        try:
            return self._agent.prep_xfer_dlist(peer, descs, mem_type.value)
        except Exception as exc:
            raise TransferError(
                f"NIXL could not prepare {len(descs)} descriptors: {type(exc).__name__}: {exc}"
            ) from exc

    def release_dlist(self, handle: Any) -> None:
        try:
            self._agent.release_dlist_handle(handle)
        except Exception as exc:
            log.warning("releasing a NIXL descriptor list failed: %s", exc)

    def read(
        self, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray, notif: bytes
    ) -> tuple[Any, XferState]:
        """Post one READ of remote descriptors `remote_idx` into local `local_idx`; the
        peer receives `notif` when it completes. Raises TransferError if NIXL refuses
        (e.g. NIXL_ERR_REMOTE_DISCONNECT: the peer process is gone)."""
        return self._post("READ", local, local_idx, remote, remote_idx, notif)

    def write(
        self, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray, notif: bytes
    ) -> tuple[Any, XferState]:
        """Post one WRITE of local descriptors `local_idx` into remote `remote_idx` (the
        benchmarks' push baseline: over TCP, UCX moves a WRITE without copies, a READ
        through bounce buffers at both ends)."""
        return self._post("WRITE", local, local_idx, remote, remote_idx, notif)

    def _post(
        self,
        op: str,
        local: Any,
        local_idx: np.ndarray,
        remote: Any,
        remote_idx: np.ndarray,
        notif: bytes,
    ) -> tuple[Any, XferState]:
        handle = None
        try:
            handle = self._agent.make_prepped_xfer(op, local, local_idx, remote, remote_idx, notif)
            return handle, XferState(self._agent.transfer(handle))
        except Exception as exc:
            if handle is not None:
                self.release(handle)
            raise TransferError(f"NIXL {op} failed: {type(exc).__name__}: {exc}") from exc

    def state(self, xfer: Any) -> XferState:
        try:
            return XferState(self._agent.check_xfer_state(xfer))
        except Exception as exc:
            log.warning("check_xfer_state raised: %s", exc)
            return XferState.ERR

    def release(self, xfer: Any) -> bool:
        """Release (cancelling if still active); False if NIXL could not."""
        try:
            self._agent.release_xfer_handle(xfer)
            return True
        except Exception as exc:
            log.error("releasing a NIXL transfer failed (it may still be running): %s", exc)
            return False

    def send_notif(self, peer: str, msg: bytes) -> None:
        try:
            self._agent.send_notif(peer, msg)
        except Exception as exc:
            raise TransferError(
                f"NIXL could not notify {peer!r}: {type(exc).__name__}: {exc}"
            ) from exc

    def notifs(self) -> dict[str, list[bytes]]:
        """New notifications by sender agent name; also drives this agent's progress."""
        return dict(self._agent.get_new_notifs())

    def close(self) -> None:
        for reg in self._regs:
            try:
                self._agent.deregister_memory(reg)
            except Exception as exc:
                log.debug("deregister_memory: %s", exc)
        self._regs.clear()
