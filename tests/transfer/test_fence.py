"""Fence words (`fence.py`): a pull is confirmed by one 8-byte READ of its producer
worker's word instead of waiting for the ReadAck, and only while the exposure was held.

The table's rules on a bare array; then real NIXL agents in this process: a pull confirmed
with its producer never polled after the handshake (no ReadAck could come), and a pull of
an exposure its lease released, which the word does not confirm (its ReadAck fails it as
stale, as before)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvbridge.transfer import fence
from kvbridge.transfer.agent import NixlTransport
from kvbridge.transfer.config import TransferConfig
from kvbridge.transfer.consumer import KVConsumer, TransferResult
from kvbridge.transfer.fence import DONE, HELD, SLOTS, FenceTable, confirms, slot_and_tag
from kvbridge.transfer.integrity import Integrity
from kvbridge.transfer.producer import KVProducer, ReleaseCause
from kvbridge.transfer.pull import PullFailure, TransferState

from .fakes import MODEL, NUM_BLOCKS, PREFILL, Clock, regions


def test_a_word_confirms_its_exposure_while_held_and_after_a_completed_release() -> None:
    table = FenceTable(np.zeros(SLOTS, dtype=np.uint64))
    slot, tag = slot_and_tag("r", 7)
    assert not confirms(int(table.words[slot]), "r", 7)  # not exposed yet
    table.hold("r", 7)
    assert int(table.words[slot]) == tag | HELD and confirms(tag | HELD, "r", 7)
    assert not confirms(tag | HELD, "r", 8) and not confirms(tag | HELD, "s", 7)
    table.release("r", 7, completed=True)  # every reader notified: its reads had ended
    assert int(table.words[slot]) == tag | DONE and confirms(tag | DONE, "r", 7)
    table.hold("r", 9)
    table.release("r", 9, completed=False)  # lease expired, aborted, closed
    assert not confirms(int(table.words[slot_and_tag("r", 9)[0]]), "r", 9)


def test_an_exposure_whose_word_another_took_is_never_confirmed_by_it(monkeypatch) -> None:
    """Two exposures on one word (every hash lands on slot 5): the later one owns it;
    the earlier one's release leaves it alone, and it confirms only its owner."""
    real = fence.slot_and_tag
    monkeypatch.setattr(fence, "slot_and_tag", lambda r, g: (5, real(r, g)[1]))
    table = FenceTable(np.zeros(SLOTS, dtype=np.uint64))
    table.hold("a", 1)
    table.hold("b", 1)
    assert not fence.confirms(int(table.words[5]), "a", 1)
    table.release("a", 1, completed=False)  # its word was taken: nothing written
    assert fence.confirms(int(table.words[5]), "b", 1)
    table.release("b", 1, completed=True)
    assert fence.confirms(int(table.words[5]), "b", 1)
    assert not fence.confirms(int(table.words[5]), "a", 1)


Pair = tuple[KVProducer, KVConsumer, Clock]


@pytest.fixture
def pair() -> Iterator[Pair]:
    """A prefill and a decode worker (tp 1 each) with real NIXL agents in this process,
    met by a first pull (handshake, prepared lists, a warm path)."""
    clock = Clock()
    pr, dr = regions(PREFILL, 0), regions(PREFILL, 0)
    p = KVProducer(
        model=MODEL,
        layout=PREFILL,
        rank=0,
        regions=pr,
        num_blocks=NUM_BLOCKS,
        transport=NixlTransport("fence-p", pr),
        config=TransferConfig(lease_s=10),
        instance_id="P",
        clock=clock,
    )
    c = KVConsumer(
        model=MODEL,
        layout=PREFILL,
        rank=0,
        regions=dr,
        num_blocks=NUM_BLOCKS,
        transport=NixlTransport("fence-d0", dr),
        config=TransferConfig(integrity=Integrity.OFF, transfer_timeout_s=20),
        instance_id="D",
    )
    try:
        p.expose("warm", [1, 2], 20, generation=1)
        c.pull("warm", p.endpoint, [1, 2], [3, 4], 20, generation=1)
        (res,) = until(c, p)
        assert res.state is TransferState.DONE, res.reason
        deadline = time.monotonic() + 10
        while p.num_pinned_blocks and time.monotonic() < deadline:  # its ReadDone taken
            p.poll(timeout_ms=1)
        assert p.releases[-1].cause is ReleaseCause.COMPLETED
        yield p, c, clock
    finally:
        c.close()
        p.close()
        p.transport.close()
        c.transport.close()


def until(c: KVConsumer, p: KVProducer | None, timeout_s: float = 20) -> list[TransferResult]:
    """Poll `c` (and `p`, if given) until `c` reports an outcome."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if p is not None:
            p.poll(timeout_ms=1)
        out = c.poll()
        if out:
            return out
        time.sleep(0.001)
    raise AssertionError(f"no outcome in {timeout_s} s")


def test_a_pull_is_confirmed_by_the_fence_word_without_a_readack(pair: Pair, monkeypatch) -> None:
    """The producer answers no ReadDone (its ReadAcks are never sent): the pull is DONE
    all the same, confirmed by the word its READ found held; the producer then released
    the exposure as completed (the ReadDone followed the READ of the word)."""
    p, c, _ = pair
    monkeypatch.setattr(p, "_ack", lambda *a, **k: None)
    p.expose("r", [5, 6], 20, generation=2)
    c.pull("r", p.endpoint, [5, 6], [0, 7], 20, generation=2)
    (res,) = until(c, p)
    assert (res.state, res.fenced) == (TransferState.DONE, 1), res.reason
    deadline = time.monotonic() + 10
    while p.num_pinned_blocks and time.monotonic() < deadline:
        p.poll(timeout_ms=1)
    assert p.releases[-1].cause is ReleaseCause.COMPLETED
    slot, tag = slot_and_tag("r", 2)
    words = p.transport.fence_words()
    assert words is not None and int(words[0][slot]) == tag | DONE


def test_the_readack_of_a_pull_its_word_confirmed_is_dropped(pair: Pair) -> None:
    p, c, _ = pair
    p.expose("r", [5, 6], 20, generation=2)
    c.pull("r", p.endpoint, [5, 6], [0, 7], 20, generation=2)
    (res,) = until(c, p)
    assert (res.state, res.fenced) == (TransferState.DONE, 1), res.reason
    w = c.directory.instance(p.endpoint).worker0
    deadline = time.monotonic() + 10
    while (p.num_pinned_blocks or ("r", 2) in w.fenced) and time.monotonic() < deadline:
        p.poll(timeout_ms=1)  # the ReadDone taken, its ReadAck sent, and taken here
        c.poll()
    assert ("r", 2) not in w.fenced and ("r", 2) not in w.acks


def test_a_pull_of_a_released_exposure_is_not_confirmed_by_its_word(pair: Pair) -> None:
    """The lease released the exposure before the READ: the word says released, so the
    pull waits for the ReadAck, which fails it as stale (the bytes may be another
    request's by now)."""
    p, c, clock = pair
    p.expose("late", [5, 6], 20, generation=3)
    clock.now += 11  # past the lease
    p.poll()
    assert p.releases[-1].cause is ReleaseCause.LEASE_EXPIRED
    c.pull("late", p.endpoint, [5, 6], [0, 7], 20, generation=3)
    (res,) = until(c, p)
    assert (res.state, res.failure, res.fenced) == (TransferState.FAILED, PullFailure.STALE, 0)
    assert "released (lease_expired)" in res.reason
