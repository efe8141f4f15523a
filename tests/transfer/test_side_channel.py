"""The side channel server: bad peers are refused with a logged reason, good peers served."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from kvbridge.transfer import side_channel
from kvbridge.transfer.errors import HandshakeError
from kvbridge.transfer.messages import Message, Ping, Pong, Refused, decode, encode
from kvbridge.transfer.netdev import free_port
from kvbridge.transfer.side_channel import SideChannelClient, SideChannelServer, curve_server_keys

TOKEN = b"side-channel-token-0123"
LIMIT = 64 << 10


def handler(msg: Message, peer: bytes = b"") -> Message | None:
    assert isinstance(msg, Ping)
    return Pong(nonce=msg.nonce, instance_id="server")


@pytest.fixture
def server() -> Iterator[SideChannelServer]:
    srv = SideChannelServer("127.0.0.1", 0, TOKEN, LIMIT, handler)
    stop = threading.Event()

    def loop() -> None:  # the only thread that touches the server
        while not stop.is_set():
            srv.poll(timeout_ms=10)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield srv
    stop.set()
    t.join(5)
    srv.close()


def raw_exchange(endpoint: str, frames: list[bytes]) -> Message:
    """Frames from a peer that holds the token's CURVE key (the layer under the HMAC)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_serverkey = curve_server_keys(TOKEN)[0]
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(endpoint)
    try:
        sock.send_multipart(frames)
        assert sock.poll(5000), "no answer from the side channel"
        return decode(sock.recv(), TOKEN, LIMIT)
    finally:
        sock.close()


def test_binds_loopback_by_default(server: SideChannelServer) -> None:
    assert server.endpoint.startswith("tcp://127.0.0.1:")


def test_with_a_token_a_plain_or_wrongly_keyed_peer_reaches_nothing(
    server: SideChannelServer,
) -> None:
    for key in (None, zmq.curve_keypair()[0]):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if key is not None:
            sock.curve_serverkey = key
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.connect(server.endpoint)
        try:
            sock.send(encode(Ping(nonce=1), TOKEN))
            assert not sock.poll(1000)  # CURVE's handshake fails: no reply, no refusal
        finally:
            sock.close()
    assert server.num_served == 0 and server.num_rejected == 0


def test_bad_peers_are_refused_and_logged_while_good_peers_are_served(
    server: SideChannelServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvbridge.transfer.side_channel")
    bad = {
        "malformed": [b"\xc1\xc1 not msgpack"],
        "oversized": [b"\x00" * (LIMIT + 1)],
        "wrong token": [encode(Ping(nonce=1), b"not-the-shared-token")],
        "no token": [encode(Ping(nonce=1), None)],
        "two frames": [encode(Ping(nonce=1), TOKEN), b"extra"],
    }
    reasons = {}
    for name, frames in bad.items():
        reply = raw_exchange(server.endpoint, frames)
        assert isinstance(reply, Refused), name
        reasons[name] = reply.reason
    assert "malformed" in reasons["malformed"]
    assert f"exceeds the limit of {LIMIT} bytes" in reasons["oversized"]
    assert "wrong HMAC" in reasons["wrong token"]
    assert "no HMAC" in reasons["no token"]
    assert "exactly one" in reasons["two frames"]
    assert server.num_rejected == len(bad)
    logged = " ".join(r.getMessage() for r in caplog.records)
    for reason in reasons.values():
        assert reason in logged
    # a good peer is still served afterwards
    client = SideChannelClient(server.endpoint, TOKEN, LIMIT)
    try:
        reply = client.call(Ping(nonce=42), timeout_s=5)
    finally:
        client.close()
    assert reply == Pong(nonce=42, instance_id="server")
    assert server.num_served == 1


def test_a_silent_endpoint_fails_the_call_with_a_reason() -> None:
    sock = zmq.Context.instance().socket(zmq.ROUTER)  # bound, never answers
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    client = SideChannelClient(f"tcp://127.0.0.1:{port}", None, LIMIT)
    try:
        with pytest.raises(
            HandshakeError, match=r"no answer from tcp://127\.0\.0\.1:\d+ within 0\.2 s"
        ):
            client.call(Ping(nonce=1), timeout_s=0.2)
    finally:
        client.close()
        sock.close(linger=0)


def test_a_failing_handler_is_answered_and_the_server_keeps_serving() -> None:
    calls = []

    def flaky(msg: Message, peer: bytes) -> Message | None:
        calls.append(msg)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return handler(msg)

    srv = SideChannelServer("127.0.0.1", 0, None, LIMIT, flaky)
    client = SideChannelClient(srv.endpoint, None, LIMIT)
    replies: list[Message | None] = []
    try:
        for nonce in (1, 2):
            client.send(Ping(nonce=nonce))
            srv.poll(timeout_ms=5000)
            deadline = time.monotonic() + 5
            reply = None
            while reply is None and time.monotonic() < deadline:
                reply = client.try_recv()
                time.sleep(0.001)
            replies.append(reply)
    finally:
        client.close()
        srv.close()
    assert isinstance(replies[0], Refused) and "internal error handling the request: boom" in (
        replies[0].reason
    )
    assert replies[1] == Pong(nonce=2, instance_id="server")


def test_a_malformed_endpoint_is_refused_with_the_expected_form() -> None:
    with pytest.raises(HandshakeError, match="expected tcp://HOST:PORT"):
        SideChannelClient("not an endpoint", None, LIMIT)


def test_heartbeats_keep_a_busy_peer_alive_and_report_a_gone_one() -> None:
    """Liveness comes from ZMQ's I/O threads: a server whose owner never polls (a worker
    busy computing) still answers heartbeats; a server that goes away is reported."""
    srv = SideChannelServer("127.0.0.1", 0, TOKEN, LIMIT, handler)  # never polled
    client = SideChannelClient(srv.endpoint, TOKEN, LIMIT, liveness_timeout_s=0.5)
    try:
        client.send(Ping(nonce=7))  # connects; the server owner never answers it
        deadline = time.monotonic() + 30
        while not client.is_connected:
            assert time.monotonic() < deadline, "never connected"
            time.sleep(0.05)
        deadline = time.monotonic() + 2.5  # five liveness timeouts
        while time.monotonic() < deadline:
            assert client.is_connected
            time.sleep(0.05)
        srv.close()
        deadline = time.monotonic() + 30
        while client.is_connected:
            assert time.monotonic() < deadline, "a closed server was never reported lost"
            time.sleep(0.05)
    finally:
        client.close()
        srv.close()


def test_a_port_nothing_listens_on_is_refused_a_silent_server_is_not() -> None:
    """`is_refused` once a peer's host refused connections for the liveness bound (its
    process is gone); a server whose owner never polls is reached by ZMQ's I/O thread and
    is never reported refused."""
    port = free_port()  # a port of this host that nothing listens on
    srv = SideChannelServer("127.0.0.1", 0, TOKEN, LIMIT, handler)  # never polled
    gone = SideChannelClient(f"tcp://127.0.0.1:{port}", TOKEN, LIMIT, liveness_timeout_s=0.3)
    silent = SideChannelClient(srv.endpoint, TOKEN, LIMIT, liveness_timeout_s=0.3)
    try:
        silent.send(Ping(nonce=1))
        deadline = time.monotonic() + 30
        while not gone.is_refused:
            assert time.monotonic() < deadline, "a closed port was never reported refused"
            time.sleep(0.05)
        while not silent.is_connected:
            assert time.monotonic() < deadline, "never connected"
            time.sleep(0.05)
        time.sleep(0.6)  # two bounds
        assert not silent.is_refused and silent.is_connected
    finally:
        gone.close()
        silent.close()
        srv.close()


@pytest.mark.timeout(300, method="thread")  # before the fix its clean-up hung too
def test_a_client_whose_events_nobody_reads_does_not_stop_the_process_side_channels(
    server: SideChannelServer,
) -> None:
    """A monitored client refused by its peer over and over (here: the wrong token, ZMQ
    retrying every millisecond) piles up connection events while nobody asks whether it
    is connected. Past 2,000 of them pyzmq's own monitor socket blocked ZMQ's one I/O
    thread of the process, and every side channel made after it never connected (the
    fresh-clone run whose 26 in-process side-channel tests failed)."""
    ctx = side_channel._ctx()
    ctx.setsockopt(zmq.RECONNECT_IVL, 1)  # clients made now retry every millisecond
    try:
        unread = SideChannelClient(server.endpoint, b"another-token", LIMIT, 0.5)
        counted = SideChannelClient(server.endpoint, b"another-token", LIMIT, 0.5)
    finally:
        del ctx.sockopts[zmq.RECONNECT_IVL]
    try:
        # `counted` is refused as often as `unread`: its events, read as they come, say
        # when `unread`'s queue passed the 2,000 that stopped the I/O thread
        seen, deadline = 0, time.monotonic() + 120
        while seen < 2500:
            assert time.monotonic() < deadline, f"ZMQ's I/O thread stopped after {seen} events"
            time.sleep(0.1)
            seen += drain(counted)
        fresh = SideChannelClient(server.endpoint, TOKEN, LIMIT)
        try:
            assert fresh.call(Ping(nonce=3), timeout_s=30) == Pong(nonce=3, instance_id="server")
        finally:
            fresh.close()
        assert drain(unread) > 2000  # all of them still there, none lost, nothing blocked
    finally:
        unread.close()
        counted.close()


def drain(client: SideChannelClient) -> int:
    """How many connection events wait on `client`'s monitor (read and dropped)."""
    n = 0
    while client._monitor is not None and client._monitor.poll(0):
        client._monitor.recv_multipart()
        n += 1
    return n


def test_a_monitored_client_collected_unclosed_stops_its_monitor_before_closing_it(
    server: SideChannelServer,
) -> None:
    """A monitored client nobody closed (its owner dropped) while its peer refuses it:
    when it is collected, its monitoring is stopped before the monitor's end is closed,
    whatever order the collector takes. The other order stops the process: ZMQ's I/O
    thread blocks writing the next connection event to a monitor with nobody on the
    other end, and every side channel of the process stops connecting (a fresh-clone run
    whose later in-process side-channel tests all failed, after a test that never closed
    a consumer; the other order is forced here in a process of its own)."""
    ctx = side_channel._ctx()
    ctx.setsockopt(zmq.RECONNECT_IVL, 1)  # retry every millisecond: events at once
    try:
        dropped = SideChannelClient(f"tcp://127.0.0.1:{free_port()}", TOKEN, LIMIT, 0.5)
    finally:
        del ctx.sockopts[zmq.RECONNECT_IVL]
    sock, monitor = dropped._sock, dropped._monitor
    assert monitor is not None
    dropped.cycle = dropped  # type: ignore[attr-defined]  # collected by the cycle collector
    del dropped
    gc.collect()
    assert sock.closed and monitor.closed  # although this test still holds both
    time.sleep(0.3)
    assert ping_answered(server.endpoint)
    # the other order, forced in a process of its own: its side channels stop
    wrong = subprocess.run(
        [sys.executable, "-c", WRONG_ORDER, server.endpoint, TOKEN.decode()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert wrong.stdout.strip() == "stopped", wrong.stderr


#: A client whose monitor is closed before it, then a fresh client's ping.
WRONG_ORDER = """
import os, sys, time, zmq
from kvbridge.transfer import side_channel
from kvbridge.transfer.messages import Ping
from kvbridge.transfer.netdev import free_port
from kvbridge.transfer.side_channel import SideChannelClient
from kvbridge.transfer.errors import HandshakeError
side_channel._ctx().setsockopt(zmq.RECONNECT_IVL, 1)
c = SideChannelClient(f"tcp://127.0.0.1:{free_port()}", sys.argv[2].encode(), 1 << 20, 0.5)
del side_channel._ctx().sockopts[zmq.RECONNECT_IVL]
c._monitor.close(linger=0)
time.sleep(0.3)
fresh = SideChannelClient(sys.argv[1], sys.argv[2].encode(), 1 << 20)
try:
    fresh.call(Ping(nonce=5), timeout_s=1)
    print("answered", flush=True)
except HandshakeError:
    print("stopped", flush=True)
os._exit(0)  # the stopped I/O thread would hang the interpreter's exit
"""


def ping_answered(endpoint: str) -> bool:
    fresh = SideChannelClient(endpoint, TOKEN, LIMIT)
    try:
        return fresh.call(Ping(nonce=4), timeout_s=3) == Pong(nonce=4, instance_id="server")
    except HandshakeError:
        return False
    finally:
        fresh.close()
