"""Integrity digests over real cache memory (the transport is a fake that moves no bytes,
so the test moves them, or not): a pull is DONE only if the bytes it holds match the
producer's digest of what it exposed, across layouts that cut the same bytes
differently; a mismatch fails it with its cause. Real NIXL pulls check digests in every
test of test_transfers.py (the harness runs with integrity on)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvbridge.plan.copylist import copy_lists
from kvbridge.plan.layout import CacheLayout, InstanceLayout, cache_shape, num_regions
from kvbridge.plan.verifier import apply_copy_lists, fill_worker_cache, region_bytes
from kvbridge.transfer.agent import XferState
from kvbridge.transfer.config import TransferConfig
from kvbridge.transfer.consumer import KVConsumer, PullFailure, TransferState
from kvbridge.transfer.integrity import SAMPLE_EVERY, Integrity, is_checked
from kvbridge.transfer.producer import KVProducer
from kvbridge.transfer.pull import PullClock, PullPhases
from kvbridge.transfer.regions import CacheRegions

from .fakes import MODEL, NUM_BLOCKS, Clock, FakeTransport, deliver, drive

PREFILL = InstanceLayout(tp_size=1, block_size=16)
DECODE = InstanceLayout(tp_size=2, block_size=8, cache_layout=CacheLayout.parse("LBNHC"))


class Worker:
    """A worker's real cache (a numpy array) and its regions."""

    def __init__(self, layout: InstanceLayout, rank: int, role: str, fill: bool) -> None:
        shard = layout.workers(MODEL, role)[rank]
        self.num_regions = num_regions(MODEL, layout, shard)
        if fill:  # every block holds a distinct pattern
            self.cache = fill_worker_cache(MODEL, layout, shard, NUM_BLOCKS, [], salt=3)
        else:
            shape = cache_shape(MODEL, layout, shard, NUM_BLOCKS)
            self.cache = np.zeros(shape, dtype=np.uint16)
        self.regions = CacheRegions.from_array(self.cache, self.num_regions)

    @property
    def bytes(self) -> np.ndarray:
        return region_bytes(self.cache, self.num_regions)


@pytest.fixture
def pair(clock: Clock) -> Iterator[tuple[KVProducer, Worker, KVConsumer, Worker]]:
    pw, dw = Worker(PREFILL, 0, "prefill", True), Worker(DECODE, 1, "decode", False)
    common: dict[str, Any] = {"model": MODEL, "num_blocks": NUM_BLOCKS, "clock": clock}
    p = KVProducer(
        layout=PREFILL,
        rank=0,
        regions=pw.regions,
        transport=FakeTransport("prefill0"),
        config=TransferConfig(lease_s=10),
        instance_id="P",
        **common,
    )
    c = KVConsumer(
        layout=DECODE,
        rank=1,
        regions=dw.regions,
        transport=FakeTransport("decode1"),
        config=TransferConfig(integrity=Integrity.ON, transfer_timeout_s=5),
        instance_id="D",
        **common,
    )
    yield p, pw, c, dw
    c.close()
    p.close()


def pull(
    p: KVProducer, pw: Worker, c: KVConsumer, dw: Worker, rid: str, local: list[int], **kw: Any
) -> None:
    """Expose `rid` (prefill blocks 5, 2: 20 tokens) and pull it into `local` from token
    `start`: the READs copy what NIXL would (then `corrupt` runs, if given), are done,
    and their notification is delivered."""
    start = kw.get("start", 0)
    remote = [5, 2][start // 16 :]
    t = c.transport
    assert isinstance(t, FakeTransport)
    t.read_state = XferState.PROC
    num_reads, num_sent = len(t.reads), len(t.sent)
    p.expose(rid, [5, 2], 20, generation=4)
    c.pull(rid, p.endpoint, remote, local, 20, start, generation=4)
    drive(p, [c])
    plan = c.directory.instance(p.endpoint).plan
    assert plan is not None
    apply_copy_lists(pw.bytes, dw.bytes, copy_lists(plan, c.rank, remote, local, 20, start))
    if "corrupt" in kw:
        kw["corrupt"]()
    t.read_state = XferState.DONE
    assert drive(p, [c]) == []  # READs done; no answer yet
    # the notification rode on the READ, or followed the last of several
    (notif,) = [n for _, _, n in t.reads[num_reads:] if n] + [m for _, m in t.sent[num_sent:]]
    deliver(p, notif)


def test_the_bytes_read_are_checked_against_the_producers_digest(pair) -> None:
    p, pw, c, dw = pair
    pull(p, pw, c, dw, "good", [1, 6, 3])  # 20 tokens at block size 8
    (res,) = drive(p, [c])
    assert (res.state, res.failure) == (TransferState.DONE, None), res.reason
    # the outcome says it was checked, and where its time went: posted, read, digested
    assert res.checked
    assert res.phases.post_s > 0 and res.phases.digest_s > 0
    assert res.phases.total_s >= res.phases.post_s + res.phases.digest_s
    # a partial pull from token 8 (inside the prefill's first block) digests the same way
    pull(p, pw, c, dw, "partial", [4, 7], start=8)
    (res,) = drive(p, [c])
    assert res.state is TransferState.DONE, res.reason


def test_bytes_that_differ_from_what_was_exposed_fail_the_pull(pair) -> None:
    p, pw, c, dw = pair

    def flip() -> None:  # one bit of what was read
        r, o = (int(i[0]) for i in dw.bytes.nonzero())
        dw.bytes[r, o] ^= 1

    pull(p, pw, c, dw, "bad", [1, 6, 3], corrupt=flip)
    (res,) = drive(p, [c])
    assert (res.state, res.failure) == (TransferState.FAILED, PullFailure.INTEGRITY)
    assert "integrity check failed" in res.reason and "'bad'" in res.reason
    assert c.num_held_blocks == 0


def test_a_pulls_phases_are_the_gaps_between_the_instants_it_reached() -> None:
    clock = PullClock(pulled=1.0, posting=2.0, posted=5.0, read=6.0, digest_s=0.5)
    assert clock.phases(8.0) == PullPhases(
        queued_s=1.0, post_s=3.0, read_s=1.0, digest_s=0.5, confirm_s=1.5
    )
    # a pull that failed before it posted anything spent its time queued
    assert PullClock(pulled=1.0).phases(4.0) == PullPhases(queued_s=3.0)
    assert PullPhases(queued_s=3.0).total_s == 3.0


def test_sampling_picks_the_same_requests_everywhere_and_about_one_in_n() -> None:
    ids = [f"req-{i}" for i in range(4000)]
    picked = [i for i in ids if is_checked(Integrity.SAMPLE, i)]
    assert picked == [i for i in ids if is_checked(Integrity.SAMPLE, i)]
    assert 0.5 < len(picked) * SAMPLE_EVERY / len(ids) < 1.5
    assert all(is_checked(Integrity.ON, i) and not is_checked(Integrity.OFF, i) for i in ids)


def test_a_digest_over_tensors_equals_the_digest_over_host_memory(monkeypatch) -> None:
    """A GPU cache's digest gathers its runs with torch on the cache's device and hashes
    them a chunk at a time (`integrity.gathered`): the same bytes give the digest of the
    host path, on either side, however the chunks cut the runs (here torch tensors on
    the host: the code path a GPU runs, on its device)."""
    import torch

    from kvbridge.plan.planner import make_plan
    from kvbridge.transfer import integrity
    from kvbridge.transfer.integrity import digest, region_views

    pw, dw = Worker(PREFILL, 0, "prefill", True), Worker(DECODE, 1, "decode", False)
    lists = copy_lists(make_plan(MODEL, PREFILL, DECODE), 1, [5, 2], [1, 6, 3], 20)
    apply_copy_lists(pw.bytes, dw.bytes, lists)
    for w, side in ((pw, "src"), (dw, "dst")):
        views = region_views(w.regions)
        assert all(isinstance(v, memoryview) for v in views)  # host memory: as before
        tensors = [torch.from_numpy(np.frombuffer(v, dtype=np.uint8).copy()) for v in views]
        want = digest(views, lists, side)
        assert digest(tensors, lists, side) == want
        monkeypatch.setattr(integrity, "GATHER_BYTES", 24)  # many chunks
        assert digest(tensors, lists, side) == want
        monkeypatch.undo()
    assert digest(region_views(pw.regions), lists, "src") == digest(
        region_views(dw.regions), lists, "dst"
    )
    # one byte the pull holds (the first run's, in the decode worker's tensors), changed
    tensors[int(lists[0].dst_regions[0])][int(lists[0].dst_offsets[0])] ^= 1
    assert digest(tensors, lists, "dst") != digest(region_views(dw.regions), lists, "dst")
