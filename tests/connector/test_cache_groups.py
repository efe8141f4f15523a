"""A request of several cache groups (a hybrid model's sliding-window and full-attention
layers, each group with its own block table) through the hand-over contract: the
prefill exposes each group from the first block it still holds, the capability carries
every group, the decode pulls each group past its hit and past the first token either
side's group holds, and a worker reports the request once, when its groups all ended.
No NIXL: the scheduler sides and one worker over a fake transfer runtime
(tests/vllm/test_pd.py moves a hybrid model's groups between real vLLM instances)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvbridge.connector import (
    ConnectorMetadata,
    ConnectorRole,
    ConnectorSpec,
    KVConnectorScheduler,
    RemoteDecode,
    RemotePrefill,
    RequestState,
    TransferConfig,
)
from kvbridge.connector.scheduler import BlockTable
from kvbridge.connector.worker import KVConnectorWorker, merge_events
from kvbridge.plan.geometry import AttentionKind, ModelKVSpec
from kvbridge.plan.layout import InstanceLayout
from kvbridge.transfer.capability import transfer_id
from kvbridge.transfer.connector import (
    ConnectorEvent,
    ConnectorReply,
    ConnectorRequest,
    Expose,
    Poll,
    Pull,
)
from tests.connector.test_scheduler_states import consumer, producer, report

BS = 4
PROMPT = list(range(10))  # 10 tokens: blocks of 4 hold [0, 4), [4, 8), [8, 10)
S = RequestState


def prefill_tables() -> list[BlockTable]:
    """Full attention holds every block; the sliding window only the last (its window of
    3 tokens: vLLM frees the whole blocks of the first 10 - 3 + 1 = 8 tokens)."""
    return [BlockTable([5, 6, 7]), BlockTable([9], first_token=8)]


def exposed(start: int = 0) -> tuple[KVConnectorScheduler, RemotePrefill]:
    p = producer(world=1)
    p.add_request("r", PROMPT, RemoteDecode("D", start_token=start))
    delay, params = p.request_finished("r", prefill_tables(), 42, done=False)
    assert delay and isinstance(params, RemotePrefill)
    return p, msgspec.structs.replace(params, request_id="r")  # the decode's request "d"


def test_each_group_is_exposed_from_the_first_block_it_holds() -> None:
    p, params = exposed()
    meta = p.build_connector_meta()
    assert [(e.request_id, e.block_ids, e.start_token) for e in meta.reqs_to_send] == [
        ("r", [5, 6, 7], 0),
        ("r#g1", [9], 8),
    ]
    assert meta.send_request_ids == ["r", "r"]  # the workers report the request once
    assert len({e.generation for e in meta.reqs_to_send}) == 1  # one capability opens both
    c = consumer(world=1)
    cap = c.add_request("d", PROMPT, params).capability
    assert cap is not None and cap.block_ids == [] and cap.start_token == 0
    assert cap.tables == [BlockTable([5, 6, 7], 0), BlockTable([9], 8)]
    # released once every worker reported the request (one worker: one report)
    (ended,) = p.update_connector_output([report(ConnectorEvent("r", True), sending=True)])
    assert ended.state is S.RELEASED and ended.block_ids == [5, 6, 7, 9]


def test_a_reader_holding_a_prefix_gets_each_group_past_it() -> None:
    p, _ = exposed(start=4)
    sends = p.build_connector_meta().reqs_to_send
    assert [(e.block_ids, e.start_token) for e in sends] == [([6, 7], 4), ([9], 8)]


@pytest.mark.parametrize(
    ("hit", "local", "pulls"),
    [
        # the decode's sliding group frees as the prefill's did: each group its tokens
        (
            0,
            [BlockTable([1, 2, 3]), BlockTable([4], 8)],
            [([5, 6, 7], [1, 2, 3], 0), ([9], [4], 8)],
        ),
        # a prefix hit of one block: the full group past it, the window unchanged
        (4, [BlockTable([1, 2, 3]), BlockTable([4], 8)], [([6, 7], [2, 3], 4), ([9], [4], 8)]),
        # a decode whose sliding group holds more than the prefill's: only what both hold
        (
            0,
            [BlockTable([1, 2, 3]), BlockTable([8, 4], 4)],
            [([5, 6, 7], [1, 2, 3], 0), ([9], [4], 8)],
        ),
    ],
)
def test_each_group_is_pulled_past_the_hit_and_past_what_either_side_freed(
    hit: int, local: list[BlockTable], pulls: list[tuple[list[int], list[int], int]]
) -> None:
    _, params = exposed()
    c = consumer(world=1)
    c.add_request("d", PROMPT, params)
    assert c.get_num_new_matched_tokens("d", hit) == (10 - hit, True)
    c.update_state_after_alloc("d", local, 10 - hit)
    meta = c.build_connector_meta()
    got = [(x.producer_block_ids, x.local_block_ids, x.start_token) for x in meta.reqs_to_recv]
    assert got == pulls
    assert [x.request_id for x in meta.reqs_to_recv] == ["r", "r#g1"]
    assert meta.recv_request_ids == ["d", "d"] and c.requests["d"].num_groups == 2
    (ended,) = c.update_connector_output([report(ConnectorEvent("d", True), sending=False)])
    assert ended.state is S.RUNNING


def test_a_decode_with_other_cache_groups_declines_every_group() -> None:
    _, params = exposed()
    c = consumer(world=1)
    c.add_request("d", PROMPT, params)
    c.get_num_new_matched_tokens("d", 0)
    c.update_state_after_alloc("d", [1, 2, 3], 10)  # one block table: another model
    ended = c.pop_ended("d")
    assert ended.state is S.RECOMPUTE and "exposed 2 cache group(s), this instance has 1" in (
        ended.reason
    )
    meta = c.build_connector_meta()
    assert not meta.reqs_to_recv
    assert [d.request_id for d in meta.reqs_to_decline] == ["r", "r#g1"]


def test_a_cancel_releases_every_group() -> None:
    p, _ = exposed()
    p.build_connector_meta()
    assert p.cancel("r", "nobody took it")
    assert [c.request_id for c in p.build_connector_meta().reqs_to_cancel] == ["r", "r#g1"]


class FakeRuntime:
    """The transfer runtime's replies, as a worker sees them: orders taken, events
    handed out at the next Poll (`ends`), one order refused (`refuse`)."""

    def __init__(self, refuse: str = "") -> None:
        self.ends: list[ConnectorEvent] = []
        self.refuse = refuse
        self.progress = None

    def handle(self, request: ConnectorRequest) -> ConnectorReply:
        if isinstance(request, Expose | Pull) and request.request_id == self.refuse:
            raise RuntimeError("no such blocks")
        if isinstance(request, Poll):
            events, self.ends = self.ends, []
            return ConnectorReply(events=events)
        return ConnectorReply()

    def wait_for_events(self, timeout_s: float) -> bool:
        return False


def worker(role: ConnectorRole, runtime: Any) -> KVConnectorWorker:
    model = ModelKVSpec(2, 2, 2, 8, "float32", AttentionKind.GQA)
    spec = ConnectorSpec(role, "x", TransferConfig())
    w = KVConnectorWorker(spec, model, InstanceLayout(1, BS), 0)
    w.connector = runtime
    return w


def group_pulls(host_id: str) -> ConnectorMetadata:
    pulls = [
        Pull(transfer_id("r", g), "tcp://127.0.0.1:1", [5 + g], [1 + g], 10, 8 * g)
        for g in range(2)
    ]
    return ConnectorMetadata(reqs_to_recv=pulls, recv_request_ids=[host_id, host_id])


def test_a_worker_reports_a_request_once_its_groups_all_ended() -> None:
    rt = FakeRuntime()
    w = worker(ConnectorRole.CONSUMER, rt)
    rt.ends = [ConnectorEvent("r", True, nbytes=100, elapsed_ms=3.0)]
    out = w.execute(group_pulls("d"))
    assert out.finished_recving == []  # one group of two ended
    rt.ends = [ConnectorEvent("r#g1", True, nbytes=20, elapsed_ms=5.0, local_nbytes=4)]
    (ev,) = w.execute(ConnectorMetadata()).finished_recving
    assert (ev.request_id, ev.ok, ev.nbytes, ev.local_nbytes, ev.elapsed_ms) == (
        "d", True, 120, 4, 5.0,
    )  # fmt: skip
    assert w.get_block_ids_with_load_errors() == set()


def test_one_failed_group_fails_the_request_and_all_its_blocks() -> None:
    rt = FakeRuntime(refuse="r#g1")
    w = worker(ConnectorRole.CONSUMER, rt)
    assert w.execute(group_pulls("d")).finished_recving == []  # group 0 still in flight
    rt.ends = [ConnectorEvent("r", True, nbytes=100)]
    (ev,) = w.execute(ConnectorMetadata()).finished_recving
    assert ev.request_id == "d" and not ev.ok and "Pull failed on worker 0" in ev.reason
    assert w.get_block_ids_with_load_errors() == {1, 2}


def test_a_producer_worker_reports_the_release_once_with_the_first_cause() -> None:
    rt = FakeRuntime()
    w = worker(ConnectorRole.PRODUCER, rt)
    exposes = [Expose(transfer_id("p", g), [5 + g], 10, start_token=8 * g) for g in range(2)]
    out = w.execute(ConnectorMetadata(reqs_to_send=exposes, send_request_ids=["p", "p"]))
    assert out.finished_sending == [] and not out.error  # nothing released yet
    rt.ends = [ConnectorEvent("p", True, cause="completed")]
    assert w.execute(ConnectorMetadata()).finished_sending == []  # one group of two
    rt.ends = [ConnectorEvent("p#g1", False, "lease expired", cause="lease_expired")]
    (ev,) = w.execute(ConnectorMetadata()).finished_sending
    assert (ev.request_id, ev.ok, ev.cause, ev.reason) == (
        "p",
        False,
        "lease_expired",
        "lease expired",
    )


def test_one_group_merges_to_itself() -> None:
    ev = ConnectorEvent("r", False, "stale", 5, 1.0, "stale", 2)
    assert merge_events("d", [ev], ConnectorRole.CONSUMER) == ConnectorEvent(
        "d", False, "stale", 5, 1.0, "stale", 2
    )


def test_a_pulls_groups_merge_their_figures() -> None:
    """A request's pull over two groups: bytes, cold paths and descriptors summed, the
    longest group's time and phases, a handshake if either group waited for one."""
    fast = ConnectorEvent("r", True, "", 10, 2.0, "", 0, False, 1, 30, (0.1, 1.0))
    slow = ConnectorEvent("r#g1", True, "", 20, 5.0, "", 4, True, 0, 12, (0.2, 4.0))
    assert merge_events("d", [fast, slow], ConnectorRole.CONSUMER) == ConnectorEvent(
        "d", True, "", 30, 5.0, "", 4, True, 1, 42, (0.2, 4.0)
    )
