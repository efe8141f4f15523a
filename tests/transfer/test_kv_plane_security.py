"""The KV plane against an attacker on the network (issue #14): every attack that worked
on protocol version 1 is refused. Real producers and consumers with their real side
channels (ZMQ, CURVE with a shared token) in one process; the transport is the fake one,
so notifications are handed over as NIXL would deliver them."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from kvbridge.errors import ConfigError
from kvbridge.plan.layout import InstanceLayout
from kvbridge.transfer.agent import XferState
from kvbridge.transfer.config import TransferConfig
from kvbridge.transfer.connector import ConnectorRole
from kvbridge.transfer.consumer import KVConsumer, TransferState
from kvbridge.transfer.credential import Credential, RootKey
from kvbridge.transfer.identity import Identity
from kvbridge.transfer.integrity import Integrity
from kvbridge.transfer.messages import Hello, LayoutWire, ModelWire, Refused, Welcome
from kvbridge.transfer.producer import KVProducer, Release, ReleaseCause
from kvbridge.transfer.side_channel import SideChannelClient
from tests.credentials import ROOT, enrolled

from .fakes import (
    DECODE,
    MODEL,
    NUM_BLOCKS,
    PREFILL,
    Clock,
    FakeTransport,
    deliver,
    drive,
    regions,
    signed,
)

TOKEN = b"a-shared-secret-of-the-deployment"
TP2 = InstanceLayout(tp_size=2)


def make_producer(
    clock: Clock,
    released: list[Release],
    rank: int = 0,
    layout: InstanceLayout = TP2,
    credential: Credential | None = None,
) -> KVProducer:
    return KVProducer(
        model=MODEL,
        layout=layout,
        rank=rank,
        regions=regions(layout, rank),
        num_blocks=NUM_BLOCKS,
        transport=FakeTransport(f"prefill{rank}"),
        config=TransferConfig(token=TOKEN, lease_s=10, transfer_timeout_s=5, handshake_timeout_s=2),
        instance_id="P",
        on_release=released.append,
        clock=clock,
        credential=credential,
    )


#: The consumers this module's tests made, closed after each test (`closes_consumers`).
_CONSUMERS: list[KVConsumer] = []


@pytest.fixture(autouse=True)
def closes_consumers() -> Iterator[None]:
    yield
    while _CONSUMERS:
        _CONSUMERS.pop().close()


def make_consumer(
    clock: Clock,
    instance_id: str = "D",
    rank: int = 0,
    identity: Identity | None = None,
    root: bytes | None = None,
) -> KVConsumer:
    consumer = KVConsumer(
        model=MODEL,
        layout=DECODE,
        rank=rank,
        regions=regions(DECODE, rank),
        num_blocks=NUM_BLOCKS,
        transport=FakeTransport(f"{instance_id}{rank}"),
        config=TransferConfig(
            token=TOKEN, transfer_timeout_s=5, handshake_timeout_s=2, integrity=Integrity.OFF
        ),
        instance_id=instance_id,
        clock=clock,
        identity=identity,
        root=root,
    )
    _CONSUMERS.append(consumer)
    return consumer


@pytest.fixture
def pair() -> Iterator[tuple[KVProducer, KVProducer, list[Release], Clock]]:
    """Prefill workers 0 and 1 of one tp-2 instance "P" (each holds one KV head)."""
    clock, released = Clock(), []
    ps = [make_producer(clock, released, r) for r in (0, 1)]
    endpoints = [p.endpoint for p in ps]
    for p in ps:
        p.set_worker_endpoints(endpoints)
    yield ps[0], ps[1], released, clock
    for p in ps:
        p.close()


def hello(instance_id: str, nonce: bytes, layout: InstanceLayout = DECODE) -> Hello:
    return Hello(
        instance_id=instance_id,
        rank=0,
        model=ModelWire.of(MODEL),
        layout=LayoutWire.of(layout),
        nonce=nonce,
    )


def ask(
    p: KVProducer,
    msg: Hello,
    token: bytes | None = TOKEN,
    source: str = "",
    wait_s: float = 3,
    identity: Identity | None = None,
) -> object:
    """Send `msg` to `p`'s side channel (from loopback address `source`, if given, with
    `identity`'s key, else a fresh one), serving it meanwhile; the reply, or None if
    none came within `wait_s`."""
    endpoint = p.endpoint.replace("tcp://", f"tcp://{source}:0;") if source else p.endpoint
    client = SideChannelClient(endpoint, token, 1 << 22, identity=identity)
    try:
        client.send(msg)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            p.poll(timeout_ms=5)
            reply = client.try_recv()
            if reply is not None:
                return reply
        return None
    finally:
        client.close()


def pull_all(p0: KVProducer, p1: KVProducer, cs: list[KVConsumer], rid: str) -> None:
    """Decode workers `cs` pull `rid` (blocks [3], 4 tokens) from instance P and their
    READs finish; their notifications are left in the fake transports."""
    for c in cs:
        c.pull(rid, p0.endpoint, [3], [5], 4)
    for _ in range(40):
        p0.poll(5)
        p1.poll(5)
        for c in cs:
            c.poll()
    for c in cs:
        assert isinstance(c.transport, FakeTransport) and c.transport.reads
        c.transport.read_state = XferState.DONE


def test_a_replayed_hello_is_refused_and_counted(pair) -> None:
    p0, _, _, _ = pair
    first = ask(p0, hello("D", b"n" * 16))
    assert isinstance(first, Welcome) and first.hello_nonce == b"n" * 16
    again = ask(p0, hello("D", b"n" * 16))
    assert isinstance(again, Refused) and again.kind == "replay"
    assert "replayed handshake" in again.reason and p0.num_replays == 1
    other = ask(p0, hello("D", b"m" * 16))  # a fresh nonce is a fresh session
    assert isinstance(other, Welcome) and other.nonce != first.nonce


def test_without_the_token_a_peer_gets_no_answer_at_all(pair) -> None:
    p0, _, _, _ = pair
    # (a Hello with the token is answered within milliseconds, as the other tests show)
    assert ask(p0, hello("X", b"x" * 16), token=None, wait_s=1) is None
    assert ask(p0, hello("X", b"y" * 16), token=b"some-other-token-0123", wait_s=1) is None


def test_forged_or_replayed_read_done_leaves_the_blocks_pinned_until_the_reader(pair) -> None:
    """A token holder posing as decode instance X, and replays of the real reader's
    notification to the other prefill worker, cannot release a request exposed for D."""
    p0, p1, released, clock = pair
    for p in (p0, p1):
        p.expose("victim", [3], 4, reader="D")
    mallory = make_consumer(clock, "X")
    real = make_consumer(clock, "D")
    mallory.pull("warm", p0.endpoint, [3], [5], 4)  # handshakes X with P's workers
    drive(p0, [mallory], rounds=30)
    p1.poll(5)
    deliver(p0, signed(mallory, p0, "victim"))  # a valid session, the wrong instance
    p0.poll()
    assert released == [] and p0.num_replays == 1 and p0.num_pinned_blocks == 1
    # the real reader D (decode tp 2, rank 0 reads head 0 from prefill rank 0)
    notif = read_victim(p0, p1, real)
    deliver(p1, notif)  # replayed to the other prefill worker: not its session
    p1.poll()
    assert p1.num_replays == 1 and not [r for r in released if r.request_id == "victim"]
    deliver(p0, notif)
    p0.poll()
    assert [(r.request_id, r.cause) for r in released] == [("victim", ReleaseCause.COMPLETED)]


def read_victim(p0: KVProducer, p1: KVProducer, reader: KVConsumer) -> bytes:
    """`reader` pulls "victim" (blocks [3], 4 tokens) from instance P: the notification
    its READ carries (left undelivered)."""
    reader.pull("victim", p0.endpoint, [3], [5], 4)
    for _ in range(40):
        p0.poll(5)
        p1.poll(5)
        reader.poll()
    assert isinstance(reader.transport, FakeTransport)
    return bytes(reader.transport.reads[0][2])


def test_an_instance_id_bound_to_a_key_is_refused_to_every_other_key(pair) -> None:
    """A decode instance's id names its key (issue #21 item 3): a token holder who
    claims it with another key is refused at its Hello, so it has no session in which
    to forge the reader's ReadDones or to replace its plan; the instance holding the
    key handshakes, pulls and releases as before."""
    p0, p1, released, clock = pair
    key = Identity.generate()
    reader = key.bind("decode")
    for p in (p0, p1):
        p.expose("victim", [3], 4, reader=reader)
    refused = ask(p0, hello(reader, b"i" * 16))  # a token holder's own (ephemeral) key
    assert isinstance(refused, Refused) and refused.kind == "auth", refused
    assert reader in refused.reason and "another key" in refused.reason
    assert isinstance(ask(p0, hello(reader + "0", b"j" * 16)), Welcome)  # unbound look-alike
    with pytest.raises(ConfigError, match="bound to the key"):
        make_consumer(clock, reader, identity=Identity.generate())
    with pytest.raises(ConfigError, match="no identity"):
        make_consumer(clock, reader)
    real = make_consumer(clock, reader, identity=key)
    notif = read_victim(p0, p1, real)
    deliver(p0, notif)
    p0.poll()
    assert [(r.request_id, r.cause) for r in released] == [("victim", ReleaseCause.COMPLETED)]


@pytest.mark.parametrize(
    ("signer", "words"),
    [
        (enrolled(ConnectorRole.PRODUCER, "P"), ""),  # the deployment's prefill instance
        (None, "sent no certificate"),
        (enrolled(ConnectorRole.PRODUCER, "P", RootKey.generate()), "not by this deployment"),
        (enrolled(ConnectorRole.CONSUMER, "P"), "enrolled as a decode instance"),
        (enrolled(ConnectorRole.PRODUCER, "Q"), "names instance 'P' but is signed by 'Q'"),
    ],
    ids=["enrolled", "no credential", "another root", "a decode key", "another prefill"],
)
def test_a_decode_worker_meets_only_prefill_instances_its_root_enrolled(
    signer: Credential | None, words: str
) -> None:
    """A party holding the token could answer a decode worker's handshake in a prefill
    instance's place (at an address it took over): its Welcome's NIXL metadata would
    have the decode worker read its memory as that instance's KV. A decode worker with
    a root takes only Welcomes signed by a prefill instance its root enrolled, for the
    instance they name; the pull fails naming why, before anything is read."""
    clock: Clock = Clock()
    ps = [make_producer(clock, [], r, credential=signer) for r in (0, 1)]
    try:
        for p in ps:
            p.set_worker_endpoints([q.endpoint for q in ps])
            p.expose("r1", [3], 4)
        c = make_consumer(clock, root=ROOT.public)
        c.pull("r1", ps[0].endpoint, [3], [5], 4)
        results = []
        for _ in range(40):
            for p in ps:
                p.poll(5)
            results += c.poll()
        assert isinstance(c.transport, FakeTransport)
        if not words:
            assert c.transport.reads and not results  # met, reading
            return
        (failed,) = results
        assert failed.state is TransferState.FAILED and words in failed.reason, failed
        assert not c.transport.reads
    finally:
        for p in ps:
            p.close()


def test_a_hello_cannot_replace_another_instances_plan(pair) -> None:
    p0, p1, released, clock = pair
    d0, d1 = make_consumer(clock, "D", 0), make_consumer(clock, "D", 1)
    for p in (p0, p1):
        p.expose("r1", [3], 4)
    pull_all(p0, p1, [d0, d1], "r1")
    # an insider claims D's id with another layout (tp 1: it would read every head)
    assert isinstance(ask(p0, hello("D", b"z" * 16, InstanceLayout(tp_size=1))), Welcome)
    for _ in range(2):
        for c in (d0, d1):
            c.poll()
    for p, d in ((p0, d0), (p1, d1)):
        for notif in [r[2] for r in d.transport.reads if r[2]]:
            deliver(p, notif)
        p.poll()
    # D's own sessions and plans still count: both prefill workers released r1
    assert sorted((r.request_id, r.cause) for r in released) == [("r1", ReleaseCause.COMPLETED)] * 2


def test_a_hello_flood_leaves_the_real_peer_working(pair) -> None:
    p0, _, released, clock = pair
    p0._sessions.max_sessions = 32  # the flood fills the table quickly
    real = make_consumer(clock, "D")
    p0.expose("warm", [1], 4)
    real.pull("warm", p0.endpoint, [1], [2], 4)
    drive(p0, [real], rounds=30)
    refused = 0
    for i in range(100):  # fresh instance ids, fresh nonces: all valid Hellos
        reply = ask(p0, hello(f"flood-{i}", i.to_bytes(16, "big")))
        refused += isinstance(reply, Refused) and reply.kind == "busy"
    assert refused > 0 and len(p0._sessions) <= 32
    assert ("D", 0) in p0._sessions.peers()  # never evicted while in use

    real.transport.read_state = XferState.DONE
    assert drive(p0, [real], rounds=30) == []  # not used before P0 confirms it held it
    deliver(p0, real.transport.reads[0][2])
    (res,) = drive(p0, [real], rounds=30)
    assert res.state is TransferState.DONE
    assert [(r.request_id, r.cause) for r in released] == [("warm", ReleaseCause.COMPLETED)]


def test_a_hello_flood_from_one_host_leaves_room_for_the_others(pair) -> None:
    """Issue #21 item 3: a token holder can make keys, so a flood of fresh (bound) ids
    filled a prefill worker's session table with young sessions, and a decode instance
    meeting it then was refused "busy" for `grace_s`. One network address now holds at
    most a quarter of the shared pool (half the table)."""
    p0, _, _, _ = pair
    p0._sessions.max_sessions = 32
    refused = []
    for i in range(40):
        reply = ask(p0, hello(f"flood-{i}", i.to_bytes(16, "big")), source="127.0.0.2")
        if isinstance(reply, Refused):
            refused.append(reply.reason)
    assert len(refused) == 40 - 4 and "come from 127.0.0.2 already" in refused[0], refused[:1]
    newcomer = ask(p0, hello("E", os.urandom(16)), source="127.0.0.3")
    assert isinstance(newcomer, Welcome), newcomer


def flood(p: KVProducer, count: int, sources: list[str]) -> list[object]:
    """A token holder's flood: `count` valid Hellos, round robin from `sources`, each
    with a key of its own; every other one in an id bound to that key. The replies."""
    replies = []
    for i in range(count):
        key = Identity.generate()
        iid = key.bind(f"flood-{i}") if i % 2 else f"flood-{i}"
        source = sources[i % len(sources)]
        replies.append(ask(p, hello(iid, os.urandom(16)), source=source, identity=key))
    return replies


def test_a_flood_from_many_addresses_leaves_room_for_a_decode_instance_a_request_names(
    pair,
) -> None:
    """Issue #46 item 2: fresh keys, fresh ids (bound to those keys or not) and several
    network addresses filled every session of a prefill worker, so that a new decode
    instance was refused "busy" for as long as the flood went on. Such Hellos now share a
    pool of half the table; the other half is kept for decode instances whose bound id
    a pinned request names, and no pooled Hello evicts their sessions, even idle ones."""
    p0, _, released, clock = pair
    p0._sessions.max_sessions = 32  # a pool of 16, 4 per address
    key = Identity.generate()
    named = key.bind("decode")
    early = ask(p0, hello(named, os.urandom(16)), source="127.0.0.6", identity=key)
    assert isinstance(early, Welcome)  # met before any request names it: pooled
    p0.expose("r1", [3], 4, reader=named)  # now it is named: its session is reserved
    assert p0._sessions.num_reserved(named) == 1
    replies = flood(p0, 48, [f"127.0.0.{i}" for i in range(2, 7)])
    assert all(isinstance(r, (Welcome, Refused)) for r in replies)  # each one answered
    assert sum(isinstance(r, Welcome) for r in replies) == 16  # the pool is full
    assert {r.kind for r in replies if isinstance(r, Refused)} == {"busy"}
    for other, who in ((Identity.generate(), "unbound"), (Identity.generate(), "bound")):
        iid = other.bind("newcomer") if who == "bound" else "newcomer"
        out = ask(p0, hello(iid, os.urandom(16)), source="127.0.0.7", identity=other)
        assert isinstance(out, Refused) and "shared pool are in use" in out.reason, (who, out)
    again = ask(p0, hello(named, os.urandom(16)), source="127.0.0.7", identity=key)
    assert isinstance(again, Welcome), again
    # idle, its request released: still no pooled Hello evicts its sessions
    clock.now += 1000
    p0.poll()
    assert [r.request_id for r in released] == ["r1"]
    replies = flood(p0, 24, [f"127.0.0.{i}" for i in range(2, 7)])
    assert sum(isinstance(r, Welcome) for r in replies) == 16  # evicting the idle flood
    assert p0._sessions.num_reserved(named) == 2 and (named, 0) in p0._sessions.peers()


def test_a_capability_that_outruns_its_exposure_is_let_in_once_the_exposure_names_it(
    pair,
) -> None:
    """The capability may reach the decode instance before its prefill workers pin the
    request (the connector's Expose goes out at the engine's next step): a first Hello
    in a full pool is refused "busy", so the decode worker asks again, backing off, and
    is let in once the exposure names it; its pull then completes."""
    p0, p1, released, clock = pair
    p0._sessions.max_sessions = 8  # a pool of 4, 1 per address
    flood(p0, 8, [f"127.0.0.{i}" for i in range(2, 6)])
    key = Identity.generate()
    reader = key.bind("decode")
    real = make_consumer(clock, reader, identity=key)
    real.pull("r1", p0.endpoint, [3], [5], 4)
    drive(p0, [real], rounds=30)
    w = real.directory.instance(p0.endpoint).worker0
    assert w.num_busy == 1 and w.retry_at is not None  # waits to ask again
    for p in (p0, p1):
        p.expose("r1", [3], 4, reader=reader)
    clock.now += 0.05  # past the first retry, well within the handshake timeout
    drive(p0, [real], rounds=30)
    assert w.welcome is not None and p0._sessions.num_reserved(reader) == 1
    assert isinstance(real.transport, FakeTransport) and real.transport.reads
    real.transport.read_state = XferState.DONE
    deliver(p0, real.transport.reads[-1][2])
    (res,) = drive(p0, [real], rounds=30)
    assert res.state is TransferState.DONE, res.reason
    assert [(r.request_id, r.cause) for r in released] == [("r1", ReleaseCause.COMPLETED)]


def test_a_handshake_refused_busy_until_its_deadline_fails_with_the_reason(pair) -> None:
    p0, _, _, clock = pair
    p0._sessions.max_sessions = 8
    flood(p0, 8, [f"127.0.0.{i}" for i in range(2, 6)])
    real = make_consumer(clock, "D")  # unbound: it competes in the pool
    real.pull("r1", p0.endpoint, [3], [5], 4)
    # the first refusal, in real time (the clock stands still until it came)
    results = drive(p0, [real], rounds=5)
    worker = real.directory.instance(p0.endpoint).worker0
    deadline = time.monotonic() + 60
    while not worker.num_busy:
        assert time.monotonic() < deadline, "no answer to the Hello"
        results += drive(p0, [real], rounds=5)
    for _ in range(20):
        clock.now += 0.5
        results += drive(p0, [real], rounds=5)
    (res,) = results
    assert res.state is TransferState.FAILED
    assert "until its deadline (2 s)" in res.reason and "shared pool" in res.reason, res.reason


def test_an_unbound_id_a_request_names_competes_in_the_pool(pair) -> None:
    """An unbound id is anybody's to claim, so naming it earns no reserved room."""
    p0, _, _, _ = pair
    p0._sessions.max_sessions = 8  # a pool of 4, 1 per address
    p0.expose("r1", [3], 4, reader="decode")
    flood(p0, 8, [f"127.0.0.{i}" for i in range(2, 6)])
    out = ask(p0, hello("decode", os.urandom(16)), source="127.0.0.6")
    assert isinstance(out, Refused) and "shared pool are in use" in out.reason, out


def test_a_decode_worker_whose_session_was_evicted_meets_the_producer_afresh(pair) -> None:
    """A decode worker idle past the session windows has its session evicted by a flood
    of Hellos; the producer then ignores its ReadDones (their signature names a session
    it no longer has), so that pull fails at its timeout, waiting for the ReadAck. The
    next pull handshakes afresh and completes (issue #21 item 3), instead of every
    later pull timing out the same way."""
    p0, p1, released, clock = pair
    real = make_consumer(clock, "D")
    for p in (p0, p1):
        p.expose("r1", [1], 4)
    real.pull("r1", p0.endpoint, [1], [2], 4)
    drive(p0, [real], rounds=30)
    p1.poll(5)
    assert isinstance(real.transport, FakeTransport)
    real.transport.read_state = XferState.DONE
    deliver(p0, real.transport.reads[-1][2])
    (first,) = drive(p0, [real], rounds=30)
    assert first.state is TransferState.DONE
    clock.now += 1000  # past every session window (grace, lease): D is idle
    p0._sessions.max_sessions = len(p0._sessions) + 8
    for i in range(40):  # a token holder's flood, fresh ids and nonces
        ask(p0, hello(f"flood-{i}", i.to_bytes(16, "big")))
    assert ("D", 0) not in p0._sessions.peers()  # evicted
    for p in (p0, p1):
        p.expose("r2", [3], 4, reader="D")
    real.pull("r2", p0.endpoint, [3], [5], 4)
    drive(p0, [real], rounds=30)
    deliver(p0, real.transport.reads[-1][2])  # ignored: its session is gone
    assert drive(p0, [real], rounds=30) == []
    clock.now += 6  # past the transfer timeout (5 s), within the lease (10 s)
    (stale,) = drive(p0, [real], rounds=5)
    assert stale.state is TransferState.FAILED and "ReadAck" in stale.reason, stale.reason
    assert p0.num_pinned_blocks == 1  # r2 stays pinned until its lease: never completed
    clock.now += 10  # the flood's sessions are no longer young: room for a newcomer
    for p in (p0, p1):
        p.expose("r3", [4], 4, reader="D")
    real.pull("r3", p0.endpoint, [4], [6], 4)  # meets P afresh: a new session
    drive(p0, [real], rounds=30)
    assert ("D", 0) in p0._sessions.peers()
    deliver(p0, real.transport.reads[-1][2])
    (third,) = drive(p0, [real], rounds=30)
    assert third.state is TransferState.DONE, third.reason
    assert ("r3", ReleaseCause.COMPLETED) in [(r.request_id, r.cause) for r in released]


class Relay:
    """A TCP relay between a consumer and a producer's side channel that keeps a copy of
    every byte in both directions (what someone on the path sees)."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.server.getsockname()[1]}"
        self.seen = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            with self._lock:
                self.seen += data
            dst.sendall(data)

    def close(self) -> None:
        self.server.close()


@pytest.mark.parametrize("token", [TOKEN, None])
def test_the_handshake_on_the_wire_shows_no_agent_metadata_with_a_token(token) -> None:
    clock, released = Clock(), []
    tp1 = InstanceLayout(tp_size=1)
    p = make_producer(clock, released, 0, tp1)
    if token is None:  # the same deployment without a secret, as a contrast
        p.close()
        p = KVProducer(
            model=MODEL,
            layout=tp1,
            rank=0,
            regions=regions(tp1, 0),
            num_blocks=NUM_BLOCKS,
            transport=FakeTransport("prefill0"),
            config=TransferConfig(lease_s=10),
            instance_id="P",
            on_release=released.append,
            clock=clock,
        )
    relay = Relay(p.endpoint)
    # tp 1: the consumer reaches worker 0 at the endpoint it was given, the relay
    c = make_consumer(clock)
    if token is None:
        c.config = TransferConfig(
            transfer_timeout_s=5, handshake_timeout_s=2, integrity=Integrity.OFF
        )
        c.directory.config = c.config
    try:
        p.expose("r1", [3], 4)
        c.pull("r1", relay.endpoint, [3], [5], 4)
        deadline = time.monotonic() + 30  # a loaded host: the relay's threads take turns
        while not c.transport.reads and time.monotonic() < deadline:
            drive(p, [c], rounds=5)
        assert c.transport.reads, "the handshake through the relay did not complete"
        seen = bytes(relay.seen)
        secret_bits = [p.transport.metadata(), p.transport.name.encode()]
        address = p.regions.addresses[0].to_bytes(8, "big")
        if token is None:  # in the clear: the relay sees the agent metadata
            assert any(b in seen for b in secret_bits)
        else:
            assert seen and not any(b in seen for b in [*secret_bits, address])
    finally:
        relay.close()
        c.close()
        p.close()


def test_a_capability_binds_its_prompt_and_opens_one_pull() -> None:
    from kvbridge.transfer.capability import Capability, Redeemed, check, issue, prompt_digest
    from kvbridge.transfer.errors import AuthError

    ids = [5, 17, 4812, 9]
    digest = prompt_digest(ids)
    assert digest != prompt_digest([1, 1, 1, 1]) and digest != prompt_digest(ids[:3])
    cap = Capability("r1", "P", "tcp://127.0.0.1:5000", [3], 4, "D", time.time() + 60)
    cap = msgspec.structs.replace(cap, prompt_digest=digest)
    prefill = enrolled(ConnectorRole.PRODUCER, "P")
    assert check(issue(cap, prefill), ROOT.public, "D").prompt_digest == digest  # signed
    redeemed = Redeemed()
    redeemed.redeem(cap)
    with pytest.raises(AuthError, match="used before"):
        redeemed.redeem(cap)
    redeemed.redeem(msgspec.structs.replace(cap, request_id="r2"))  # another one is new
    redeemed.redeem(cap, now=cap.expires_at + 1)  # expired: forgotten (check refuses it)
    assert len(redeemed) == 1


# -- what a token holder reaches with a prefill worker's NIXL metadata (real agents) -------
def widened(welcome: Welcome) -> bytes:
    """The Welcome's agent metadata with its region's bounds widened to the whole address
    space (what an attacker edits in its own copy; software transports do not check), and
    the fence words' registration moved out of the way (below the widened region)."""
    from kvbridge.transfer.fence import SLOTS

    def at(md: bytes, addr: int, length: int) -> int:
        i = md.find(addr.to_bytes(8, "little") + length.to_bytes(8, "little"))
        assert i > 0, "the region's address and length are in the metadata"
        return i

    md = welcome.agent_metadata
    (addr, length), fence = welcome.regions[0], welcome.fence_words
    i = at(md, fence, SLOTS * 8)
    md = md[:i] + (0x10).to_bytes(8, "little") + (8).to_bytes(8, "little") + md[i + 16 :]
    i = at(md, addr, length)
    return md[:i] + (0x1000).to_bytes(8, "little") + (1 << 47).to_bytes(8, "little") + md[i + 16 :]


class Attacker:
    """A token holder's own NIXL agent with a small buffer, reading and writing at will."""

    def __init__(self, welcome: Welcome, pump: Callable[[], object]) -> None:
        from kvbridge.transfer.agent import NixlTransport
        from kvbridge.transfer.regions import CacheRegions

        self.buf = np.zeros(64, dtype=np.uint8)
        self.agent = NixlTransport("attacker", CacheRegions.from_array(self.buf[None, :]))
        self.peer = self.agent.add_peer(widened(welcome))
        self.pump = pump  # the prefill worker's polls (its agent's progress)

    def op(self, write: bool, addr: int) -> str:
        """READ 64 bytes at `addr` of the peer into `buf` (or WRITE `buf` there)."""
        from kvbridge.transfer.errors import TransferError
        from kvbridge.transfer.regions import MemType

        local = self.agent.prep_local(np.array([[self.buf.ctypes.data, 64, 0]], dtype=np.uint64))
        remote = self.agent.prep_remote(
            self.peer, np.array([[addr, 64, 0]], dtype=np.uint64), MemType.DRAM
        )
        idx = np.zeros(1, dtype=np.int32)
        try:
            post = self.agent.write if write else self.agent.read
            xfer, state = post(local, idx, remote, idx, b"")
            deadline = time.monotonic() + 10
            while state is XferState.PROC and time.monotonic() < deadline:
                self.pump()
                state = self.agent.state(xfer)
            self.agent.release(xfer)
            return state.value
        except TransferError as exc:
            return f"refused: {exc}"
        finally:
            self.agent.release_dlist(local)
            self.agent.release_dlist(remote)

    def close(self) -> None:
        self.agent.remove_peer(self.peer)
        self.agent.close()


@pytest.fixture
def exporting(request, monkeypatch) -> Iterator[tuple[Any, np.ndarray, str]]:
    """A prefill worker's connector (instance "P", tp 1, a token) over a cache in shared
    memory, with `kv_export` as parametrized; and that cache as bytes."""
    from kvbridge.transfer.connector import ConnectorRole, ConnectorSpec, WorkerConnector
    from kvbridge.transfer.export import SharedSegment
    from kvbridge.transfer.regions import CacheRegions

    monkeypatch.setenv("KVBRIDGE_TRANSFER_TOKEN", TOKEN.decode())  # never the export's
    mode, _, over = request.param.partition(" over ")
    if over:  # UCX's transport for the export's agent and the attacker's
        monkeypatch.setenv("UCX_TLS", over)
    size = regions(PREFILL, 0).lengths[0]
    segment = SharedSegment(size)
    config = TransferConfig(token=TOKEN, kv_export=mode, handshake_timeout_s=2)
    wc = WorkerConnector(
        ConnectorSpec(ConnectorRole.PRODUCER, "P", config),
        MODEL,
        PREFILL,
        0,
        CacheRegions.from_array(segment.array[None, :]),
        NUM_BLOCKS,
        progress_thread=False,
        segment=segment,
    )
    segment.array[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)  # the KV
    yield wc, segment.array, mode
    wc.close()


@pytest.mark.parametrize("exporting", ["process", "inline"], indirect=True)
def test_a_token_holder_reaches_only_the_exported_kv_and_cannot_write_it(exporting) -> None:
    """Issue #21 item 4: with bounds widened in its copy of the metadata, a token holder
    read the prefill worker's heap and wrote its cache (inline, the control). With the
    KV exported from a process of its own (the default with a token) the worker's memory
    is not in the address space it reads, and the export maps the KV read-only."""
    wc, kv, mode = exporting
    secret = np.frombuffer(os.urandom(64), dtype=np.uint8).copy()  # in the worker's heap
    welcome = ask(wc.producer, hello("D", os.urandom(16)))
    assert isinstance(welcome, Welcome)
    attacker = Attacker(welcome, lambda: wc.producer.poll(1))
    try:
        assert attacker.op(False, welcome.regions[0][0] + 128) == "DONE"  # granted: the KV
        assert bytes(attacker.buf) == bytes(kv[128:192])
        heap = (attacker.op(False, secret.ctypes.data), bytes(attacker.buf))
        attacker.buf[:] = 0xEE
        wrote = attacker.op(True, welcome.regions[0][0])
        if mode == "inline":  # the control: the attack works
            assert heap == ("DONE", bytes(secret))
            assert wrote == "DONE" and (kv[:64] == 0xEE).all()
            return
        assert heap[1] != bytes(secret), f"read the worker's heap ({heap[0]})"
        assert wrote != "DONE" and (kv[:64] == np.arange(64)).all(), "wrote the KV"
    finally:
        attacker.close()
    proc = Path(f"/proc/{wc.transport.pid}")
    environ = (proc / "environ").read_bytes()
    assert TOKEN not in environ and b"KVBRIDGE_TRANSFER_TOKEN" not in environ
    assert TOKEN not in (proc / "cmdline").read_bytes()
    kv_maps = [ln for ln in (proc / "maps").read_text().splitlines() if "kvbridge-kv" in ln]
    assert kv_maps and all(ln.split()[1] == "r--s" for ln in kv_maps)  # read-only, shared
    assert "Seccomp:\t2" in (proc / "status").read_text()  # its filter (test_sandbox.py)


@pytest.mark.parametrize("exporting", ["process over tcp"], indirect=True)
def test_a_write_that_crashes_the_export_leaves_the_worker_serving(exporting) -> None:
    """Issue #21 item 4: one bad operation of a token holder killed the prefill instance.
    Over TCP, UCX writes for the peer inside the target process: a WRITE into the
    read-only KV crashes the export process, not the worker, whose next poll starts a
    new one (a new agent); a decode worker meeting it afresh reads the KV again."""
    wc, kv, _ = exporting
    export = wc.transport
    first_pid, first_name = export.pid, export.name
    welcome = ask(wc.producer, hello("D", os.urandom(16)))
    assert isinstance(welcome, Welcome)
    attacker = Attacker(welcome, lambda: wc.producer.poll(1))
    try:
        assert attacker.op(False, welcome.regions[0][0]) == "DONE"
        attacker.buf[:] = 0xEE
        assert attacker.op(True, welcome.regions[0][0] + 64) != "DONE"
        deadline = time.monotonic() + 10
        while export.num_restarts == 0 and time.monotonic() < deadline:
            wc.producer.poll(1)  # finds the export process gone, starts another
        assert export.num_restarts == 1 and export.pid != first_pid
        assert export.name == f"{first_name}.1"
        assert (kv[64:128] == np.arange(64, 128)).all()  # the KV was not written
        assert attacker.op(False, welcome.regions[0][0]) != "DONE"  # the old agent is gone
    finally:
        attacker.close()
    again = ask(wc.producer, hello("D", os.urandom(16)))
    assert isinstance(again, Welcome) and again.agent_name == export.name
    reader = Attacker(again, lambda: wc.producer.poll(1))
    try:
        assert reader.op(False, again.regions[0][0] + 256) == "DONE"
        assert bytes(reader.buf) == bytes(kv[256:320])
    finally:
        reader.close()
    pid = export.pid
    wc.close()
    assert not Path(f"/proc/{pid}").exists()  # ended with its worker's connector
