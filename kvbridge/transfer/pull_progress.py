"""The pulls a decode worker holds, advanced at each poll until their outcome.

A pull HANDSHAKING posts its READs (`PullPlanner.post`) once its producer instance is
ready, and is READING until every READ is done and confirmed.

Bounded failure: a refused or unanswered handshake, a NIXL error, a producer worker
whose side channel answered no heartbeat for `liveness_timeout_s` (its host or link is
down) or a request running past `transfer_timeout_s` fails the request with its reason
(a lost worker is forgotten, so the next pull reconnects); a request that gives up
tells the producer workers still waiting (`ReadDone(ok=False)`), so they release at
once instead of at the lease; one that cannot be told (its host or link is down) is
owed that notice (`notices.py`). A pull's blocks are handed back only when none of its
READs can still write into them: one NIXL could not cancel keeps the pull (and its
blocks) held, retried every second, and its outcome is reported, and its producers
told, once it is released, so a late completion never lands in blocks given to another
request (and the producer keeps its source blocks until then).

Fencing: a pull's READs are DONE once NIXL has copied the bytes, but the bytes are the
exposure's only if the producer still held it for the whole read (a reader paused or cut
off past the lease reads blocks the producer may have given to another request). So a
pull is DONE only once every producer worker it read bytes from answered its ReadDone
with `ReadAck(held=True)` for the pull's generation (the capability's); `held=False`
fails it at once as stale (`PullFailure.STALE`, its reason naming the exposure), and an
answer that never comes fails it at the liveness or transfer bound like a READ. A
checked pull whose bytes differ from the producer's digest of them fails as
`PullFailure.INTEGRITY`. An unchecked pull need not wait for the ReadAcks: once its
READs are done it READs each producer worker's fence word (`fence.py`), and a word that
shows the exposure held confirms that worker at once (any other word leaves it to the
ReadAck). A fan-out's copier (`siblings.py`) is DONE once its READs from
its source's cache are done and the source's pull is confirmed.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvbridge.errors import KVBridgeError
from kvbridge.plan.copylist import CopyList, copy_lists
from kvbridge.transfer.agent import XferState
from kvbridge.transfer.errors import TransferError
from kvbridge.transfer.fence import FenceReader
from kvbridge.transfer.integrity import digest
from kvbridge.transfer.messages import spec_error
from kvbridge.transfer.notices import ProducerNotices
from kvbridge.transfer.peers import (
    MAX_ACKS,
    PeerState,
    ProducerDirectory,
    ProducerInstance,
    ProducerWorker,
)
from kvbridge.transfer.pull import (
    LOCAL,
    RELEASE_RETRY_S,
    ActivePull,
    DecodeWorker,
    PullFailure,
    TransferResult,
    TransferState,
)
from kvbridge.transfer.pull_planner import PullPlanner, pull_end
from kvbridge.transfer.regions import clear_slots, tail_slots
from kvbridge.transfer.siblings import Siblings
from kvbridge.transfer.staging import Staging

log = logging.getLogger("kvbridge.transfer.consumer")


class PullProgress:
    """The pulls one decode worker holds (`pulls`, by request id), owned by its
    `KVConsumer` and called from the consumer's thread only. `advance` moves a pull on
    and never raises for a peer's failure: the pull fails with its reason instead.
    `finish` ends a pull once; its `TransferResult` is queued (`take_results`) when no
    READ of it can write into its blocks any more, never for a decline. `remeet` names
    the producers that left a pull unconfirmed until its timeout, for the consumer to
    meet afresh once no pull reads from them."""

    def __init__(
        self,
        worker: DecodeWorker,
        directory: ProducerDirectory,
        planner: PullPlanner,
        siblings: Siblings,
        notices: ProducerNotices,
        views: list[Any],
        staging: Staging,
        fence: FenceReader,
    ) -> None:
        self.rank, self.transport, self.config = worker.rank, worker.transport, worker.config
        self._clock = worker.clock
        self._directory, self._planner = directory, planner
        self._siblings, self._notices = siblings, notices
        self._views = views  # to digest what we pulled
        self._regions = worker.regions  # to zero the slots read past a prompt
        self._staging = staging  # where a converting plan's reads land, cast from there
        self._fence = fence  # reads producers' fence words
        self.pulls: dict[str, ActivePull] = {}
        #: producers to meet afresh once no pull reads from them (`KVConsumer`)
        self.remeet: dict[str, tuple[ProducerInstance, str]] = {}
        self._results: list[TransferResult] = []

    @property
    def is_busy(self) -> bool:
        """A pull is in flight (one that ended, waiting for a READ NIXL could not cancel,
        does not count)."""
        return any(p.outcome is None for p in self.pulls.values())

    @property
    def num_held_blocks(self) -> int:
        """Local blocks of requests not yet reported (the rest were handed back)."""
        return sum(len(p.local_block_ids) for p in self.pulls.values())

    def instances(self) -> list[ProducerInstance]:
        """The producer instances the pulls held read from."""
        return [p.instance for p in self.pulls.values()]

    def take_results(self) -> list[TransferResult]:
        """The outcomes reported since the last call."""
        out, self._results = self._results, []
        return out

    def poll(self, now: float) -> None:
        """Advance every pull held."""
        for pull in list(self.pulls.values()):
            self._advance(pull, now)

    def close(self) -> None:
        """Fail every pull held ("consumer closed"), reported whatever NIXL still holds."""
        for pull in list(self.pulls.values()):
            self.finish(pull, TransferState.FAILED, "consumer closed", final=True)

    def _advance(self, pull: ActivePull, now: float) -> None:
        if pull.outcome is not None:  # ended; a READ NIXL could not cancel yet
            if now >= pull.retry_at:
                self.finish(pull, pull.outcome[0], pull.outcome[1])
            return
        inst = pull.instance
        if pull.state is TransferState.HANDSHAKING:
            if inst.reason:
                self.finish(pull, TransferState.FAILED, inst.reason)
                return
            if inst.is_ready and pull.decline is not None:
                self.finish(pull, TransferState.FAILED, f"declined: {pull.decline}")
                return
            if inst.is_ready:
                try:
                    if not inst.prepared:
                        self._planner.prepare(inst)
                    self._planner.post(pull)
                except KVBridgeError as exc:
                    self.finish(pull, TransferState.FAILED, spec_error(exc))
                    return
        if pull.state is TransferState.READING:
            for i, (p, xfer) in list(pull.xfers.items()):
                st = self.transport.state(xfer)
                if p == LOCAL:
                    if st is XferState.DONE:
                        self.transport.release(xfer)
                        del pull.xfers[i]
                    elif st is XferState.ERR:
                        self.finish(
                            pull,
                            TransferState.FAILED,
                            f"NIXL READ from decode worker {pull.source}'s cache on this host "
                            "ended in ERR state; that worker may have died",
                        )
                        return
                    continue
                if st is XferState.DONE:  # NIXL delivered the READ's notification, if any
                    log.debug(
                        "decode worker %d: a READ of %r from prefill worker %d done",
                        self.rank,
                        pull.request_id,
                        p,
                    )
                    self.transport.release(xfer)
                    del pull.xfers[i]
                    inst.readers[p].warm = True
                    if p not in pull.silent:
                        pull.notified.add(p)
                    elif all(q != p for q, _ in pull.xfers.values()):  # p's last READ
                        self._read_all(pull, p)
                elif st is XferState.ERR:
                    peer = inst.readers[p]
                    reason = (
                        f"NIXL READ from prefill worker {p} ({peer.endpoint}, agent "
                        f"{peer.agent!r}) ended in ERR state; the producer worker may have died"
                    )
                    self._directory.drop(peer, reason)
                    self.finish(pull, TransferState.FAILED, reason)
                    return
            if pull.source is not None:
                if self._copy_from_source(pull):
                    return
            elif not pull.xfers:
                pull.clock.read = pull.clock.read or time.perf_counter()
                if not pull.told_copiers:  # the bytes are here: copiers may copy them now
                    pull.told_copiers = True
                    self._siblings.tell_copiers(pull, TransferState.READING)
                if self._confirmed(pull):
                    return
        if now >= pull.deadline:
            unconfirmed = pull.awaiting_acks
            reason = pull.timeout_reason(self.config.transfer_timeout_s)
            self.finish(pull, TransferState.FAILED, reason)
            if unconfirmed:  # our session may be gone there (evicted): meet it afresh
                self.remeet[inst.endpoint] = (inst, reason)

    def _confirmed(self, pull: ActivePull) -> bool:
        """Take the ReadAcks of `pull` (every READ done): DONE once every producer
        worker read answered held, FAILED (stale) at the first that did not. Whether
        the pull ended."""
        cast = pull.instance.plan.cast if pull.instance.plan is not None else None
        if pull.checked and pull.digests is None:  # while the producers digest theirs
            views = self._views if cast is None else self._staging.views(cast)
            t0 = time.perf_counter()
            prompt = self._prompt_copies(pull)
            pull.digests = {p: digest(views, prompt.get(p, []), "dst") for p in pull.awaiting}
            pull.clock.digest_s = time.perf_counter() - t0
        self._read_fences(pull)
        for p in sorted(pull.awaiting):
            peer = pull.instance.readers[p]
            ack = peer.acks.get((pull.request_id, pull.generation))
            if ack is None:
                continue
            del peer.acks[(pull.request_id, pull.generation)]
            log.debug(
                "decode worker %d: ReadAck of %r from prefill worker %d (held %s)",
                self.rank,
                pull.request_id,
                p,
                ack.held,
            )
            if not ack.held:
                self.finish(
                    pull,
                    TransferState.FAILED,
                    f"stale pull: prefill worker {p} ({peer.endpoint}) no longer held "
                    f"{pull.request_id!r} (generation {pull.generation}) when our ReadDone "
                    f"arrived ({ack.reason}); the bytes read may be another request's",
                    failure=PullFailure.STALE,
                )
                return True
            if pull.digests is not None and ack.digest and ack.digest != pull.digests[p]:
                nbytes = sum(cl.nbytes for cl in pull.copies[p])
                self.finish(
                    pull,
                    TransferState.FAILED,
                    f"integrity check failed: the {nbytes} bytes of {pull.request_id!r} read "
                    f"from prefill worker {p} ({peer.endpoint}) differ from its digest of what "
                    "it exposed; the KV is not used",
                    failure=PullFailure.INTEGRITY,
                )
                return True
            pull.awaiting.discard(p)
        if pull.awaiting:
            return False
        if cast is not None:  # the bytes read are the producers': into the cache now
            t0 = time.perf_counter()
            self._staging.cast(pull)
            pull.clock.cast_s = time.perf_counter() - t0
        self._zero_tail(pull)
        self.finish(pull, TransferState.DONE, "")
        return True

    def _read_all(self, pull: ActivePull, p: int) -> None:
        """Every READ of `pull` from prefill worker `p` is done: READ `p`'s fence word if
        it has fence words and the pull is not checked (the word may confirm the pull
        before the ReadAck comes), then send our ReadDone. A READ posted after a
        notification waits for the producer's next poll, and one still running when a
        notification is sent may too: the READ of the word is checked once before the
        ReadDone goes (on one host it is done by then), and at each poll after
        (`_read_fences`)."""
        peer = pull.instance.readers[p]
        if peer.fence is not None and not pull.checked:
            read = self._fence.post(peer.fence, pull.request_id, pull.generation)
            if read is not None:
                pull.fences[p] = read
                self._read_fences(pull)
        self._notices.notify(pull, p, peer, self._notices.done(pull, peer))

    def _read_fences(self, pull: ActivePull) -> None:
        """Check the READs of fence words `pull` posted: a word that confirms takes its
        worker off `awaiting` (its ReadAck is dropped as it comes); any other word, or a
        failed READ, leaves the ReadAck to decide."""
        for p, read in list(pull.fences.items()):
            state, held = self._fence.check(read)
            if state is XferState.PROC:
                continue
            del pull.fences[p]
            if held:
                peer = pull.instance.readers[p]
                key = (pull.request_id, pull.generation)
                pull.awaiting.discard(p)
                pull.fenced += 1
                peer.acks.pop(key, None)
                peer.fenced[key] = None
                while len(peer.fenced) > MAX_ACKS:
                    peer.fenced.popitem(last=False)

    def _prompt_copies(self, pull: ActivePull) -> dict[int, list[CopyList]]:
        """`pull`'s copy lists of its prompt's tokens only, by prefill rank: what the
        producers digest (the slots it read past the prompt are zeroed here instead)."""
        assert pull.instance.plan is not None
        if pull_end(pull, self._regions) == pull.num_tokens:  # read the prompt only
            return pull.copies
        out: dict[int, list[CopyList]] = {}
        for cl in copy_lists(
            pull.instance.plan,
            self.rank,
            pull.producer_block_ids,
            pull.local_block_ids,
            pull.num_tokens,
            pull.start_token,
        ):
            out.setdefault(cl.read.prefill_rank, []).append(cl)
        return out

    def _zero_tail(self, pull: ActivePull) -> None:
        """Zero this worker's slots past `pull`'s prompt that it read whole
        (`pull_end`): its producer zeroed them as it exposed them, but a READ that raced
        the expose may have brought what they held before."""
        plan = pull.instance.plan
        assert plan is not None
        end = pull_end(pull, self._regions)
        shard = plan.decode_workers[self.rank]
        boxes = tail_slots(
            plan.model,
            plan.decode,
            shard,
            pull.local_block_ids,
            pull.start_token,
            pull.num_tokens,
            end,
        )
        clear_slots(self._regions, boxes)

    def _copy_from_source(self, pull: ActivePull) -> bool:
        """A fan-out's second hop: once `pull`'s source tells that the bytes are in its
        cache (`LocalReady`), READ them from there (on this host); DONE once those READs
        are done and the source's pull is confirmed by the producers, FAILED if the
        source's pull failed (once no READ of ours is left). Whether the pull ended."""
        assert pull.source is not None
        for notice in self._siblings.take_ready(pull.request_id, pull.generation):
            if notice.rank != pull.source:
                log.warning(
                    "decode worker %d: a LocalReady of %r from decode worker %d, which does "
                    "not read it for this worker (%d does); ignored",
                    self.rank,
                    pull.request_id,
                    notice.rank,
                    pull.source,
                )
                continue
            if not notice.ok:
                pull.source_failure = notice.reason
                break
            pull.source_confirmed |= notice.confirmed
            if not pull.local_posted:
                # the second hop gets a transfer timeout of its own from here: a reader
                # that took its whole bound leaves its copiers time to copy
                pull.deadline = max(pull.deadline, self._clock() + self.config.transfer_timeout_s)
                try:
                    self._planner.copy(pull)
                except TransferError as exc:
                    self.finish(pull, TransferState.FAILED, str(exc))
                    return True
        if pull.xfers:
            return False
        if pull.source_failure is not None:
            self.finish(
                pull,
                TransferState.FAILED,
                f"decode worker {pull.source}, which reads these bytes over the link for "
                f"this worker, failed its pull: {pull.source_failure}",
            )
            return True
        if pull.source_confirmed:
            self._zero_tail(pull)
            self.finish(pull, TransferState.DONE, "")
            return True
        return False

    def abandon_lost(self) -> None:
        """Fail the pulls reading from a producer worker whose side channel is down (its
        heartbeats went unanswered for `liveness_timeout_s`: its host or the link is down,
        or it died), then forget those workers: their UCX endpoints and connections may
        be stale (a TCP connection backing off after an outage), so the next pull
        handshakes afresh instead of stalling on them. Every such pull is finished before
        any worker is dropped (dropping releases descriptor lists its READs use)."""
        lost: dict[str, tuple[ProducerWorker, str]] = {}
        for pull in list(self.pulls.values()):
            if pull.outcome is not None:
                continue  # ended already; its READs are being released
            reading = {p for p, _ in pull.xfers.values() if p != LOCAL} | pull.awaiting
            gone = [
                (p, pull.instance.readers[p])
                for p in sorted(reading)
                if not pull.instance.readers[p].client.is_connected
            ]
            if gone:
                p, peer = gone[0]
                reason = (
                    f"lost contact with prefill worker {p} ({peer.endpoint}): its side "
                    "channel was closed or answered no heartbeat for "
                    f"{self.config.liveness_timeout_s:g} s (liveness_timeout_s); its host "
                    "or the link is down, or it died"
                )
                lost.update((w.endpoint, (w, reason)) for _, w in gone)
                self.finish(pull, TransferState.FAILED, reason)
        for peer, reason in lost.values():
            if peer.state is not PeerState.FAILED:
                self._directory.drop(peer, reason, quiet=True)

    def finish(
        self,
        pull: ActivePull,
        state: TransferState,
        reason: str,
        *,
        final: bool = False,
        failure: PullFailure | None = None,
    ) -> None:
        """End `pull` with `state`. A READ NIXL cannot cancel may still write into the
        pull's blocks (a late completion after a link heals), so while one is left the
        pull stays held, its blocks with it, and is retried every `RELEASE_RETRY_S`: its
        outcome is reported, and its blocks handed back, once no READ of it can land
        (`final`, at close: reported anyway, the cache goes with the agent)."""
        first = pull.outcome is None
        state, reason, failure = pull.outcome = pull.outcome or (state, reason, failure)
        if first:
            self._siblings.tell_copiers(pull, state, reason)
            self._siblings.take_ready(pull.request_id, pull.generation)
        pull.xfers = {i: px for i, px in pull.xfers.items() if not self.transport.release(px[1])}
        for read in pull.fences.values():
            self._fence.drop(read)
        pull.fences.clear()
        if pull.xfers and not final:
            pull.retry_at = self._clock() + RELEASE_RETRY_S
            if first:
                log.warning(
                    "decode worker %d: pull of %r ended (%s) but NIXL could not cancel %d "
                    "of its READs; its %d blocks stay held until it can",
                    self.rank,
                    pull.request_id,
                    reason or state.value,
                    len(pull.xfers),
                    len(pull.local_block_ids),
                )
            return
        cancelled = not pull.xfers
        pull.xfers.clear()
        if state is TransferState.FAILED and cancelled:
            self._notices.tell_gave_up(pull, reason)
        if cancelled:
            for handle in pull.temp_dlists:
                self.transport.release_dlist(handle)
        elif pull.temp_dlists:  # a READ NIXL could not cancel may still use them
            self._planner.keep_until_close(pull.temp_dlists)
            log.warning(
                "decode worker %d: keeping %d descriptor lists of %r until close: NIXL "
                "could not cancel its READ before the consumer closed",
                self.rank,
                len(pull.temp_dlists),
                pull.request_id,
            )
        if state is TransferState.FAILED and pull.decline is None:
            log.warning(
                "decode worker %d: pull of %r failed: %s", self.rank, pull.request_id, reason
            )
        del self.pulls[pull.request_id]
        if pull.decline is not None:
            return  # nobody waits for a decline's outcome
        nbytes, ndesc, nunmerged, nidx = pull.stats
        self._results.append(
            TransferResult(
                pull.request_id,
                state,
                reason,
                tuple(int(b) for b in pull.local_block_ids),
                nbytes,
                ndesc,
                nunmerged,
                nidx,
                failure,
                pull.local_nbytes,
                pull.checked,
                pull.clock.phases(time.perf_counter()),
                pull.handshake,
                pull.cold_peers,
                pull.fenced,
            )
        )
