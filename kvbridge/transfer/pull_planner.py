"""How a decode worker reads a pull: its copy lists turned into posted NIXL READs.

Once per producer instance the descriptor lists a whole-block request needs are
prepared, over units of the gcd of its copies' offsets, lengths and region sizes
(`descriptors.py`). Per pull one NIXL READ is posted per producer worker, indexing those
lists and carrying the `ReadDone` notification to that worker, unless the worker has
fence words: its ReadDone then follows the READ of its word (`PullProgress`). A pull
reads its prompt's last block whole where both sides' blocks go on
(`TransferPlan.read_end`), so it is whole units too at equal block sizes; copies that
are not (a pull that starts or ends inside a block of one side only) go in a second READ
with descriptor lists of their own, released with the pull; a worker read twice gets its
notification once its last READ is done (`PullProgress`). A fan-out's copier READs its
bytes from the source's cache on this host the same way (`copy`). Note that with UCX's
cma transport a READ is copied inside `transfer()`, so a `post` of a large READ takes
its copy time. A plan that converts the KV dtype (`TransferPlan.cast`) reads into the
worker's staging buffer of the prefill's dtype (`staging.py`) instead of its cache.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from kvbridge.plan.copylist import CopyList, copy_lists, local_copy_lists
from kvbridge.transfer.descriptors import (
    exact_descs,
    num_units,
    unit_descs,
    unit_indices,
    unit_size,
)
from kvbridge.transfer.errors import TransferError
from kvbridge.transfer.fence import FenceReader
from kvbridge.transfer.notices import ProducerNotices
from kvbridge.transfer.peers import ProducerDirectory, ProducerInstance, ProducerWorker
from kvbridge.transfer.pull import LOCAL, ActivePull, DecodeWorker, TransferState
from kvbridge.transfer.regions import CacheRegions, read_end
from kvbridge.transfer.siblings import Siblings
from kvbridge.transfer.staging import Staging

log = logging.getLogger("kvbridge.transfer.consumer")


def pull_end(pull: ActivePull, local: CacheRegions) -> int:
    """Where `pull` into the cache `local` stops reading (`regions.read_end`): its
    prompt's last block whole from and into host memory; the same for a fan-out's
    reader and its copiers (one instance's caches lie in one kind of memory)."""
    inst = pull.instance
    assert inst.plan is not None and inst.worker0.regions is not None
    return read_end(inst.plan, pull.num_tokens, inst.worker0.regions.mem_type, local.mem_type)


def prompt_nbytes(pull: ActivePull, cl: CopyList) -> int:
    """The bytes of `pull`'s tokens [start_token, num_tokens) in `cl`: what a pull
    reports (the slots read past its last token carry no KV)."""
    return cl.read.bytes_per_token * (pull.num_tokens - pull.start_token)


class PullPlanner:
    """Plans and posts one decode worker's READs, owned by its `KVConsumer` and called
    from the consumer's thread only. Owns the prepared lists over this worker's cache
    (one per unit size) and the per-request lists a READ NIXL could not cancel may still
    use (`keep_until_close`); releases both at `close`. A READ NIXL refuses raises
    TransferError naming its peer; the pull's own lists made so far are in
    `ActivePull.temp_dlists`, for whoever ends it to release."""

    def __init__(
        self,
        worker: DecodeWorker,
        directory: ProducerDirectory,
        siblings: Siblings,
        notices: ProducerNotices,
        staging: Staging,
        fence: FenceReader,
    ) -> None:
        self.rank, self.regions, self.num_blocks = worker.rank, worker.regions, worker.num_blocks
        self.transport, self.config = worker.transport, worker.config
        self._directory, self._siblings, self._notices = directory, siblings, notices
        self._staging = staging
        self._fence = fence
        # by (first address of the regions cut, unit): the cache's, a staging buffer's
        self._local_dlists: dict[tuple[int, int], Any] = {}
        self._orphan_dlists: list[Any] = []  # of READs still uncancelled at close

    def prepare(self, inst: ProducerInstance) -> None:
        """Prepare, once per instance, the descriptor lists a whole-block request needs
        (probe: scattered odd block ids on both sides, so no run merges across blocks),
        and remember their unit per prefill rank. Copies finer than that unit (a block
        cut inside on one side only) get per-request descriptors instead: a list of whole regions
        cut that fine would hold ~a descriptor per token and head, and take seconds."""
        assert inst.plan is not None
        inst.prepared = True
        for peer in inst.readers.values():  # their fence words (`fence.py`), if any
            assert peer.welcome is not None
            if peer.fence is None and peer.welcome.fence_words:
                peer.fence = self._fence.remote(peer.agent, peer.welcome.fence_words)
        local = self.local_regions(inst)
        bp, bd = inst.plan.prefill.block_size, inst.plan.decode.block_size
        tokens = math.lcm(bp, bd)
        p_ids = 1 + 2 * np.arange(tokens // bp)
        d_ids = 1 + 2 * np.arange(tokens // bd)
        if d_ids[-1] >= self.num_blocks:
            return
        for cl in copy_lists(inst.plan, self.rank, p_ids, d_ids, tokens):
            peer = inst.readers[cl.read.prefill_rank]
            assert peer.regions is not None and peer.welcome is not None
            if p_ids[-1] >= peer.welcome.num_blocks:
                continue
            g = unit_size(cl, peer.regions.lengths, local.lengths)
            if max(num_units(peer.regions, g), num_units(local, g)) <= self.config.max_units:
                self.local_dlist(g, local)
                self._directory.remote_dlist(peer, g)
                inst.block_units[cl.read.prefill_rank] = g
        for lc in local_copy_lists(inst.plan, self.rank, d_ids, tokens):
            sib = self._siblings.workers[lc.read.source_rank]
            g = unit_size(lc, sib.regions.lengths, self.regions.lengths)
            if sib.unit is None and num_units(self.regions, g) <= self.config.max_units:
                self.local_dlist(g, self.regions)
                self._siblings.dlist(sib, g)
                sib.unit = g

    def post(self, pull: ActivePull) -> None:
        """Post `pull`'s READs from the producer workers (READING from here), notify the
        workers it reads nothing from, and note its fan-out source, if any."""
        inst = pull.instance
        assert inst.plan is not None
        if pull.is_state and not inst.plan.same_pages:
            theirs, ours = inst.plan.prefill, inst.plan.decode
            raise TransferError(
                f"{pull.request_id!r} holds an SSM layer's state, moved as whole pages, but "
                f"the prefill instance runs tp_size={theirs.tp_size}, block_size="
                f"{theirs.block_size} and this one tp_size={ours.tp_size}, block_size="
                f"{ours.block_size} (or they differ in layout, dtype or fan-out); an SSM "
                "hybrid moves between instances of the same tp_size and block_size"
            )
        pull.clock.posting = time.perf_counter()
        lists = copy_lists(
            inst.plan,
            self.rank,
            pull.producer_block_ids,
            pull.local_block_ids,
            pull_end(pull, self.regions),
            pull.start_token,
        )
        nbytes = ndesc = nunmerged = nidx = 0
        pull.state = TransferState.READING
        posts: list[tuple[int, ProducerWorker, tuple[Any, np.ndarray, Any, np.ndarray]]] = []
        for cl in lists:
            p = cl.read.prefill_rank
            pull.copies.setdefault(p, []).append(cl)
            peer = inst.readers[p]
            assert peer.welcome is not None and peer.regions is not None
            if (
                len(pull.producer_block_ids)
                and pull.producer_block_ids.max() >= peer.welcome.num_blocks
            ):
                raise TransferError(
                    f"producer block id {int(pull.producer_block_ids.max())} of "
                    f"{pull.request_id!r} is outside prefill worker {p}'s "
                    f"{peer.welcome.num_blocks} blocks"
                )
            if cl.nbytes == 0:  # nothing to read, but the producer still waits for us
                self.transport.send_notif(peer.agent, self._notices.done(pull, peer))
                pull.notified.add(p)
                continue
            assert peer.regions is not None
            reads = self._reads(
                pull,
                cl,
                peer.agent,
                peer.regions,
                inst.block_units.get(p),
                functools.partial(self._directory.remote_dlist, peer),
                self.local_regions(inst),
            )
            posts += [(p, peer, r) for r in reads]
            nbytes += prompt_nbytes(pull, cl)
            ndesc += cl.num_descriptors
            nunmerged += cl.num_unmerged
        # A prefill worker read by one READ gets the notification with it; one read by
        # several (whole blocks + a block cut inside) gets it after the last completes.
        reads_of = Counter(p for p, _, _ in posts)
        # ... and one with fence words gets it after the READ of its word (`PullProgress`)
        fenced = {p for p in reads_of if inst.readers[p].fence is not None and not pull.checked}
        pull.silent = {p for p, n in reads_of.items() if n > 1} | fenced
        pull.awaiting = set(reads_of)
        pull.cold_peers = sum(not inst.readers[p].warm for p in reads_of)
        for p, peer, (local, local_idx, remote, remote_idx) in posts:
            try:
                notif = b"" if p in pull.silent else self._notices.done(pull, peer)
                xfer, _ = self.transport.read(local, local_idx, remote, remote_idx, notif)
            except TransferError as exc:
                reason = (
                    f"READ from prefill worker {p} ({peer.endpoint}) failed: {exc}; "
                    "the producer worker may have died"
                )
                self._directory.drop(peer, reason)
                raise TransferError(reason) from None
            pull.xfers[len(pull.xfers)] = (p, xfer)
            nidx += len(local_idx)
        for p, peer in inst.unread.items():
            self._notices.notify(pull, p, peer, self._notices.done(pull, peer))
        pull.stats = (nbytes, ndesc, nunmerged, nidx)
        pull.clock.posted = time.perf_counter()
        copies = inst.plan.local_copies_for(self.rank)
        if copies:  # a fan-out's copy: from the source's cache once it has the bytes
            pull.source = copies[0].source_rank
        log.debug(
            "decode worker %d: %r posted %d READs of %d bytes from prefill workers %s",
            self.rank,
            pull.request_id,
            len(pull.xfers),
            nbytes,
            sorted(pull.awaiting),
        )

    def copy(self, pull: ActivePull) -> None:
        """Post the READs of `pull`'s bytes from its source's cache; TransferError if
        NIXL refuses one."""
        assert pull.source is not None and pull.instance.plan is not None
        sib = self._siblings.workers[pull.source]
        pull.local_posted = True
        for cl in local_copy_lists(
            pull.instance.plan,
            self.rank,
            pull.local_block_ids,
            pull_end(pull, self.regions),
            pull.start_token,
        ):
            for local, local_idx, remote, remote_idx in self._reads(
                pull,
                cl,
                sib.agent,
                sib.regions,
                sib.unit,
                functools.partial(self._siblings.dlist, sib),
                self.regions,
            ):
                try:
                    xfer, _ = self.transport.read(local, local_idx, remote, remote_idx, b"")
                except TransferError as exc:
                    raise TransferError(
                        f"READ from decode worker {sib.rank}'s cache on this host failed: {exc}"
                    ) from None
                pull.xfers[max(pull.xfers, default=-1) + 1] = (LOCAL, xfer)
            pull.local_nbytes += prompt_nbytes(pull, cl)
        log.debug(
            "decode worker %d: %r copies %d bytes from decode worker %d",
            self.rank,
            pull.request_id,
            pull.local_nbytes,
            sib.rank,
        )

    def _reads(
        self,
        pull: ActivePull,
        cl: CopyList,
        agent: str,
        regions: CacheRegions,
        unit: int | None,
        remote_dlist: Callable[[int], Any],
        local_regions: CacheRegions,
    ) -> list[tuple[Any, np.ndarray, Any, np.ndarray]]:
        """(local list, local indices, remote list, remote indices) of each READ for `cl`
        from `agent`'s `regions` into `local_regions`: copies that are whole `unit`s index the prepared lists
        (`remote_dlist(unit)`); the rest (a block cut inside) get this request's own
        descriptors, prepared now and released with it."""
        out = []
        whole = np.zeros(len(cl.lengths), dtype=bool)
        if unit is not None:
            whole = (cl.lengths % unit == 0) & (cl.src_offsets % unit == 0)
            whole &= cl.dst_offsets % unit == 0
            if whole.any():
                remote_idx, local_idx = unit_indices(cl.select(whole), unit, regions, local_regions)
                local, remote = self.local_dlist(unit, local_regions), remote_dlist(unit)
                out.append((local, local_idx, remote, remote_idx))
        if not whole.all():
            rdescs, ldescs = exact_descs(cl.select(~whole), regions, local_regions)
            local = self.transport.prep_local(ldescs)
            pull.temp_dlists.append(local)  # released with the request, even if the next fails
            remote = self.transport.prep_remote(agent, rdescs, regions.mem_type)
            pull.temp_dlists.append(remote)
            idx = np.arange(len(ldescs), dtype=np.int32)
            out.append((local, idx, remote, idx))
        return out

    def local_regions(self, inst: ProducerInstance) -> CacheRegions:
        """Where the reads from `inst` land: this worker's cache, or the staging buffer
        of the prefill's dtype when the plan converts the KV."""
        assert inst.plan is not None
        if inst.plan.cast is None:
            return self.regions
        return self._staging.regions(inst.plan.cast)

    def local_dlist(self, g: int, regions: CacheRegions) -> Any:
        """`regions` (this worker's cache or a staging buffer) cut into g-byte units,
        prepared once per g."""
        key = (regions.addresses[0], g)
        if key not in self._local_dlists:
            self._local_dlists[key] = self.transport.prep_local(unit_descs(regions, g))
        return self._local_dlists[key]

    def keep_until_close(self, handles: list[Any]) -> None:
        """Keep a pull's own lists until `close`: a READ NIXL could not cancel may still
        use them."""
        self._orphan_dlists += handles

    def close(self, handles: list[Any]) -> None:
        """Release every list this planner prepared or kept, then `handles` (lists of
        others kept until the agent closes)."""
        self._orphan_dlists += handles
        for handle in (*self._local_dlists.values(), *self._orphan_dlists):
            self.transport.release_dlist(handle)
        self._local_dlists.clear()
        self._orphan_dlists.clear()
