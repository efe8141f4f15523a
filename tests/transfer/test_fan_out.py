"""The fan-out on a decode host as the runtime executes it (issue #22 item 2), over a fake
transport (real side channels, sessions and planner): decode workers holding the same
KV head read it once, one over the link, the other copying it from that worker's cache
once the reader's pull is confirmed. The bytes themselves are checked by real NIXL
agents in real processes (test_transfers.py, the serve and hosts tests)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvbridge.plan.geometry import AttentionKind, ModelKVSpec
from kvbridge.transfer.agent import XferState
from kvbridge.transfer.config import TransferConfig, is_local_endpoint
from kvbridge.transfer.consumer import KVConsumer, TransferState
from kvbridge.transfer.errors import TransferError
from kvbridge.transfer.messages import LocalReady, decode_sibling, encode, encode_sibling
from kvbridge.transfer.producer import KVProducer, ReleaseCause

from .fakes import Clock, FakeTransport, deliver
from .runtime import consumer, make_producer

#: one KV head: both decode workers (tp 2) hold it, so worker 1 copies it from worker 0
MQA = ModelKVSpec(4, 4, 1, 8, "float16", AttentionKind.GQA, "one-kv-head")
TOKEN = b"fan-out test token, 32 bytes ..."


def fake(c: KVConsumer) -> FakeTransport:
    assert isinstance(c.transport, FakeTransport)
    return c.transport


@pytest.fixture
def producer(clock: Clock):
    released: list[Any] = []
    p = make_producer(
        clock, "prefill0", "P", model=MQA, on_release=released.append, config={"token": TOKEN}
    )
    yield p, released
    p.close()


def decode_instance(clock: Clock, fan_out: str = "on", siblings: bool = True) -> list[KVConsumer]:
    cs = [consumer(rank, clock, MQA, fan_out=fan_out, token=TOKEN) for rank in range(2)]
    if siblings:
        infos = [c.sibling() for c in cs]
        for c in cs:
            c.set_siblings(infos)
    return cs


def pulling(p: KVProducer, clock: Clock, fan_out: str = "on") -> list[KVConsumer]:
    """A decode instance of two workers pulling "r1" (3 blocks) from P, exposed."""
    cs = decode_instance(clock, fan_out)
    p.expose("r1", [5, 2, 7], 48)
    for c in cs:
        c.pull("r1", p.endpoint, [5, 2, 7], [1, 6, 3], 48)
    return cs


def run(p: KVProducer, cs: list[KVConsumer], rounds: int = 20) -> list[Any]:
    """Poll everyone; NIXL's notifications between the decode workers are relayed."""
    out = []
    for _ in range(rounds):
        p.poll(timeout_ms=5)
        for c in cs:
            for peer, msg in fake(c).sent:
                if peer.startswith("decode"):
                    fake(cs[int(peer[-1])]).inbox.setdefault(c.transport.name, []).append(msg)
            fake(c).sent = [(peer, m) for peer, m in fake(c).sent if not peer.startswith("decode")]
            out += c.poll()
    return out


def test_one_worker_reads_over_the_link_and_the_other_copies_from_it(producer, clock) -> None:
    p, released = producer
    cs = decode_instance(clock)
    assert fake(cs[0]).peers == ["decode1"] and fake(cs[1]).peers == ["decode0"]
    p.expose("r1", [5, 2, 7], 48)
    for c in cs:
        c.pull("r1", p.endpoint, [5, 2, 7], [1, 6, 3], 48)
    assert run(p, cs) == []
    reader, copier = fake(cs[0]), fake(cs[1])
    assert len(reader.reads) == 1 and copier.reads == []  # only worker 0 reads from P
    reader.read_state = XferState.DONE
    assert run(p, cs) == []
    # the bytes are in worker 0's cache: worker 1 copies them at once, from its cache
    assert len(copier.reads) == 1
    local_idx, remote_idx, notif = copier.reads[0]
    assert notif == b"" and list(local_idx) == list(remote_idx)  # same blocks, same units
    copier.read_state = XferState.DONE
    assert run(p, cs) == []  # copied, but not used before P confirmed what worker 0 read
    deliver(p, reader.reads[0][2])  # worker 0's ReadDone, as NIXL delivers it
    got = {r.local_nbytes > 0: r for r in run(p, cs)}
    # the producer planned the same fan-out: worker 0's notification is all it waits for
    assert [(r.request_id, r.cause) for r in released] == [("r1", ReleaseCause.COMPLETED)]
    first, second = got[False], got[True]
    assert first.state is second.state is TransferState.DONE
    assert second.local_block_ids == (1, 6, 3) and second.nbytes == 0
    assert second.local_nbytes == first.nbytes > 0


def test_a_copy_of_bytes_the_producer_did_not_hold_is_never_used(producer, clock) -> None:
    """The fence covers the second hop: worker 1 copied what worker 0 read, but P had
    released the exposure meanwhile (its lease), so both pulls fail as stale."""
    p, _ = producer
    cs = pulling(p, clock)
    run(p, cs)
    fake(cs[0]).read_state = fake(cs[1]).read_state = XferState.DONE
    run(p, cs)
    assert len(fake(cs[1]).reads) == 1  # copied already
    p.cancel("r1", "the lease expired")
    deliver(p, fake(cs[0]).reads[0][2])
    got = run(p, cs)
    assert [r.state for r in got] == [TransferState.FAILED] * 2
    assert all("no longer held" in r.reason for r in got), [r.reason for r in got]


def test_a_reader_that_fails_fails_its_copier_at_once_with_the_reason(producer, clock) -> None:
    p, _ = producer
    cs = pulling(p, clock)
    run(p, cs)
    fake(cs[0]).read_state = XferState.ERR
    got = sorted(run(p, cs), key=lambda r: "which reads" not in r.reason)  # the copier's first
    assert [r.state for r in got] == [TransferState.FAILED] * 2
    assert "ended in ERR state" in got[1].reason
    assert "decode worker 0, which reads these bytes over the link" in got[0].reason
    assert "ERR state" in got[0].reason  # the reader's reason reaches the copier
    assert fake(cs[1]).reads == []


def test_a_notice_the_pull_has_not_reached_yet_is_kept_and_a_forged_one_ignored(
    producer, clock
) -> None:
    p, _ = producer
    cs = decode_instance(clock)
    forged = encode(LocalReady("r1", 0, 0, True), b"not the instance's key" * 2)
    fake(cs[1]).inbox["decode0"] = [forged]  # the right sender, the wrong key
    fake(cs[1]).inbox["prefill0"] = [encode(LocalReady("r1", 0, 0, True), None)]
    cs[1].poll()  # both ignored (logged)
    p.expose("r1", [5, 2, 7], 48)
    cs[0].pull("r1", p.endpoint, [5, 2, 7], [1, 6, 3], 48)
    fake(cs[0]).read_state = XferState.DONE
    for _ in range(20):
        p.poll(timeout_ms=5)
        if cs[0].poll():
            break
        if (reads := fake(cs[0]).reads) and p.num_pinned_blocks:
            deliver(p, reads[0][2])  # its ReadDone, once
    # worker 0 is done and told worker 1 (in place, then confirmed) before worker 1 got
    # its own Pull
    assert [peer for peer, _ in fake(cs[0]).sent] == ["decode1"] * 2
    fake(cs[1]).inbox["decode0"] = [msg for _, msg in fake(cs[0]).sent]
    cs[1].poll()
    cs[1].pull("r1", p.endpoint, [5, 2, 7], [1, 6, 3], 48)
    fake(cs[1]).read_state = XferState.DONE
    got = run(p, [cs[1]])
    assert [(r.request_id, r.state) for r in got] == [("r1", TransferState.DONE)]


def test_a_copier_whose_reader_never_answers_fails_at_its_timeout(producer, clock) -> None:
    p, _ = producer
    cs = decode_instance(clock)
    p.expose("r1", [5, 2, 7], 48)
    cs[1].pull("r1", p.endpoint, [5, 2, 7], [1, 6, 3], 48)  # worker 0 never pulls
    assert run(p, [cs[1]]) == []
    clock.now += 6
    (got,) = cs[1].poll()
    assert got.state is TransferState.FAILED and got.local_block_ids == (1, 6, 3)
    assert "waiting for decode worker 0" in got.reason and "LocalReady" in got.reason


@pytest.mark.parametrize("fan_out, siblings", [("off", True), ("auto", True), ("on", False)])
def test_without_fan_out_every_worker_reads_its_own_bytes(producer, clock, fan_out, siblings):
    """off; auto from a producer on this host (loopback); on, but never told its
    siblings: each decode worker reads from P, and P waits for both."""
    p, released = producer
    cs = decode_instance(clock, fan_out, siblings)
    p.expose("r1", [5, 2, 7], 48)
    for c in cs:
        c.pull("r1", p.endpoint, [5, 2, 7], [1, 6, 3], 48)
    run(p, cs)
    assert [len(fake(c).reads) for c in cs] == [1, 1]
    deliver(p, fake(cs[0]).reads[0][2])
    p.poll()
    assert released == []  # worker 1 reads too


def test_siblings_that_do_not_describe_the_instance_are_refused(clock) -> None:
    cs = decode_instance(clock, siblings=False)
    infos = [c.sibling() for c in cs]
    with pytest.raises(TransferError, match="this decode instance has 2 workers"):
        cs[0].set_siblings(infos[:1])
    other = encode_sibling(msgspec.structs.replace(decode_sibling(infos[0]), agent_name="x"))
    with pytest.raises(TransferError, match="not this worker's"):
        cs[0].set_siblings([other, infos[1]])
    cs[0].set_siblings(infos)
    cs[0].set_siblings(infos)  # the same again: nothing to do


def test_a_producer_on_another_host_is_told_apart_from_this_one() -> None:
    assert is_local_endpoint("tcp://127.0.0.1:5555") and is_local_endpoint("tcp://localhost:1")
    assert not is_local_endpoint("tcp://192.0.2.7:5555")  # TEST-NET-1: nobody's
    assert not is_local_endpoint("tcp://no-such-host.invalid:5555")
    config = TransferConfig()
    assert not config.fans_out_from("tcp://127.0.0.1:5555")
    assert config.fans_out_from("tcp://192.0.2.7:5555")
