"""What a decode worker tells the producer workers about its pulls.

Each producer worker a pull reads from waits for its `ReadDone`: signed with the
handshake's session key, naming its receiver, sent now (so within the producer's lease),
carrying the pull's generation and first token, and `ok=False` with a reason when the
pull gives up, so the producer releases at once instead of at the lease. A worker that
cannot be told (its side channel or handshake is down) is owed the notice
(`owed.OwedNotices`), paid once this worker has met the same producer instance again.
"""

from __future__ import annotations

import logging
import time

from kvbridge.transfer.errors import TransferError
from kvbridge.transfer.messages import ReadDone
from kvbridge.transfer.owed import OwedNotices
from kvbridge.transfer.peers import PeerState, ProducerDirectory, ProducerWorker
from kvbridge.transfer.pull import ActivePull, DecodeWorker

log = logging.getLogger("kvbridge.transfer.consumer")


class ProducerNotices:
    """The `ReadDone`s one decode worker sends producer workers, owned by its
    `KVConsumer` and called from the consumer's thread only. A notice that cannot be
    sent is logged, never raised: the producer then releases at its lease. `owed` holds
    the failure notices of producers cut off, until met again or a lease has passed."""

    def __init__(self, worker: DecodeWorker) -> None:
        self.rank, self.instance_id = worker.rank, worker.instance_id
        self.transport = worker.transport
        # failure notices producers cut off could not be told, paid after the heal
        self.owed = OwedNotices(ttl_s=worker.config.lease_s, clock=worker.clock)

    def done(self, pull: ActivePull, peer: ProducerWorker, failure: str | None = None) -> bytes:
        """Our signed ReadDone of `pull` for `peer`."""
        return self._read_done(
            pull.request_id, peer, failure, pull.generation, pull.start_token, pull.checked
        )

    def _read_done(
        self,
        request_id: str,
        peer: ProducerWorker,
        failure: str | None,
        generation: int = 0,
        start_token: int = 0,
        checked: bool = False,
    ) -> bytes:
        """Our signed ReadDone for `peer` (its session's key; names it as receiver; sent
        now, so within the producer's lease)."""
        assert peer.welcome is not None
        return peer.sign(
            ReadDone(
                request_id=request_id,
                instance_id=self.instance_id,
                rank=self.rank,
                to_instance=peer.welcome.instance_id,
                to_rank=peer.welcome.rank,
                sent_at=time.time(),
                ok=failure is None,
                reason=(failure or "")[:4000],
                generation=generation,
                start_token=start_token,
                digest=checked,
            )
        )

    def notify(self, pull: ActivePull, p: int, peer: ProducerWorker, msg: bytes) -> None:
        """Send a standalone notification; a dead peer is dropped, not fatal here."""
        try:
            self.transport.send_notif(peer.agent, msg)
            pull.notified.add(p)
        except TransferError as exc:
            log.warning(
                "decode worker %d: notifying prefill worker %d of %r failed: %s",
                self.rank,
                p,
                pull.request_id,
                exc,
            )

    def tell_gave_up(self, pull: ActivePull, reason: str) -> None:
        """Tell the producer workers still waiting for `pull` (none of whose READs can
        land any more) that we will not read, so they release now; those we cannot reach
        now (their side channel or handshake is down) are owed the notice, paid once we
        meet the same producer instance again (`OwedNotices`)."""
        inst = pull.instance
        for p, peer in (*inst.readers.items(), *inst.unread.items()):
            if p in pull.notified:
                continue
            if peer.state is PeerState.READY and peer.client.is_connected:
                self.notify(pull, p, peer, self.done(pull, peer, reason))
            elif peer.welcome is not None:  # met: we know which instance waits
                self.owed.owe(inst.endpoint, peer.welcome.instance_id, pull.request_id, p, reason)

    def settle(self, directory: ProducerDirectory) -> None:
        """Pay the notices owed to producers met again (`OwedNotices.settle`)."""
        self.owed.settle(directory.find, self._send_owed)

    def _send_owed(self, peer: ProducerWorker, request_id: str, reason: str) -> bool:
        """Send a failure notice owed to `peer` (met again: its new session signs it);
        whether it went out."""
        try:
            self.transport.send_notif(peer.agent, self._read_done(request_id, peer, reason))
        except TransferError as exc:
            log.warning(
                "decode worker %d: the failure notice of %r owed to %s could not be sent "
                "(%s); it releases at its lease",
                self.rank,
                request_id,
                peer.endpoint,
                exc,
            )
            return False
        log.info(
            "decode worker %d: told %s, met again, that the pull of %r failed",
            self.rank,
            peer.endpoint,
            request_id,
        )
        return True
