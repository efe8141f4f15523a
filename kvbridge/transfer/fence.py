"""Fence words: a decode worker confirms a pull's bytes with one 8-byte READ.

A pull's bytes are the exposure's only if the producer held the exposure until the
pull's READs ended (`pull_progress.py`). The producer says so in its `ReadAck`, a round
trip through its poll loop and the side channel after the ReadDone. The fence words
say it without the producer: each prefill worker keeps `SLOTS` 64-bit words in
registered host memory (`Transport.fence_words`, advertised in its Welcome), and
exposure (request id, generation) owns the word at `slot(...)` while it is pinned:

    expose                    word = tag | HELD
    released, every reader    word = tag | DONE   (each reader's READs ended before
      notified ok                                  its ReadDone, so before this)
    released otherwise        word = 0            (lease expired, aborted, closed)

Each write happens only if the word still holds this exposure's tag, so an exposure
whose slot another took (a hash collision) leaves it alone. A decode worker, once every
READ from a prefill worker is done, READs that worker's word: HELD or DONE with its
exposure's tag means the exposure was pinned when the READs ended (the word is written
before the blocks go back to the engine, and read after the READs completed); anything
else (another exposure's tag, zero, a failed read) leaves the pull waiting for the
`ReadAck` as before, which decides. A tag is 62 bits of a hash of (request id,
generation), the identity a ReadAck confirms too. Checked pulls (`integrity.py`) wait
for the ReadAck, which carries the producer's digest.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.transfer.agent import Transport, XferState
from kvbridge.transfer.errors import TransferError
from kvbridge.transfer.regions import MemType

log = logging.getLogger("kvbridge.transfer.consumer")

#: Words per prefill worker (32 KiB): concurrent exposures collide on one with
#: probability ~ their number / SLOTS, and a collision only costs the ReadAck's wait.
SLOTS = 4096
HELD, DONE = 1, 2


def slot_and_tag(request_id: str, generation: int) -> tuple[int, int]:
    """The word exposure (`request_id`, `generation`) owns, and its tag (low 2 bits 0)."""
    h = hashlib.blake2b(request_id.encode(), digest_size=16, person=b"kvbridge-fence")
    h.update(generation.to_bytes(8, "little", signed=True))
    d = h.digest()
    return int.from_bytes(d[:8], "little") % SLOTS, int.from_bytes(d[8:], "little") & ~3


def confirms(word: int, request_id: str, generation: int) -> bool:
    """Whether `word`, read from the exposure's slot after the READs ended, shows it
    pinned until then (HELD or DONE with its tag)."""
    _, tag = slot_and_tag(request_id, generation)
    return word in (tag | HELD, tag | DONE)


class FenceTable:
    """A prefill worker's fence words (`words`: SLOTS uint64, registered memory that
    peers read); the producer writes them, from its one thread."""

    def __init__(self, words: np.ndarray) -> None:
        if words.dtype != np.uint64 or words.shape != (SLOTS,):
            raise TransferError(
                f"fence words must be {SLOTS} uint64; got {words.dtype} {words.shape}"
            )
        self.words = words

    def hold(self, request_id: str, generation: int) -> None:
        """Exposure (`request_id`, `generation`) is pinned: it takes its word."""
        slot, tag = slot_and_tag(request_id, generation)
        self.words[slot] = tag | HELD

    def release(self, request_id: str, generation: int, completed: bool) -> None:
        """The exposure is released (before its blocks go back to the engine): DONE if
        every reader notified ok (`completed`), else 0; nothing if its word was taken."""
        slot, tag = slot_and_tag(request_id, generation)
        if int(self.words[slot]) == tag | HELD:
            self.words[slot] = tag | DONE if completed else 0


def word_descs(address: int) -> np.ndarray:
    """The SLOTS words at `address` as NIXL descriptors (address, 8, 0), one per word."""
    out = np.zeros((SLOTS, 3), dtype=np.uint64)
    out[:, 0] = address + 8 * np.arange(SLOTS, dtype=np.uint64)
    out[:, 1] = 8
    return out


@dataclass
class FenceRead:
    """One READ of a producer worker's fence word, landing in our word `local`."""

    xfer: Any
    local: int
    request_id: str
    generation: int


class FenceReader:
    """A decode worker's READs of producer workers' fence words: each lands in a free
    word of its own (`Transport.fence_words`), taken until the read is checked or
    dropped. Called from the consumer's thread only."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        mine = transport.fence_words()
        self._words = mine[0] if mine is not None else None
        self._local = (
            transport.prep_local(word_descs(mine[1]), MemType.DRAM) if mine is not None else None
        )
        self._free = list(range(SLOTS - 1, -1, -1))

    def remote(self, agent: str, address: int) -> Any:
        """Producer `agent`'s words at `address`, prepared (the caller releases it)."""
        return self.transport.prep_remote(agent, word_descs(address), MemType.DRAM)

    def post(self, remote: Any, request_id: str, generation: int) -> FenceRead | None:
        """READ the word exposure (`request_id`, `generation`) owns on the producer whose
        words `remote` prepares; None if there is no word free here or NIXL refused (the
        ReadAck decides)."""
        if self._local is None or not self._free:
            return None
        local = self._free.pop()
        slot, _ = slot_and_tag(request_id, generation)
        assert self._words is not None
        self._words[local] = 0
        try:
            xfer, _ = self.transport.read(
                self._local, np.array([local], np.int32), remote, np.array([slot], np.int32), b""
            )
        except TransferError as exc:
            log.debug("a fence READ of %r failed: %s; its ReadAck decides", request_id, exc)
            self._free.append(local)
            return None
        return FenceRead(xfer, local, request_id, generation)

    def check(self, read: FenceRead) -> tuple[XferState, bool]:
        """`read`'s state and whether it confirms its exposure; a done or failed read is
        released and its word freed."""
        st = self.transport.state(read.xfer)
        if st is XferState.PROC:
            return st, False
        assert self._words is not None
        word = int(self._words[read.local])
        self.drop(read)
        return st, st is XferState.DONE and confirms(word, read.request_id, read.generation)

    def drop(self, read: FenceRead) -> None:
        """Release `read` (cancelling it if NIXL still runs it) and free its word: a late
        landing there can only write another exposure's word, which confirms nothing."""
        self.transport.release(read.xfer)
        self._free.append(read.local)

    def close(self) -> None:
        if self._local is not None:
            self.transport.release_dlist(self._local)
            self._local = None
