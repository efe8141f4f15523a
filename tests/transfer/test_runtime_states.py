"""Producer and consumer state machines over a fake transport (real side channel, real
planner, in one process). The byte-moving tests with real NIXL agents in real
processes are test_transfers.py and test_faults.py."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from kvbridge.plan.geometry import AttentionKind, ModelKVSpec
from kvbridge.transfer.agent import XferState
from kvbridge.transfer.consumer import KVConsumer, PullFailure, TransferState
from kvbridge.transfer.introductions import CONNECT_SETTLE_S
from kvbridge.transfer.messages import ReadDone, encode
from kvbridge.transfer.netdev import free_port
from kvbridge.transfer.producer import KVProducer, ReleaseCause
from kvbridge.transfer.pull import RELEASE_RETRY_S

from .fakes import (
    Clock,
    FakeTransport,
    deliver,
    drive,
    signed,
)
from .runtime import consumer, make_producer, opened


def notify(p: KVProducer, c: KVConsumer, request_id: str, **fields: Any) -> None:
    deliver(p, signed(c, p, request_id, **fields))


def test_pull_handshakes_posts_one_read_and_releases_after_every_reader(producer, clock) -> None:
    p, released = producer
    p.expose("r1", [5, 2, 7], 48)
    cs = [consumer(0, clock), consumer(1, clock)]
    for c in cs:
        c.pull("r1", p.endpoint, [5, 2, 7], [1, 6, 3], 48)
    drive(p, cs)
    for c in cs:  # one READ per (request, producer worker), carrying the notification
        t = c.transport
        assert isinstance(t, FakeTransport) and len(t.reads) == 1
        local_idx, remote_idx, notif = t.reads[0]
        assert len(local_idx) == len(remote_idx) > 0
        got = opened(c, p, notif)  # signed with the session's key, addressed to P rank 0
        assert (got.request_id, got.instance_id, got.rank) == ("r1", "D", c.rank)
        assert (got.to_instance, got.to_rank, got.ok) == ("P", 0, True)
        t.read_state = XferState.DONE
    # the READs are done, but the bytes are used only once P confirms it held them
    assert drive(p, cs) == []
    # the fake moved no bytes, so notifications are delivered by hand, as NIXL would
    first = cs[0].transport.reads[0][2]
    deliver(p, first)
    p.poll()
    assert released == []
    deliver(p, first)  # replayed: ignored, counted
    p.poll()
    assert released == [] and p.num_ignored_notifs == 1 and p.num_replays == 1
    deliver(p, cs[1].transport.reads[0][2])
    p.poll()
    assert [(r.request_id, r.cause, r.block_ids) for r in released] == [
        ("r1", ReleaseCause.COMPLETED, (5, 2, 7))
    ]
    # worker 1's ReadDone again, after the release: P answers it not held, but worker 1
    # goes by the answer to its one ReadDone, which came first
    deliver(p, cs[1].transport.reads[0][2])
    p.poll()
    assert p.num_stale_acks == 1
    results = drive(p, cs)  # both answered held (ReadAck)
    assert sorted((r.request_id, r.state) for r in results) == [("r1", TransferState.DONE)] * 2
    assert all(r.local_block_ids == (1, 6, 3) for r in results)
    # unintroduced: each pull waited for its handshake and was the first READ over its path
    assert [(r.handshake, r.cold_peers) for r in results] == [(True, 1)] * 2
    notify(p, cs[1], "r1")  # stale
    p.poll()
    assert p.num_ignored_notifs == 3 and len(released) == 1 and p.num_pinned_blocks == 0


def pull_split(p: KVProducer, clock: Clock) -> tuple[KVConsumer, FakeTransport]:
    """Request "r1": 20 tokens pulled from token 4 by decode worker 0 (its cache held
    [0, 4) already), its two READs posted: tokens [4, 16) cut inside block 5, and block
    2 read whole (its 4 tokens and the zeroed slots after them, `read_end`)."""
    p.expose("r1", [5, 2], 20)
    c = consumer(0, clock)
    c.pull("r1", p.endpoint, [5, 2], [1, 6], 20, 4)
    drive(p, [c])
    t = c.transport
    assert isinstance(t, FakeTransport) and len(t.reads) == 2
    return c, t


def test_a_block_cut_inside_is_a_second_read_and_the_notification_follows_both(
    producer, clock
) -> None:
    """Tokens [4, 20) of blocks of 16: the whole last block indexes the lists prepared
    at handshake; the 12 tokens of the first get their own descriptors (a list of whole
    regions cut per token would take seconds to prepare); the producer is told once
    both READs are done."""
    p, _ = producer
    c, t = pull_split(p, clock)
    assert [notif for _, _, notif in t.reads] == [b"", b""]
    (whole_l, whole_r, _), (tail_l, tail_r, _) = t.reads
    assert len(whole_l) == len(whole_r) > 0 and len(tail_l) == len(tail_r) > 0
    assert t.sent == []  # not before the READs are done
    t.read_state = XferState.DONE
    assert drive(p, [c]) == []  # not before P confirms it held r1
    deliver(p, t.sent[0][1])
    results = drive(p, [c])
    assert [(r.request_id, r.state) for r in results] == [("r1", TransferState.DONE)]
    assert [(opened(c, p, msg).request_id, opened(c, p, msg).ok) for _, msg in t.sent] == [
        ("r1", True)
    ]


def test_split_reads_notify_only_after_the_last_and_never_after_a_failure(producer, clock) -> None:
    p, _ = producer
    c, t = pull_split(p, clock)
    p.expose("r2", [3, 4], 20)
    t.xfer_states = {1: XferState.DONE}  # the whole block is in, the cut one is not
    assert drive(p, [c]) == [] and t.sent == []
    t.xfer_states = {1: XferState.DONE, 2: XferState.DONE}
    assert drive(p, [c]) == []
    deliver(p, t.sent[0][1])
    assert [r.state for r in drive(p, [c])] == [TransferState.DONE]
    assert [opened(c, p, m).ok for _, m in t.sent] == [True]
    # its own descriptor lists (4 layers x K/V: one run each) are released with it
    assert t.released_dlists == [("local", 8), ("remote", "prefill0", 8)]

    # r2: the whole block is in, the cut one still running at the deadline: the
    # producer hears ok=False (release now), never ok=True
    t.sent.clear()
    c.pull("r2", p.endpoint, [3, 4], [2, 7], 20, 4)
    drive(p, [c])
    assert len(t.reads) == 4
    t.xfer_states[3] = XferState.DONE
    clock.now += 6  # past transfer_timeout_s
    [result] = drive(p, [c])
    assert result.state is TransferState.FAILED and "timed out" in result.reason
    assert [opened(c, p, m).ok for _, m in t.sent] == [False]


def test_a_failed_pull_whose_read_nixl_cannot_cancel_keeps_its_blocks_until_it_can(
    producer, clock
) -> None:
    """A READ that outlives its pull (NIXL cannot cancel it; after a link heals it may
    still complete) must not write into blocks given to another request: the pull's
    outcome, and with it its blocks, waits until the READ is released."""
    p, _ = producer
    c, t = pull_split(p, clock)
    t.cancellable = False
    clock.now += 6  # past transfer_timeout_s
    assert drive(p, [c]) == []  # ended, not reported: its blocks stay with the consumer
    assert c.num_held_blocks == 2 and not c.is_busy  # retried at the idle cadence
    assert ("local", 8) not in t.released_dlists  # the READ may still write through them
    assert t.sent == []  # the producer keeps the source until we cannot read it
    t.cancellable = True  # releasable now (the READ is known dead)
    assert drive(p, [c]) == []  # not retried before RELEASE_RETRY_S
    clock.now += RELEASE_RETRY_S
    [result] = drive(p, [c])
    assert result.state is TransferState.FAILED and "timed out" in result.reason
    assert result.local_block_ids == (1, 6) and c.num_held_blocks == 0
    assert ("local", 8) in t.released_dlists
    assert [opened(c, p, m).ok for _, m in t.sent] == [False]


def test_lists_of_a_read_still_uncancelled_at_close_are_kept_until_the_end(producer, clock) -> None:
    p, _ = producer
    c, t = pull_split(p, clock)
    t.cancellable = False
    clock.now += 6
    assert drive(p, [c]) == []
    [result] = c.close()  # reported anyway: the cache goes with the agent
    assert result.state is TransferState.FAILED and "timed out" in result.reason
    assert ("local", 8) in t.released_dlists and ("remote", "prefill0", 8) in t.released_dlists


def test_forged_misdirected_and_unexpected_notifications_are_ignored(producer, clock) -> None:
    p, released = producer
    p.expose("r1", [0], 4)
    forged = encode(
        ReadDone(request_id="r1", instance_id="D", rank=0, to_instance="P", to_rank=0, sent_at=1.0),
        b"k" * 32,
        b"s" * 16,
    )
    deliver(p, forged)  # no session: nobody handshaked with this key
    deliver(p, encode(ReadDone("r1", "D", 0, "P", 0, time.time()), None))  # unsigned
    p.poll()
    c = consumer(0, clock)
    c.pull("r1", p.endpoint, [0], [0], 4)
    drive(p, [c])
    notify(p, c, "r1", rank=1)  # claims another decode worker than its session's
    notify(p, c, "r1", to_rank=1)  # addressed to another prefill worker
    notify(p, c, "r1", sent_at=time.time() - 3600)  # an hour old
    notify(p, c, "nope")  # unknown request: kept for a lease in case expose comes late
    deliver(p, b"garbage")
    p.poll()
    assert released == [] and p.num_ignored_notifs == 6 and p.num_replays == 6
    clock.now += 10.1  # a lease later "nope" was never exposed: dropped (and r1 expired)
    p.poll()
    assert p.num_ignored_notifs == 7
    assert [r.cause for r in released] == [ReleaseCause.LEASE_EXPIRED]


def test_a_notification_before_expose_completes_the_request(producer, clock) -> None:
    p, released = producer
    c0, c1 = consumer(0, clock), consumer(1, clock)
    for c in (c0, c1):  # both handshake (the plan becomes known) on a first request
        c.pull("warm", p.endpoint, [0], [0], 4)
    drive(p, [c0, c1])
    notify(p, c0, "late")
    notify(p, c1, "late")
    p.poll()
    assert released == []
    p.expose("late", [3, 4], 20)
    assert [(r.request_id, r.cause) for r in released] == [("late", ReleaseCause.COMPLETED)]
    assert p.num_pinned_blocks == 0


def test_lease_releases_blocks_a_consumer_never_came_for(producer, clock) -> None:
    p, released = producer
    p.expose("lonely", [1, 2], 30)
    clock.now += 9.9
    p.poll()
    assert released == []
    clock.now += 0.2
    p.poll()
    assert len(released) == 1
    rel = released[0]
    assert rel.cause is ReleaseCause.LEASE_EXPIRED and rel.block_ids == (1, 2)
    assert "lease expired after 10 s" in rel.reason and "no decode worker notified" in rel.reason


def test_incompatible_pair_fails_on_both_sides_with_the_planners_error(producer, clock) -> None:
    p, _ = producer
    other = ModelKVSpec(6, 4, 2, 8, "float16", AttentionKind.GQA, "other")
    c = consumer(0, clock, other)
    c.pull("r1", p.endpoint, [0], [0], 4)
    results = drive(p, [c])
    assert len(results) == 1 and results[0].state is TransferState.FAILED
    planner_words = (
        "prefill and decode run different models: prefill num_layers=4, decode num_layers=6"
    )
    assert planner_words in results[0].reason
    assert any(planner_words in r for r in p.refusals)
    assert c.num_held_blocks == 0


def test_read_error_fails_the_request_and_drops_the_cached_connection(producer, clock) -> None:
    p, _ = producer
    p.expose("r1", [0], 4)
    p.expose("r2", [1], 4)
    c = consumer(0, clock)
    c.pull("r1", p.endpoint, [0], [0], 4)
    drive(p, [c])
    assert isinstance(c.transport, FakeTransport)
    c.transport.read_state = XferState.ERR
    (res,) = drive(p, [c])
    assert res.state is TransferState.FAILED and "ERR state" in res.reason
    assert c.transport.peers == []  # forgotten: the next pull handshakes again
    c.transport.read_state = XferState.DONE
    c.pull("r2", p.endpoint, [1], [1], 4)
    assert drive(p, [c]) == []
    deliver(p, c.transport.reads[-1][2])
    (res,) = drive(p, [c])
    assert res.state is TransferState.DONE


def test_unanswered_handshake_and_stuck_read_fail_in_bounded_time(producer, clock) -> None:
    p, _ = producer
    c = consumer(0, clock)
    c.pull("r1", "tcp://127.0.0.1:9", [0], [0], 4)  # nobody there
    assert c.poll() == []
    clock.now += 2.1
    (res,) = c.poll()
    assert res.state is TransferState.FAILED and "timed out after 2 s" in res.reason
    p.expose("r2", [0], 4)
    c.pull("r2", p.endpoint, [0], [3], 4)
    drive(p, [c])  # the READ stays in PROC (a fake that never finishes)
    assert isinstance(c.transport, FakeTransport) and len(c.transport.reads) == 1
    c.transport.read_state = XferState.PROC
    clock.now += 5.1
    (res,) = c.poll()
    assert res.state is TransferState.FAILED and "timed out after 5 s reading" in res.reason
    assert res.local_block_ids == (3,) and c.num_held_blocks == 0


def test_a_producer_whose_port_refuses_fails_at_the_liveness_bound_not_the_timeout(
    clock,
) -> None:
    """A producer worker that is gone (its host refuses connections to its port) fails
    the handshake once refused for the liveness bound, long before the handshake
    timeout: a decode instance falls back (recompute) in seconds, not a timeout later."""
    port = free_port()  # a port of this host that nothing listens on
    c = consumer(0, clock, liveness_timeout_s=0.3, handshake_timeout_s=600)
    c.pull("r1", f"tcp://127.0.0.1:{port}", [0], [0], 4)
    deadline = time.monotonic() + 60
    while not (done := c.poll()):
        assert time.monotonic() < deadline, "the refused handshake never failed"
        time.sleep(0.02)
    (res,) = done
    assert res.state is TransferState.FAILED, res
    assert "refused every connection for 0.3 s" in res.reason, res.reason
    assert c.num_held_blocks == 0


def test_expose_and_pull_validate_their_arguments(producer, clock) -> None:
    p, _ = producer
    with pytest.raises(Exception, match=r"block_ids of 'x' must lie in \[0, 8\)"):
        p.expose("x", [8], 1)
    with pytest.raises(Exception, match="num_tokens=40 of 'x' does not fit 2 blocks of 16"):
        p.expose("x", [0, 1], 40)
    p.expose("x", [0], 1)
    with pytest.raises(Exception, match="already exposed"):
        p.expose("x", [1], 1)
    c = consumer(0, clock)
    with pytest.raises(Exception, match="local_block_ids"):
        c.pull("y", p.endpoint, [0], [np.int64(99)], 1)


def test_a_consumer_that_gives_up_tells_the_producer_which_releases_at_once(
    producer, clock
) -> None:
    p, released = producer
    p.expose("r1", [4], 4)
    cs = [consumer(0, clock), consumer(1, clock)]
    for c in cs:
        c.pull("r1", p.endpoint, [4], [2], 4)
    drive(p, cs)
    t0, t1 = (c.transport for c in cs)
    assert isinstance(t0, FakeTransport) and isinstance(t1, FakeTransport)
    t0.read_state = XferState.DONE
    drive(p, cs)
    notify(p, cs[0], "r1")  # rank 0's READ delivered its notification
    clock.now += 5.1  # rank 1's READ is stuck: it times out and gives up
    (res,) = cs[1].poll()
    assert res.state is TransferState.FAILED
    ((peer, msg),) = t1.sent
    assert peer == "prefill0"
    notice = opened(cs[1], p, msg)
    assert not notice.ok and "timed out" in notice.reason
    assert isinstance(p.transport, FakeTransport)
    p.transport.inbox["decode1"] = [msg]
    p.poll()
    assert [(r.request_id, r.cause) for r in released] == [("r1", ReleaseCause.ABORTED)]
    assert "decode rank 1: timed out" in released[0].reason


def test_connect_meets_a_producer_before_its_first_request(producer, clock) -> None:
    """An introduction does the handshake, prepares the descriptor lists ahead and warms
    the path to the producer (a small READ into a scratch buffer, carrying a Meet the
    producer only notes), so the first pull posts its READ on its first poll and finds
    NIXL's and UCX's paths set up."""
    p, _ = producer
    c = consumer(0, clock)
    t = c.transport
    assert isinstance(t, FakeTransport)
    c.connect(p.endpoint)
    assert c.is_busy
    for _ in range(20):
        p.poll(5)
        c.poll()
    assert c.is_busy  # met, still polled often while NIXL makes its connections
    (warm,) = t.reads  # 2 units into the registered scratch buffer, with the Meet
    assert len(warm[0]) == 2 and len(t.registered) == 1
    assert t.registered[0].addresses[0] not in c.regions.addresses
    deliver(p, warm[2])
    replays = p.num_replays
    p.poll()
    assert p.num_replays == replays and p.num_ignored_notifs == 0  # noted, nothing else
    t.read_state = XferState.DONE  # the warm-up READ ends; it is released at a poll
    clock.now += CONNECT_SETTLE_S
    c.poll()
    assert not c.is_busy and c.transport.peers == ["prefill0"]
    inst = c.directory.instance(p.endpoint)
    assert inst.is_ready and inst.prepared
    p.expose("r1", [3], 4)
    c.pull("r1", p.endpoint, [3], [5], 4)
    t.read_state = XferState.PROC
    c.poll()  # no handshake to wait for
    assert len(t.reads) == 2 and t.reads[1][2]  # the pull's READ, carrying its ReadDone
    t.read_state = XferState.DONE
    deliver(p, t.reads[1][2])
    (result,) = drive(p, [c])
    # it waited for no handshake, and the warm-up READ had crossed its path already
    assert (result.state, result.handshake, result.cold_peers) == (TransferState.DONE, False, 0)


def test_connect_says_when_met_and_meets_a_restarted_producer_afresh(
    producer, clock, request
) -> None:
    """`connect` answers whether this worker has met the producer (the proxy asks again
    until it has). A producer instance restarted at the same address (a new instance
    id) is forgotten and met afresh: the next pull reads from the new agent."""
    p, _ = producer
    c = consumer(0, clock)
    assert c.connect(p.endpoint, "P") is False
    for _ in range(20):
        p.poll(5)
        c.poll()
    assert c.connect(p.endpoint, "P") is False  # met; its warm-up READ is in flight
    assert isinstance(c.transport, FakeTransport)
    c.transport.read_state = XferState.DONE
    c.poll()  # the warm-up READ ends: the path is warm
    assert c.connect(p.endpoint, "P") is True
    port = int(p.endpoint.rsplit(":", 1)[1])
    p.close()
    request.addfinalizer(c.close)
    p2 = make_producer(clock, "prefill0-restarted", "P2", config={"base_port": port})
    try:
        assert p2.endpoint == p.endpoint
        assert c.connect(p2.endpoint, "P2") is False  # the one met before is not P2
        for _ in range(40):
            p2.poll(5)
            c.poll()
            if c.connect(p2.endpoint, "P2"):
                break
        assert c.connect(p2.endpoint, "P2") is True
        assert isinstance(c.transport, FakeTransport)
        assert c.transport.peers == ["prefill0-restarted"]  # the old agent was unloaded
        p2.expose("r1", [3], 4)
        c.pull("r1", p2.endpoint, [3], [5], 4)
        c.poll()
        # the first agent's warm-up, the new one's, then the pull's READ (from the new)
        assert len(c.transport.reads) == 3 and c.transport.reads[2][2]
    finally:
        p2.close()


def test_a_producer_gone_while_idle_is_forgotten_and_met_again_when_back(clock, request) -> None:
    """A met producer whose side channel goes down (its host, the link, or itself) is
    forgotten while nothing reads from it (its agent unloaded), so the next
    introduction or pull meets it afresh instead of reusing stale endpoints."""
    p = make_producer(clock, "prefill0", "P")
    c = consumer(0, clock, liveness_timeout_s=0.3)
    request.addfinalizer(c.close)
    request.addfinalizer(p.close)
    assert isinstance(c.transport, FakeTransport)
    c.transport.read_state = XferState.DONE  # the warm-up READ (one with CMA at once)
    c.connect(p.endpoint, "P")
    for _ in range(20):
        p.poll(5)
        c.poll()
    assert c.connect(p.endpoint, "P") and c.transport.peers == ["prefill0"]
    clock.now += CONNECT_SETTLE_S
    c.poll()  # settled: nothing in flight
    port = int(p.endpoint.rsplit(":", 1)[1])
    p.close()
    deadline = time.monotonic() + 10
    while c.transport.peers and time.monotonic() < deadline:
        c.poll()
        time.sleep(0.05)
    assert c.transport.peers == []  # forgotten: nothing of the producer stays loaded
    back = make_producer(clock, "prefill0-back", "P", config={"base_port": port})
    try:
        for _ in range(40):
            back.poll(5)
            c.poll()
            if c.connect(back.endpoint, "P"):
                break
        assert c.connect(back.endpoint, "P") and c.transport.peers == ["prefill0-back"]
    finally:
        back.close()


def test_connect_to_nobody_gives_up_quietly(clock) -> None:
    c = consumer(0, clock)
    c.connect("tcp://127.0.0.1:9")
    c.poll()
    clock.now += 10
    c.poll()
    assert not c.is_busy and c.poll() == []


def test_a_declined_request_is_released_at_once_not_at_the_lease(producer, clock) -> None:
    """A decode worker refused the request before pulling (out of blocks): it tells the
    producer, which releases now (ABORTED, with the reason); a producer-side cancel of a
    request nobody took does the same."""
    p, released = producer
    p.expose("r1", [4], 4)
    cs = [consumer(0, clock), consumer(1, clock)]
    for c in cs:
        c.decline("r1", p.endpoint, "no free blocks to receive the KV")
    for _ in range(30):
        p.poll(5)
        for c in cs:
            assert c.poll() == []  # nothing is reported for a decline
    for c in cs:
        t = c.transport
        assert isinstance(t, FakeTransport) and t.reads == [] and len(t.sent) == 1
        deliver(p, t.sent[0][1])
    p.poll()
    assert [(r.request_id, r.cause) for r in released] == [("r1", ReleaseCause.ABORTED)]
    assert "no free blocks" in released[0].reason and p.num_pinned_blocks == 0
    p.expose("r2", [5], 4)
    assert p.cancel("r2", "the decode instance answered 503")
    assert released[-1].cause is ReleaseCause.ABORTED and "cancelled" in released[-1].reason
    assert not p.cancel("r2", "again")


def test_bytes_read_after_the_lease_or_from_another_generation_are_never_used(
    producer, clock
) -> None:
    """A pull is DONE only once the producer confirms (ReadAck) that it held that
    exposure, at the pull's generation, until the ReadDone arrived: a ReadDone after the
    lease released it, or naming another generation, fails the pull as stale with the
    reason; one whose answer never comes fails at the transfer timeout, saying so."""
    p, released = producer
    c = consumer(0, clock)
    t = c.transport
    assert isinstance(t, FakeTransport)
    t.read_state = XferState.DONE
    p.expose("late", [1], 4, lease_s=1.0, generation=5)
    c.pull("late", p.endpoint, [1], [2], 4, generation=5)
    assert drive(p, [c]) == []  # READ done; P has not heard of it yet
    clock.now += 1.5  # the reader was slower than the lease
    p.poll()
    assert [(r.request_id, r.cause) for r in released] == [("late", ReleaseCause.LEASE_EXPIRED)]
    deliver(p, t.reads[-1][2])
    (res,) = drive(p, [c])
    assert (res.state, res.failure) == (TransferState.FAILED, PullFailure.STALE)
    assert "no longer held 'late' (generation 5)" in res.reason
    assert "released (lease_expired)" in res.reason and c.num_held_blocks == 0

    p.expose("again", [1], 4, generation=6)  # re-exposed: another generation
    c.pull("again", p.endpoint, [1], [2], 4, generation=9)
    drive(p, [c])
    deliver(p, t.reads[-1][2])
    (res,) = drive(p, [c])
    assert res.failure is PullFailure.STALE and "generation 6, not the generation 9" in res.reason
    assert p.num_pinned_blocks == 1  # the exposure read is not released by it

    c.pull("unanswered", p.endpoint, [1], [3], 4, generation=6)
    drive(p, [c])  # its ReadDone is never delivered
    clock.now += 5.1
    (res,) = drive(p, [c])
    assert res.state is TransferState.FAILED and res.failure is None
    assert "waiting for prefill workers [0] to confirm they held 'unanswered'" in res.reason
