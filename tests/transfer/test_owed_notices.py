"""Failure notices a decode worker owes a producer it lost mid-pull (`owed.py`), over
the fake transport and real side channels: the producer's side channel is closed (its
host or link is down, as the decode worker sees it) and bound again (the link healed);
the producer object, its exposed blocks and its handshake sessions stay, as a real
prefill worker's do across a cut. The real deployment's version of this is
tests/hosts/test_three_hosts.py::test_a_link_cut_mid_pull_fails_fast_and_heals."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from kvbridge.transfer.agent import XferState
from kvbridge.transfer.consumer import KVConsumer, TransferResult, TransferState
from kvbridge.transfer.errors import HandshakeError
from kvbridge.transfer.owed import OwedNotices
from kvbridge.transfer.producer import KVProducer, ReleaseCause
from kvbridge.transfer.pull import RELEASE_RETRY_S
from kvbridge.transfer.side_channel import SideChannelServer

from .fakes import Clock, FakeTransport, deliver
from .runtime import consumer, make_producer, opened

#: The consumers' lease: how long an owed notice is kept (TransferConfig.lease_s).
LEASE_S = 10.0


@pytest.fixture
def decode(clock: Clock) -> Iterator[list[KVConsumer]]:
    """Both decode workers (tp 2) of instance "D"; each reads prefill worker 0."""
    cs = [consumer(r, clock, liveness_timeout_s=0.3, lease_s=LEASE_S) for r in (0, 1)]
    yield cs
    for c in cs:
        c.close()


def sent(c: KVConsumer) -> list[tuple[str, bytes]]:
    t = c.transport
    assert isinstance(t, FakeTransport)
    return t.sent


def until(what: Callable[[], bool], step: Callable[[], object], timeout_s: float = 10) -> None:
    """Run `step` until `what` holds (real time: side channels move on their own)."""
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        step()
        time.sleep(0.01)


def pull_and_cut(p: KVProducer, cs: list[KVConsumer]) -> None:
    """Every consumer pulls "r1" (20 tokens from token 4: two READs posted, one for the
    block cut inside), then `p`'s side channel goes away mid-pull (the link is cut: no
    heartbeat is answered, nothing arrives)."""
    p.expose("r1", [5, 2], 20)
    for c in cs:
        c.pull("r1", p.endpoint, [5, 2], [1, 6], 20, 4)
    until(lambda: all(len(c.transport.reads) == 2 for c in cs), lambda: [p.poll(5), *poll(cs)])
    p._server.close()


def pull_then_cut(p: KVProducer, cs: list[KVConsumer]) -> list[TransferResult]:
    """`pull_and_cut`; returns the pulls' results once every consumer gave up."""
    pull_and_cut(p, cs)
    results: list[TransferResult] = []
    until(lambda: len(results) == len(cs), lambda: results.extend(r for rs in poll(cs) for r in rs))
    return results


def poll(cs: list[KVConsumer]) -> list[list[TransferResult]]:
    return [c.poll() for c in cs]


def heal(p: KVProducer) -> None:
    """The link is back: `p` answers at its address again (a fresh socket may find the
    port still held for a moment)."""
    host, port = p.config.host, int(p.endpoint.rsplit(":", 1)[1])
    deadline = time.monotonic() + 10
    while True:
        try:
            p._server = SideChannelServer(
                host, port, p.config.token, p.config.max_message_bytes, p._handle
            )
            return
        except HandshakeError:
            assert time.monotonic() < deadline, "the producer's port stayed taken"
            time.sleep(0.1)


def meet_again(p: KVProducer, cs: list[KVConsumer], instance_id: str) -> None:
    """What the proxy's introducer does after an outage: connect until every worker met
    the producer again (its warm-up READs, posted after the handshake, completed: a
    worker has met a producer once they are over); then a few more polls (pay what is
    owed)."""
    before = [len(c.transport.reads) for c in cs]

    def step() -> None:
        p.poll(5)
        poll(cs)
        for c, n in zip(cs, before, strict=True):
            t = c.transport
            assert isinstance(t, FakeTransport)
            t.xfer_states.update({i: XferState.DONE for i in range(n + 1, len(t.reads) + 1)})

    until(lambda: all(c.connect(p.endpoint, instance_id) for c in cs), step)
    for _ in range(5):
        p.poll(5)
        poll(cs)


def test_a_pull_cut_off_tells_the_same_producer_after_the_heal_and_it_releases(
    producer, decode
) -> None:
    p, released = producer
    results = pull_then_cut(p, decode)
    assert {r.state for r in results} == {TransferState.FAILED}
    assert all("lost contact with prefill worker 0" in r.reason for r in results)
    assert all(sent(c) == [] for c in decode)  # nobody to tell while it is down
    assert [len(c.owed) for c in decode] == [1, 1]
    for _ in range(20):  # still down: nothing goes out, the notices are kept
        poll(decode)
    assert all(sent(c) == [] for c in decode) and released == []

    heal(p)
    meet_again(p, decode, "P")
    for c in decode:  # exactly one failed ReadDone each, with the reason, new session
        ((agent, msg),) = sent(c)
        notice = opened(c, p, msg)
        assert agent == "prefill0" and notice.request_id == "r1" and not notice.ok
        assert "lost contact with prefill worker 0" in notice.reason
        assert len(c.owed) == 0 and c.owed.num_sent == 1
        deliver(p, msg)
    p.poll()
    assert [(r.request_id, r.cause) for r in released] == [("r1", ReleaseCause.ABORTED)]
    assert "decode workers gave up" in released[0].reason and p.num_pinned_blocks == 0
    # a notice for a request released already is harmless: ignored, not a replay
    replays = p.num_replays
    deliver(p, sent(decode[0])[0][1])
    p.poll()
    assert len(released) == 1 and p.num_replays == replays
    for _ in range(5):  # paid once: nothing more goes out
        poll(decode)
    assert [len(sent(c)) for c in decode] == [1, 1]


def test_a_producer_restarted_under_another_id_is_owed_nothing(
    producer, decode, clock, request
) -> None:
    p, _ = producer
    pull_then_cut(p, decode)
    port = int(p.endpoint.rsplit(":", 1)[1])
    p.close()
    p2 = make_producer(clock, "prefill0-restarted", "P2", config={"base_port": port})
    request.addfinalizer(p2.close)
    meet_again(p2, decode, "P2")
    assert all(sent(c) == [] for c in decode)
    assert [len(c.owed) for c in decode] == [0, 0]
    assert all(c.owed.num_dropped == 1 for c in decode)


def test_an_owed_notice_expires_after_a_lease(producer, decode, clock) -> None:
    """By then the producer's lease freed the blocks: the notice is dropped unsent."""
    p, _ = producer
    pull_then_cut(p, decode)
    clock.now += LEASE_S - 0.1
    poll(decode)
    assert [len(c.owed) for c in decode] == [1, 1]
    clock.now += 0.1
    poll(decode)
    assert [len(c.owed) for c in decode] == [0, 0]
    heal(p)
    meet_again(p, decode, "P")
    assert all(sent(c) == [] for c in decode)


def test_a_pull_parked_on_an_uncancelled_read_is_owed_only_once_released(
    producer, decode, clock
) -> None:
    """A READ NIXL could not cancel may still read the producer's blocks: the producer
    must not be told to free them before it is released (the fencing), and the parked
    pull is not busy (it is retried every RELEASE_RETRY_S, at the idle cadence)."""
    p, _ = producer
    c = decode[0]
    t = c.transport
    assert isinstance(t, FakeTransport)
    t.cancellable = False
    pull_and_cut(p, [c])
    until(lambda: not c.is_busy, c.poll)  # it gave up: parked, not reported
    assert c.poll() == [] and c.num_held_blocks == 2
    assert len(c.owed) == 0 and t.sent == []
    t.cancellable = True  # the READ is known dead now
    clock.now += RELEASE_RETRY_S
    [result] = c.poll()
    assert result.state is TransferState.FAILED and "lost contact" in result.reason
    assert c.num_held_blocks == 0 and len(c.owed) == 1 and t.sent == []
    heal(p)
    meet_again(p, [c], "P")
    assert [opened(c, p, m).ok for _, m in t.sent] == [False]


def test_the_owed_notices_kept_per_producer_are_bounded(clock) -> None:
    owed = OwedNotices(ttl_s=LEASE_S, clock=clock, max_per_producer=3)
    for i in range(5):
        owed.owe("tcp://p:1", "P", f"r{i}", 0, "lost contact " + "x" * 5000)
    assert len(owed) == 3 and owed.num_dropped == 2
    owed.owe("tcp://q:1", "Q", "r4", 0, "lost contact")
    owed.forget_request("r4", "tcp://p:1")  # pulled from p anew: q is still owed its own
    assert len(owed) == 3
    owed.forget_request("r4", "tcp://q:1")
    assert len(owed) == 2
    owed.owe("tcp://p:1", "P-restarted", "r9", 0, "lost")  # another instance there
    assert len(owed) == 1 and owed.num_dropped == 4
