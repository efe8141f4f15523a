"""The transfer layer's worker-side connector, over a fake transport (real producer and
consumer, real side channel, one process). The connector layer's `KVConnectorWorker`
wraps it (its scheduler side's fold is tests/connector/test_scheduler_states.py);
tests/serve runs it with real NIXL agents."""

from __future__ import annotations

import time

import pytest

from kvbridge.transfer.config import TransferConfig
from kvbridge.transfer.connector import (
    IDLE_POLL_S,
    Cancel,
    ConnectorReply,
    ConnectorRole,
    ConnectorSpec,
    Expose,
    GetEndpoint,
    Poll,
    Pull,
    SetEndpoints,
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
