"""The worker-side connector an engine embeds, and the driver's tracker, over a fake
transport (real producer and consumer, real side channel, one process). Our engine and
serve use the same connector; tests/serve runs it with real NIXL agents."""

from __future__ import annotations

import time

import pytest

from kvbridge.transfer.config import TransferConfig
from kvbridge.transfer.connector import (
    IDLE_POLL_S,
    Cancel,
    ConnectorEvent,
    ConnectorReply,
    ConnectorRole,
    ConnectorSpec,
    Expose,
    GetEndpoint,
    Poll,
    Pull,
    SetEndpoints,
    TransferTracker,
    WorkerConnector,
    encode,
    request_decoder,
)
from kvbridge.transfer.errors import TransferError

from .fakes import MODEL, NUM_BLOCKS, PREFILL, FakeTransport, regions


def make(role: ConnectorRole, transport: FakeTransport) -> WorkerConnector:
    spec = ConnectorSpec(role, "P", TransferConfig(lease_s=0.2))
    return WorkerConnector(
        spec, MODEL, PREFILL, 0, regions(PREFILL, 0), NUM_BLOCKS, transport=transport
    )


def test_producer_connector_exposes_polls_and_reports_the_release() -> None:
    transport = FakeTransport("prefill0")
    conn = make(ConnectorRole.PRODUCER, transport)
    try:
        (endpoint,) = [conn.handle(GetEndpoint()).endpoint]
        assert endpoint.startswith("tcp://127.0.0.1:")
        conn.handle(SetEndpoints([endpoint]))
        conn.handle(Expose("r1", [3, 1], 20))
        reply = conn.handle(Poll())
        assert reply.pinned_blocks == 2 and reply.events == []
        assert conn.poll_interval() < IDLE_POLL_S  # busy: a read may be in flight
        time.sleep(0.25)  # nobody pulls: the lease expires and the release is reported
        assert conn.wait_for_events(30)  # (by the progress thread: a Poll only collects)
        (event,) = conn.handle(Poll()).events
        assert event.request_id == "r1" and not event.ok and "lease expired" in event.reason
        assert conn.handle(Poll()) == ConnectorReply()  # reported once, nothing pinned
        with pytest.raises(TransferError, match="Pull is not a request for a producer worker"):
            conn.handle(Pull("r3", endpoint, [1], [1], 4))
    finally:
        conn.close()


def test_cancel_and_a_short_lease_are_reported_as_releases() -> None:
    """A `Cancel` releases outside the producer's poll; the next Poll still reports it
    (the driver frees the blocks then). An exposure's own `lease_s` overrides the
    configured lease."""
    transport = FakeTransport("prefill0")
    spec = ConnectorSpec(ConnectorRole.PRODUCER, "P", TransferConfig(lease_s=60))
    conn = WorkerConnector(
        spec, MODEL, PREFILL, 0, regions(PREFILL, 0), NUM_BLOCKS, transport=transport
    )
    try:
        (endpoint,) = [conn.handle(GetEndpoint()).endpoint]
        conn.handle(SetEndpoints([endpoint]))
        conn.handle(Expose("r1", [3, 1], 20))
        conn.handle(Expose("r2", [2], 10, lease_s=0.2))
        conn.handle(Cancel("r1", "the client went away"))
        (event,) = conn.handle(Poll()).events
        assert event.request_id == "r1" and not event.ok and "client went away" in event.reason
        time.sleep(0.25)
        assert conn.wait_for_events(30)  # (by the progress thread: a Poll only collects)
        (event,) = conn.handle(Poll()).events
        assert event.request_id == "r2" and "lease expired after 0.2 s" in event.reason
        assert conn.handle(Poll()) == ConnectorReply()
    finally:
        conn.close()


def test_requests_cross_a_process_boundary_as_typed_bytes() -> None:
    req = Pull("r1", "tcp://127.0.0.1:5000", [1, 2], [7, 8], 20)
    assert request_decoder.decode(encode(req)) == req
    with pytest.raises(Exception, match="missing required field `type`"):
        request_decoder.decode(encode(ConnectorReply()))


def test_tracker_reports_a_request_once_every_worker_did() -> None:
    done = []
    tracker = TransferTracker()
    tracker.track("a", [1, 2], num_workers=2, on_done=done.append)
    tracker.track("b", [3], num_workers=2, on_done=done.append)
    tracker.feed(
        [
            ConnectorReply(events=[ConnectorEvent("a", True, nbytes=10)], pinned_blocks=3),
            ConnectorReply(events=[ConnectorEvent("b", False, "lease expired")], pinned_blocks=3),
        ]
    )
    assert done == [] and tracker.pinned_blocks == 6
    finished = tracker.feed(
        [ConnectorReply(), ConnectorReply(events=[ConnectorEvent("a", True, nbytes=5)])]
    )
    assert [t.request_id for t in finished] == ["a"] and done[0].nbytes == 15 and done[0].ok
    tracker.feed([ConnectorReply(events=[ConnectorEvent("b", True)]), ConnectorReply()])
    assert done[1].request_id == "b" and done[1].failures == ["lease expired"]
    assert not tracker.transfers and tracker.nbytes_total == 15


def test_tracker_keeps_the_slowest_workers_own_time() -> None:
    """A request's KV is in place when its slowest worker finished, whenever the driver
    polls: `worker_ms` is the largest `elapsed_ms` its workers reported."""
    tracker = TransferTracker()
    tr = tracker.track("a", [1], num_workers=3)
    tracker.feed([ConnectorReply(events=[ConnectorEvent("a", True, elapsed_ms=12.5)])])
    tracker.feed(
        [
            ConnectorReply(events=[ConnectorEvent("a", True, elapsed_ms=40.0)]),
            ConnectorReply(events=[ConnectorEvent("a", True, elapsed_ms=7.0)]),
        ]
    )
    assert not tracker.transfers and tr.worker_ms == 40.0
