"""The other decode workers of a decode worker's instance: the fan-out on a decode host.

Decode workers of one instance that hold the same cells (GQA heads replicated when
decode tp > num_kv_heads; MLA's latent) need the same prefill bytes. Once the engine
told every worker its siblings (`KVConsumer.sibling` -> `set_siblings`: each one's host,
NIXL agent and cache regions), a pull from a producer the config fans out from
(`TransferConfig.fan_out`) is planned with the workers' hosts: on each host the lowest
rank holding a set of cells reads it over the link; as soon as its READs are done it
tells each worker that copies from it (`LocalReady`, a NIXL notification signed with
the instance's sibling key), which READs those blocks from its cache on the host (CMA
for host memory) while the producers confirm; the reader tells them again once its pull
is confirmed, and only then is a copy DONE. A reader whose pull failed (stale included)
tells them so, and their copies are not used. A copier's bound is the pull's
`transfer_timeout_s`, and again as much from when its copy starts. The producer plans
the same (`Hello.decode_hosts`) and waits only for the readers' ReadDones. A notice is
kept for the pull it names until that pull takes it (a bounded number of pulls not
started yet here).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbridge.plan.layout import InstanceLayout
from kvbridge.transfer.errors import ProtocolError, TransferError
from kvbridge.transfer.identity import Identity
from kvbridge.transfer.messages import (
    LocalReady,
    Sibling,
    decode,
    decode_sibling,
    encode,
    encode_sibling,
)
from kvbridge.transfer.peers import unit_dlist
from kvbridge.transfer.pull import ActivePull, DecodeWorker, TransferState
from kvbridge.transfer.regions import CacheRegions, MemType

log = logging.getLogger("kvbridge.transfer.consumer")

#: LocalReady notices kept for pulls not started yet here (the oldest go first).
MAX_EARLY_READY = 4096


@dataclass
class SiblingWorker:
    """Another decode worker of this instance, as this one knows it."""

    rank: int
    host: str
    agent: str
    regions: CacheRegions
    dlists: dict[int, Any] = field(default_factory=dict)  # unit size -> prepared list
    unit: int | None = None  # whole-block unit of a copy from it (None: exact lists)


def sibling_key(identity: Identity | None, token: bytes | None, instance_id: str) -> bytes | None:
    """The key signing `LocalReady` notices between the workers of decode instance
    `instance_id`: from the instance's secret key (only its workers hold it), else from
    the shared token (every holder of the secret could derive it; a notice still needs
    the receiver's NIXL metadata, which only its instance's workers are given); None
    without either (nothing is authenticated then)."""
    secret = identity.secret if identity is not None else token
    if secret is None:
        return None
    label = b"kvbridge fan-out siblings\0" + instance_id.encode()
    return hmac.new(secret, label, hashlib.sha256).digest()


class Siblings:
    """One decode worker's view of its instance's other workers, owned by its
    `KVConsumer` and called from the consumer's thread only. Meets them once, all or
    nothing (`set_siblings`); until then (or at world size 1) `fan_out_hosts` is None and
    every pull reads its own bytes. Keeps the `LocalReady` notices its siblings send,
    authenticated with the instance's sibling key, for the pulls they name, and tells
    the workers copying from this one how its pulls stand. Releases its lists and
    removes its siblings' agents at `close`."""

    def __init__(
        self, worker: DecodeWorker, layout: InstanceLayout, host: str, key: bytes | None
    ) -> None:
        self.layout, self.rank, self.regions = layout, worker.rank, worker.regions
        self.transport, self.config, self.host = worker.transport, worker.config, host
        self.workers: dict[int, SiblingWorker] = {}  # fan-out: this instance's other workers
        self._hosts: tuple[str, ...] | None = None  # every worker's host, once told
        self._ranks: dict[str, int] = {}  # agent name -> rank
        self._key = key
        #: (request id, generation) -> a source's notices, until the pull they name takes
        #: them
        self._ready: collections.OrderedDict[tuple[str, int], list[LocalReady]] = (
            collections.OrderedDict()
        )

    def sibling(self) -> bytes:
        """What the other workers of this instance need to copy from this one (a
        `Sibling`, encoded)."""
        exported = self.transport.peer_regions(self.regions)
        return encode_sibling(
            Sibling(
                rank=self.rank,
                host=self.host,
                agent_name=self.transport.name,
                agent_metadata=self.transport.metadata(),
                regions=list(zip(exported.addresses, exported.lengths, strict=True)),
                mem_type=self.regions.mem_type.value,
                device_id=self.regions.device_id,
            )
        )

    def set_siblings(self, siblings: Sequence[bytes]) -> None:
        """Meet the other workers of this instance (every worker's `sibling()`, rank
        order); once only (`KVConsumer.set_siblings` states the contract)."""
        infos = [decode_sibling(b) for b in siblings]
        world = self.layout.world_size
        if len(infos) != world or [i.rank for i in infos] != list(range(world)):
            raise TransferError(
                f"siblings: {len(infos)} entries with ranks {[i.rank for i in infos][:16]}; "
                f"this decode instance has {world} workers, ranks 0..{world - 1} in order"
            )
        if infos[self.rank].agent_name != self.transport.name:
            raise TransferError(
                f"siblings: entry {self.rank} names agent {infos[self.rank].agent_name!r}, "
                f"not this worker's {self.transport.name!r}"
            )
        if self._hosts is not None:
            if all(
                i.rank == self.rank or self.workers[i.rank].agent == i.agent_name for i in infos
            ):
                return
            raise TransferError("siblings were set already, to other workers")
        met: dict[int, SiblingWorker] = {}
        try:
            for info in infos:
                if info.rank != self.rank:
                    met[info.rank] = self._meet(info)
        except BaseException:
            for sib in met.values():  # all or nothing: no half-met instance
                self.transport.remove_peer(sib.agent)
            raise
        self.workers = met
        self._ranks = {sib.agent: rank for rank, sib in met.items()}
        self._hosts = tuple(i.host for i in infos)

    def _meet(self, info: Sibling) -> SiblingWorker:
        """Load sibling `info`'s agent; TransferError (nothing loaded) if its entry is not
        one of this instance's workers."""
        agent = self.transport.add_peer(info.agent_metadata)
        regions = CacheRegions(
            tuple(a for a, _ in info.regions),
            tuple(n for _, n in info.regions),
            MemType(info.mem_type),
            info.device_id,
        )
        why = ""
        if agent != info.agent_name:
            why = f"its metadata names agent {agent!r}, its entry {info.agent_name!r}"
        elif regions.lengths != self.regions.lengths:
            why = (
                f"its {len(regions.lengths)} cache regions differ from this worker's "
                f"{len(self.regions.lengths)} (every worker of an instance has the same cache)"
            )
        if why:
            self.transport.remove_peer(agent)
            raise TransferError(f"sibling {info.rank}: {why}")
        return SiblingWorker(info.rank, info.host, agent, regions)

    def fan_out_hosts(self, endpoint: str) -> tuple[str, ...] | None:
        """Every decode worker's host if pulls from the producer at `endpoint` fan out
        (`TransferConfig.fan_out`, siblings met), else None."""
        if self._hosts is None or not self.config.fans_out_from(endpoint):
            return None
        return self._hosts

    def dlist(self, sib: SiblingWorker, g: int) -> Any:
        """`sib`'s regions cut into g-byte units, prepared once per (sibling, g)."""
        return unit_dlist(self.transport, sib.dlists, sib.agent, sib.regions, g)

    def take_notices(self, notifs: dict[str, list[bytes]]) -> None:
        """Keep the `LocalReady` notices of this instance's workers for the pulls they
        name; anything else is logged and dropped."""
        for sender, msgs in notifs.items():
            rank = self._ranks.get(sender)
            for raw in msgs:
                try:
                    if rank is None:
                        raise ProtocolError("not from a worker of this instance")
                    msg = decode(raw, self._key, 64 << 10)
                    if not isinstance(msg, LocalReady) or msg.rank != rank:
                        what = type(msg).__name__
                        raise ProtocolError(f"a {what} naming rank {getattr(msg, 'rank', '?')}")
                except ProtocolError as exc:
                    log.warning(
                        "decode worker %d ignored a notification from %s: %s",
                        self.rank,
                        sender,
                        exc,
                    )
                    continue
                notices = self._ready.setdefault((msg.request_id, msg.generation), [])
                if len(notices) < 4:  # in place, then confirmed or failed
                    notices.append(msg)
                while len(self._ready) > MAX_EARLY_READY:
                    self._ready.popitem(last=False)

    def take_ready(self, request_id: str, generation: int) -> list[LocalReady]:
        """The notices kept for the pull of `request_id` at `generation` (forgotten here)."""
        return self._ready.pop((request_id, generation), [])

    def _copiers(self, pull: ActivePull) -> list[int]:
        """The decode workers that copy `pull`'s bytes from this one (a fan-out)."""
        plan = pull.instance.plan
        if plan is None:
            return []
        return [c.decode_rank for c in plan.local_copies if c.source_rank == self.rank]

    def tell_copiers(self, pull: ActivePull, state: TransferState, reason: str = "") -> None:
        """Tell the workers that copy `pull`'s bytes from this one (a fan-out's source)
        that they are in place (READING: copy them now), confirmed (DONE: use the copy)
        or will not come (FAILED)."""
        copiers = self._copiers(pull)
        if pull.decline is not None or not copiers:
            return
        msg = LocalReady(
            request_id=pull.request_id,
            generation=pull.generation,
            rank=self.rank,
            ok=state is not TransferState.FAILED,
            reason=reason[:4000],
            confirmed=state is TransferState.DONE,
        )
        for rank in copiers:
            try:
                self.transport.send_notif(self.workers[rank].agent, encode(msg, self._key))
            except TransferError as exc:
                log.warning(
                    "decode worker %d: telling decode worker %d that %r is %s failed: %s",
                    self.rank,
                    rank,
                    pull.request_id,
                    state.value,
                    exc,
                )

    def close(self) -> None:
        """Release the lists over the siblings' caches and remove their agents."""
        for sib in self.workers.values():
            for handle in sib.dlists.values():
                self.transport.release_dlist(handle)
            self.transport.remove_peer(sib.agent)
        self.workers.clear()
