"""Faults with real processes and real NIXL agents: dead producers, absent consumers,
bad side-channel peers, incompatible geometries. Each failure reaches the waiter with
its reason within the configured bound; nothing hangs and no block stays held."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvbridge.harness.check import Workload, make_workload
from kvbridge.harness.cluster import Cluster, WorkerHandle
from kvbridge.harness.commands import (
    Expose,
    Finished,
    Pull,
    Released,
    Status,
    StatusReply,
    Verified,
    Verify,
)
from kvbridge.plan.geometry import AttentionKind, ModelKVSpec
from kvbridge.plan.layout import InstanceLayout
from kvbridge.transfer.messages import Hello, LayoutWire, ModelWire, Refused, decode, encode
from kvbridge.transfer.side_channel import curve_server_keys

pytestmark = pytest.mark.slow

MODEL = ModelKVSpec(3, 4, 2, 8, "float16", AttentionKind.GQA, "tiny")
TP1 = InstanceLayout(tp_size=1)
TOKEN = b"a-shared-transfer-token"


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with Cluster() as c:
        yield c


def results_by_id(c: Cluster, n: int, timeout_s: float) -> dict[str, Finished]:
    got: list[Finished] = []

    def done() -> bool:
        got.extend(c.take(Finished))
        return len(got) >= n

    assert c.wait_until(done, timeout_s), f"only {len(got)} of {n} requests reported"
    return {f.request_id: f for f in got}


def test_killed_producer_fails_its_requests_others_complete(cluster: Cluster) -> None:
    c = cluster
    work = make_workload(TP1, TP1, 8, 24, seed=3)
    opts = {"transfer_timeout_s": 4.0, "handshake_timeout_s": 2.0}
    a = c.start("prefill", MODEL, TP1, work.prefill_blocks, "A", fill=work.prefill, salt=1, **opts)
    b = c.start("prefill", MODEL, TP1, work.prefill_blocks, "B", fill=work.prefill, salt=1, **opts)
    (d,) = c.start("decode", MODEL, TP1, work.decode_blocks, "D", salt=9, **opts).workers
    source = {f"req-{i}": (a if i % 2 == 0 else b) for i in range(8)}

    def pull(i: int) -> None:
        rid, ps, ds = f"req-{i}", work.prefill[i], work.decode[i]
        if source[rid].workers[0].alive:
            source[rid].workers[0].send(Expose(rid, ps.block_ids, ps.num_tokens))
        d.send(Pull(rid, source[rid].endpoint, ps.block_ids, ds.block_ids, ds.num_tokens))

    pull(0)
    pull(1)  # both producers connected and cached
    first = results_by_id(c, 2, 30)
    assert {f.state for f in first.values()} == {"done"}
    a.workers[0].kill()
    for i in range(2, 8):
        pull(i)
    later = results_by_id(c, 6, opts["transfer_timeout_s"] + 10)
    for rid, f in later.items():
        if source[rid] is a:
            assert f.state == "failed", rid
            # named by rank while the decode worker still knew it; once its idle side
            # channel was found lost (and the producer forgotten), by its endpoint
            assert "prefill worker 0" in f.reason or a.endpoint in f.reason, f.reason
            assert "died" in f.reason or "timed out" in f.reason, f.reason
        else:
            assert f.state == "done", (rid, f.reason)
    # the decode side handed every block back, and B's requests hold the right bytes
    d.send(Status())
    assert c.expect(d, StatusReply, 10).held_blocks == 0
    done = {**first, **later}
    ok = [s for i, s in enumerate(work.decode) if done[f"req-{i}"].state == "done"]
    assert len(ok) == 5  # req-0 (read from A before the kill) and B's four
    d.send(Verify(ok))
    v = c.expect(d, Verified, 30)
    assert v.ok, v.detail


def test_producer_releases_after_the_lease_when_no_consumer_comes(cluster: Cluster) -> None:
    c = cluster
    work = make_workload(TP1, TP1, 1, 20)
    (p,) = c.start(
        "prefill", MODEL, TP1, work.prefill_blocks, "P", fill=work.prefill, lease_s=1.0
    ).workers
    span = work.prefill[0]
    p.send(Expose("orphan", span.block_ids, span.num_tokens))
    rel = c.expect(p, Released, 15)
    assert rel.request_id == "orphan" and rel.cause == "lease_expired"
    assert rel.num_blocks == len(span.block_ids)
    assert "lease expired after 1 s: no decode worker notified completion" in rel.reason
    p.send(Status())
    assert c.expect(p, StatusReply, 10).held_blocks == 0


def tcp_pair(
    c: Cluster, work: Workload, monkeypatch: pytest.MonkeyPatch, opts: dict[str, float]
) -> tuple[WorkerHandle, WorkerHandle]:
    """Prefill worker P (its cache filled with `work`) and decode worker D, tp 1 each,
    whose READs go over UCX's TCP transport: a READ then needs P to progress (with
    shared memory or CMA a reader copies alone, even from a stopped process)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    (p,) = c.start(
        "prefill", MODEL, TP1, work.prefill_blocks, "P", fill=work.prefill, **opts
    ).workers
    (d,) = c.start("decode", MODEL, TP1, work.decode_blocks, "D", salt=9, **opts).workers
    return p, d


def test_a_producer_cut_off_mid_pull_is_told_after_it_answers_again(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer that stops answering mid-pull (SIGSTOP: as its host or link going
    down looks to the decode worker) makes the pull fail with "lost contact"; it cannot
    be told then. Once it answers again and the decode worker meets it again (its next
    pull), the owed failed ReadDone reaches it: the stranded request is released as
    aborted, long before its lease."""
    c = cluster
    work = make_workload(TP1, TP1, 3, 20, seed=5)
    opts = {"liveness_timeout_s": 1.0, "handshake_timeout_s": 5.0, "lease_s": 600.0}
    p, d = tcp_pair(c, work, monkeypatch, opts)

    def expose(i: int) -> None:
        span = work.prefill[i]
        p.send(Expose(f"r{i}", span.block_ids, span.num_tokens))
        p.send(Status())
        c.expect(p, StatusReply, 10)  # taken before anything else happens

    def pull(i: int) -> None:
        ps, ds = work.prefill[i], work.decode[i]
        d.send(Pull(f"r{i}", p.endpoint, ps.block_ids, ds.block_ids, ds.num_tokens))

    expose(0)
    pull(0)  # met: the next pull needs no handshake
    assert c.expect(d, Finished, 30).state == "done"
    assert c.expect(p, Released, 10).cause == "completed"
    expose(1)
    expose(2)
    os.kill(p.pid, signal.SIGSTOP)
    try:
        pull(1)
        cut = c.expect(d, Finished, 30)
        assert cut.state == "failed" and "lost contact" in cut.reason, cut.reason
    finally:
        os.kill(p.pid, signal.SIGCONT)
    pull(2)  # meets the producer again (same instance id): the owed notice goes out
    released = {r.request_id: r for r in (c.expect(p, Released, 30), c.expect(p, Released, 30))}
    assert released["r1"].cause == "aborted", released["r1"].reason
    assert "lost contact" in released["r1"].reason
    assert released["r2"].cause == "completed"
    assert c.expect(d, Finished, 30).state == "done"


def test_a_reader_paused_past_the_lease_never_uses_what_it_read(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode worker paused (SIGSTOP) mid-pull until the producer's lease released the
    blocks, which another request then took, reads them on resume: its pull fails as
    stale (the producer answers its ReadDone held=False), never DONE, and nothing
    stays held. A pull of the new request from those blocks is confirmed and byte-exact."""
    c = cluster
    work = make_workload(TP1, TP1, 3, 20, seed=11)
    # bounds far past the pauses: only the lease decides here
    opts = {
        "liveness_timeout_s": 120.0,
        "lease_s": 600.0,
        "transfer_timeout_s": 120.0,
        "handshake_timeout_s": 120.0,
    }
    p, d = tcp_pair(c, work, monkeypatch, opts)
    warm, ds = work.prefill[2], work.decode[2]  # met: the pulls below need no handshake
    p.send(Expose("warm", warm.block_ids, warm.num_tokens))
    d.send(Pull("warm", p.endpoint, warm.block_ids, ds.block_ids, ds.num_tokens))
    assert c.expect(d, Finished, 60).state == "done"
    assert c.expect(p, Released, 30).cause == "completed"
    first = work.prefill[0]
    p.send(Expose("old", first.block_ids, first.num_tokens, generation=7, lease_s=2.0))
    p.send(Status())
    c.expect(p, StatusReply, 10)
    os.kill(p.pid, signal.SIGSTOP)  # the READ cannot finish while the producer is stopped
    try:
        ds = work.decode[0]
        d.send(Pull("old", p.endpoint, first.block_ids, ds.block_ids, ds.num_tokens, 0, 7))
        time.sleep(1.0)  # (the decode worker posts its READ meanwhile, or on resume)
        os.kill(d.pid, signal.SIGSTOP)  # paused mid-pull ...
    finally:
        os.kill(p.pid, signal.SIGCONT)
    try:
        rel = c.expect(p, Released, 30)  # ... past the producer's lease
        assert (rel.request_id, rel.cause) == ("old", "lease_expired")
        # another request takes the same blocks (a new exposure: another generation)
        p.send(Expose("new", first.block_ids, first.num_tokens, generation=8))
        p.send(Status())
        assert c.expect(p, StatusReply, 10).held_blocks == len(first.block_ids)
    finally:
        os.kill(d.pid, signal.SIGCONT)
    stale = c.expect(d, Finished, 60)
    assert (stale.request_id, stale.state, stale.failure) == ("old", "failed", "stale"), stale
    assert "no longer held 'old' (generation 7)" in stale.reason, stale.reason
    assert "lease_expired" in stale.reason, stale.reason
    d.send(Status())
    assert c.expect(d, StatusReply, 10).held_blocks == 0
    # the new exposure, read from the same blocks, is confirmed, and its bytes are right
    ds = work.decode[1]
    d.send(Pull("new", p.endpoint, first.block_ids, ds.block_ids, first.num_tokens, 0, 8))
    done = c.expect(d, Finished, 60)
    assert (done.request_id, done.state) == ("new", "done"), done.reason
    assert c.expect(p, Released, 30).cause == "completed"
    # (the stale READ did land, in blocks the engine then discards: "old"'s own)
    moved = msgspec.structs.replace(ds, num_tokens=first.num_tokens, key=first.key)
    d.send(Verify([work.decode[0], moved, work.decode[2]]))
    v = c.expect(d, Verified, 30)
    assert v.ok, v.detail


def raw_request(endpoint: str, frame: bytes, curve: bool = True) -> Refused | None:
    """Send one raw frame; the reply, or None if none came within 1.5 s. With `curve` the
    socket speaks CURVE with the token's server key (as a token holder would)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve:
        sock.curve_serverkey = curve_server_keys(TOKEN)[0]
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(endpoint)
    try:
        sock.send(frame)
        if not sock.poll(1_500):
            return None
        reply = decode(sock.recv(), TOKEN, 1 << 22)
    finally:
        sock.close()
    assert isinstance(reply, Refused)
    return reply


def test_bad_side_channel_peers_are_refused_and_good_ones_served(cluster: Cluster) -> None:
    c = cluster
    work = make_workload(TP1, TP1, 2, 20)
    (p,) = c.start(
        "prefill", MODEL, TP1, work.prefill_blocks, "P", fill=work.prefill, token=TOKEN
    ).workers
    hello = Hello(
        instance_id="x",
        rank=0,
        model=ModelWire.of(MODEL),
        layout=LayoutWire.of(TP1),
        nonce=bytes(range(16)),
    )
    # without the token's CURVE key nothing reaches the server, not even a refusal
    assert raw_request(p.endpoint, encode(hello, TOKEN), curve=False) is None
    malformed = raw_request(p.endpoint, b"\x92\xff garbage")
    assert malformed is not None and "malformed" in malformed.reason
    oversized = raw_request(p.endpoint, b"\x00" * (5 << 20))
    assert oversized is not None and "exceeds the limit" in oversized.reason
    wrong = raw_request(p.endpoint, encode(hello, b"not-the-right-token!"))
    assert wrong is not None and wrong.kind == "auth" and "wrong HMAC" in wrong.reason
    # a decode instance without the token is refused; one with it is served
    (stranger,) = c.start(
        "decode", MODEL, TP1, work.decode_blocks, "S", salt=7, handshake_timeout_s=2
    ).workers
    (good,) = c.start("decode", MODEL, TP1, work.decode_blocks, "D", salt=8, token=TOKEN).workers
    for i, w in enumerate((stranger, good)):
        ps, ds = work.prefill[i], work.decode[i]
        p.send(Expose(f"r{i}", ps.block_ids, ps.num_tokens))
        w.send(Pull(f"r{i}", p.endpoint, ps.block_ids, ds.block_ids, ds.num_tokens))
    refused = c.expect(stranger, Finished, 20)
    assert refused.state == "failed" and "handshake with" in refused.reason
    assert "timed out" in refused.reason and "token the same on both sides" in refused.reason
    served = c.expect(good, Finished, 20)
    assert served.state == "done", served.reason
    good.send(Verify([work.decode[1]]))
    assert c.expect(good, Verified, 30).ok
    p.send(Status())
    status = c.expect(p, StatusReply, 10)
    assert status.rejected == 3  # garbage, oversized, wrong HMAC; the plain peer never got in
    rel = c.expect(p, Released, 10)
    assert rel.request_id == "r1" and rel.cause == "completed"


def test_incompatible_geometry_fails_on_both_sides_with_the_planners_error(
    cluster: Cluster,
) -> None:
    c = cluster
    other = ModelKVSpec(3, 4, 2, 16, "float16", AttentionKind.GQA, "other")
    work = make_workload(TP1, TP1, 1, 20)
    (p,) = c.start("prefill", MODEL, TP1, work.prefill_blocks, "P", fill=work.prefill).workers
    (d,) = c.start("decode", other, TP1, work.decode_blocks, "D").workers
    ps, ds = work.prefill[0], work.decode[0]
    d.send(Pull("r0", p.endpoint, ps.block_ids, ds.block_ids, ds.num_tokens))
    f = c.expect(d, Finished, 20)
    words = "prefill and decode run different models: prefill head_dim=8, decode head_dim=16"
    assert f.state == "failed" and words in f.reason
    p.send(Status())
    assert any(words in r for r in c.expect(p, StatusReply, 10).refusals)
    assert msgspec.json.encode(f)  # the reason is plain data, never pickled


def test_workers_listen_on_loopback_only(cluster: Cluster) -> None:
    """UCX is kept to the device carrying the KV host (here lo): no listener of a worker
    is on another interface."""
    from tests.listening import is_loopback, listening

    work = make_workload(TP1, TP1, 1, 20)
    (p,) = cluster.start("prefill", MODEL, TP1, work.prefill_blocks, "P").workers
    (d,) = cluster.start("decode", MODEL, TP1, work.decode_blocks, "D").workers
    for w in (p, d):
        addrs = listening(w.pid)
        assert addrs, f"{w.role} worker listens on nothing?"
        assert all(is_loopback(a) for a, _ in addrs), addrs
