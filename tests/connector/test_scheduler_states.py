"""Every transition of the connector's scheduler side, driven with the workers' reports
as they arrive (a fake worker: typed `KVWorkerOutput`s). Beside the real-NIXL tests
(tests/engine/test_kv_connector.py, tests/serve), never instead of them."""

from __future__ import annotations

import time

import msgspec
import pytest

from kvbridge.connector import (
    CapabilityRefused,
    ConnectorMetadata,
    ConnectorRole,
    ConnectorSpec,
    InvalidTransition,
    KVConnectorConfig,
    KVConnectorScheduler,
    KVLoadFailure,
    KVWorkerOutput,
    RemoteDecode,
    RemotePrefill,
    RequestState,
    TransferConfig,
)
from kvbridge.connector.metadata import encode, metadata_decoder, output_decoder
from kvbridge.connector.states import TRANSITIONS, check_transition
from kvbridge.transfer.connector import ConnectorEvent
from tests.credentials import enrolled

TOKEN = b"k" * 32
BS = 4
S = RequestState


def producer(world: int = 2, state_groups: frozenset[int] = frozenset()) -> KVConnectorScheduler:
    credential = enrolled(ConnectorRole.PRODUCER, "P").packed()
    spec = ConnectorSpec(ConnectorRole.PRODUCER, "P", TransferConfig(token=TOKEN), credential)
    config = KVConnectorConfig(spec, exposure_lease_s=7.0)
    sched = KVConnectorScheduler(config, BS, world, state_groups)
    sched.set_worker_endpoints(["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"][:world])
    return sched


def consumer(
    policy: KVLoadFailure = KVLoadFailure.RECOMPUTE,
    world: int = 2,
    instance_id: str = "D",
    state_groups: frozenset[int] = frozenset(),
    block_size: int = BS,
) -> KVConnectorScheduler:
    credential = enrolled(ConnectorRole.CONSUMER, instance_id).packed()
    spec = ConnectorSpec(
        ConnectorRole.CONSUMER, instance_id, TransferConfig(token=TOKEN), credential
    )
    config = KVConnectorConfig(spec, kv_load_failure=policy)
    return KVConnectorScheduler(config, block_size, world, state_groups)


def report(*events: ConnectorEvent, sending: bool) -> KVWorkerOutput:
    if sending:
        return KVWorkerOutput(finished_sending=list(events))
    return KVWorkerOutput(finished_recving=list(events))


def exposed(p: KVConnectorScheduler, rid: str = "r", start: int = 0) -> RemotePrefill:
    p.add_request(rid, list(range(10)), RemoteDecode("D", start))
    delay, params = p.request_finished(rid, [5, 6, 7], first_token_id=42, done=False)
    assert delay and isinstance(params, RemotePrefill) and params.first_token_id == 42
    return params


def test_the_table_allows_exactly_the_documented_moves() -> None:
    assert {s for s in S if s.is_final} == {S.RELEASED, S.RUNNING, S.RECOMPUTE, S.FAILED}
    assert TRANSITIONS[S.PREFILLING] == {S.EXPOSED, S.RELEASED}
    assert TRANSITIONS[S.WAITING_FOR_REMOTE_KV] == {S.RUNNING, S.RECOMPUTE, S.FAILED}
    with pytest.raises(InvalidTransition, match="'x': RELEASED -> EXPOSED is not a transition"):
        check_transition("x", S.RELEASED, S.EXPOSED)


def test_prefill_prefilling_exposed_released_frees_after_every_worker() -> None:
    p = producer()
    p.add_request("r", list(range(10)), RemoteDecode("D", start_token=4))
    assert p.state("r") is S.PREFILLING
    params = p.request_finished("r", [5, 6, 7], 42, done=False)[1]
    assert p.state("r") is S.EXPOSED
    meta = p.build_connector_meta()
    (expose,) = meta.reqs_to_send
    # the reader holds tokens [0, 4): only the blocks from the one holding token 4 on
    assert expose.block_ids == [6, 7] and expose.start_token == 4 and expose.lease_s == 7.0
    assert meta.worker_endpoints == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
    assert p.build_connector_meta().is_empty  # orders go out once
    assert p.update_connector_output([report(ConnectorEvent("r", True), sending=True)]) == []
    assert p.state("r") is S.EXPOSED  # one worker of two reported
    (ended,) = p.update_connector_output(
        [report(ConnectorEvent("r", True, cause="completed"), sending=True)]
    )
    assert ended.state is S.RELEASED and ended.block_ids == [5, 6, 7] and not p.requests
    assert p.releases == {"completed": 1}  # /metrics: kvbridge_kv_releases_total{cause}
    # the capability carries what the reader needs; a consumer takes it
    c = consumer()
    assert isinstance(params, RemotePrefill)
    rec = c.add_request("r", list(range(10)), params)
    assert rec.capability is not None and rec.capability.block_ids == [6, 7]


def test_prefill_finished_at_its_first_token_exposes_nothing() -> None:
    p = producer()
    p.add_request("r", [1, 2, 3], RemoteDecode("D"))
    assert p.request_finished("r", [1], 42, done=True) == (False, None)
    assert p.log[-1][:3] == ("r", S.PREFILLING, S.RELEASED) and not p.requests
    assert p.build_connector_meta().reqs_to_send == []


def test_failure_from_exposed_lease_or_cancel_releases_and_cancels_the_others() -> None:
    p = producer()
    exposed(p)
    assert p.cancel("r", "nobody took it") and not p.cancel("other", "x")
    assert [c.request_id for c in p.build_connector_meta().reqs_to_cancel] == ["r"]
    # one worker reports a failed release (lease expired): the other is told to cancel
    lease = ConnectorEvent("r", False, "lease expired after 7.0 s", cause="lease_expired")
    assert p.update_connector_output([report(lease, sending=True), KVWorkerOutput()]) == []
    assert [c.reason for c in p.build_connector_meta().reqs_to_cancel] == [lease.reason]
    cancelled = ConnectorEvent("r", False, "cancelled: nobody took it", cause="aborted")
    (ended,) = p.update_connector_output([report(cancelled, sending=True)])
    assert ended.state is S.RELEASED and "lease expired" in ended.reason
    assert p.releases == {"lease_expired": 1}  # the lease decided: someone never said
    # decode workers that gave up (or a cancel) on every worker: aborted
    exposed(p, "r2")
    gave_up = ConnectorEvent("r2", False, "decode workers gave up: ...", cause="aborted")
    p.update_connector_output([report(gave_up, sending=True)] * 2)
    assert p.releases == {"lease_expired": 1, "aborted": 1}


def decode_params(rid: str = "r", start: int = 0) -> RemotePrefill:
    return exposed(producer(), rid, start)


def test_decode_waiting_running_pulls_the_tokens_after_the_local_hit() -> None:
    c = consumer()
    c.add_request("r", list(range(10)), decode_params(start=4))
    assert c.state("r") is S.WAITING_FOR_REMOTE_KV
    assert c.get_num_new_matched_tokens("r", 4) == (6, True)
    c.update_state_after_alloc("r", [20, 21, 22], 6)
    (pull,) = c.build_connector_meta().reqs_to_recv
    # prefill exposed blocks [6, 7] from token 4; the decode side holds [0, 4) in 20
    assert pull.producer_block_ids == [6, 7] and pull.local_block_ids == [21, 22]
    assert pull.start_token == 4 and pull.endpoint == "tcp://127.0.0.1:1"
    assert c.has_transfers
    done = [report(ConnectorEvent("r", True, nbytes=100), sending=False)] * 2
    (ended,) = c.update_connector_output(done)
    assert ended.state is S.RUNNING and ended.nbytes == 200 and ended.first_token_id == 42
    assert ended.num_cached_tokens == 4 and not c.has_transfers and not c.requests


def test_a_request_ends_once_with_its_workers_sums_and_the_slowest_workers_time() -> None:
    """Reports arrive over several steps, for several requests at once: a request ends
    once, when its last worker reported, with its workers' bytes summed and the slowest
    worker's own time (its KV is in place when that worker finished, whenever the host
    steps); pinned blocks are the instance's sum at the last report; an event for no
    request in flight changes nothing."""
    c = consumer(world=3)
    for rid, blocks in (("a", [1, 2, 3]), ("b", [4, 5, 6])):
        c.add_request(rid, list(range(10)), decode_params(rid))
        c.get_num_new_matched_tokens(rid, 0)
        c.update_state_after_alloc(rid, blocks, 10)
    ev = ConnectorEvent
    first = [
        KVWorkerOutput([], [ev("a", True, nbytes=10, elapsed_ms=12.5)], pinned_blocks=3),
        KVWorkerOutput([], [ev("b", False, "lost contact"), ev("x", True)], pinned_blocks=3),
        KVWorkerOutput(pinned_blocks=6),
    ]
    assert c.update_connector_output(first) == [] and c.pinned_blocks == 12
    second = [
        KVWorkerOutput([], [ev("a", True, nbytes=5, elapsed_ms=40.0), ev("b", True)]),
        KVWorkerOutput([], [ev("a", True, nbytes=5, elapsed_ms=7.0)]),
        KVWorkerOutput([], [ev("b", True)]),
    ]
    a, b = sorted(c.update_connector_output(second), key=lambda r: r.request_id)
    assert (a.state, a.nbytes, a.worker_ms) == (S.RUNNING, 20, 40.0)
    assert (b.state, b.reason, b.block_ids) == (S.RECOMPUTE, "lost contact", [4, 5, 6])
    assert c.pinned_blocks == 0 and c.nbytes_total == 20 and not c.requests
    late = KVWorkerOutput([], [ev("a", True, nbytes=99)])  # reported twice: ignored
    assert c.update_connector_output([late]) == [] and c.nbytes_total == 20


@pytest.mark.parametrize("policy", list(KVLoadFailure))
def test_failure_from_waiting_follows_the_policy(policy: KVLoadFailure) -> None:
    final = S.RECOMPUTE if policy is KVLoadFailure.RECOMPUTE else S.FAILED
    # a failed pull on one worker of two
    c = consumer(policy)
    c.add_request("a", list(range(10)), decode_params("a"))
    c.get_num_new_matched_tokens("a", 0)
    c.update_state_after_alloc("a", [1, 2, 3], 10)
    lost = ConnectorEvent("a", False, "lost contact with the producer")
    (ended,) = c.update_connector_output(
        [report(lost, sending=False), report(ConnectorEvent("a", True), sending=False)]
    )
    assert ended.state is final and ended.reason == lost.reason and ended.block_ids == [1, 2, 3]
    # refused before pulling (no blocks): declined, the prefill side frees at once
    c.add_request("b", list(range(10)), decode_params("b"))
    rec = c.load_refused("b", "no free blocks to receive the KV")
    assert rec.state is final and c.build_connector_meta().reqs_to_decline[0].request_id == "b"
    # evicted since the router asked: the local hit is short of the exposed start
    c.add_request("c", list(range(10)), decode_params("c", start=8))
    assert c.get_num_new_matched_tokens("c", 4) == (0, False)
    (decline,) = c.build_connector_meta().reqs_to_decline
    assert decline.request_id == "c" and "holds 4 tokens of the prompt, fewer than the 8" in (
        decline.reason
    )
    assert c.pop_ended("c").state is final  # the caller takes the record, once
    # nothing to pull at all
    c.add_request("d", list(range(10)), RemotePrefill(42))
    assert c.get_num_new_matched_tokens("d", 0) == (0, False)
    assert c.pop_ended("d").state is final
    # a hit that is not whole blocks, or that holds the whole prompt; nothing allocated
    for rid, hit in (("e", 6), ("f", 12)):
        c.add_request(rid, list(range(10)), decode_params(rid))
        assert c.get_num_new_matched_tokens(rid, hit) == (0, False)
        assert c.pop_ended(rid).state is final
    c.add_request("g", list(range(10)), decode_params("g"))
    assert c.get_num_new_matched_tokens("g", 0) == (10, True)
    c.update_state_after_alloc("g", [1, 2, 3], 0)
    assert c.pop_ended("g").state is final
    declined = [d.request_id for d in c.build_connector_meta().reqs_to_decline]
    assert declined == ["d", "e", "f", "g"][1:]  # "d" had no capability: nobody to tell
    assert [(t.request_id, t.new) for t in c.log] == [(x, final) for x in "abcdefg"]
    assert not c.requests


def test_an_abort_while_pulling_keeps_the_blocks_until_the_pull_ends() -> None:
    c = consumer()
    c.add_request("r", list(range(10)), decode_params())
    c.get_num_new_matched_tokens("r", 0)
    c.update_state_after_alloc("r", [1, 2, 3], 10)
    assert c.request_finished("r", [1, 2, 3], None, done=True) == (True, None)
    assert c.state("r") is S.WAITING_FOR_REMOTE_KV
    ok = report(ConnectorEvent("r", True), sending=False)
    (ended,) = c.update_connector_output([ok, ok])
    assert ended.state is S.FAILED and "aborted" in ended.reason and ended.block_ids == [1, 2, 3]
    # aborted before its blocks were allocated: nothing to wait for; the prefill
    # instance is told at once (it frees its blocks before the lease)
    c.add_request("s", list(range(10)), decode_params("s"))
    assert c.request_finished("s", [], None, done=True) == (False, None)
    assert c.log[-1][:3] == ("s", S.WAITING_FOR_REMOTE_KV, S.FAILED)
    (decline,) = c.build_connector_meta().reqs_to_decline
    assert decline.request_id == "s" and "aborted before its KV was pulled" in decline.reason


def test_a_host_with_its_own_request_ids_pulls_under_the_prefill_id() -> None:
    """vLLM names a decode request anew: the capability names the prefill's id, which
    the hand-over record carries (`RemotePrefill.request_id`); the pull runs under it and
    the workers report it under the host's id (`recv_request_ids`)."""
    c = consumer()
    params = decode_params("p-1")
    c.add_request("d-9", list(range(10)), msgspec.structs.replace(params, request_id="p-1"))
    c.get_num_new_matched_tokens("d-9", 0)
    c.update_state_after_alloc("d-9", [1, 2, 3, 4], 10)  # a block past the prompt: not read
    meta = c.build_connector_meta()
    (pull,) = meta.reqs_to_recv
    assert (pull.request_id, pull.local_block_ids, meta.recv_request_ids) == (
        "p-1",
        [1, 2, 3],
        ["d-9"],
    )
    done = report(ConnectorEvent("d-9", True), sending=False)
    (ended,) = c.update_connector_output([done, done])
    assert ended.request_id == "d-9" and ended.state is S.RUNNING


def test_a_capability_issued_to_no_reader_is_taken_by_any_decode_instance() -> None:
    """A prefill request that named no reader (vLLM's proxies do not): any decode
    instance holding the token may pull it, once."""
    p = producer()
    p.add_request("r", list(range(10)), RemoteDecode(""))
    params = p.request_finished("r", [5, 6, 7], 42, done=False)[1]
    assert isinstance(params, RemotePrefill)
    other = consumer(world=1, instance_id="E")
    assert other.add_request("r", list(range(10)), params).capability is not None
    c = consumer()
    assert c.add_request("r", list(range(10)), params).capability is not None
    c.load_refused("r", "not needed")
    with pytest.raises(CapabilityRefused, match="KV capability refused"):
        c.add_request("r", list(range(10)), params)  # it opens one pull here


def test_capabilities_are_checked_on_arrival() -> None:
    params = decode_params()
    with pytest.raises(CapabilityRefused, match="it covers request 'r' with 10 tokens, not 'x'"):
        consumer().add_request("x", list(range(10)), params)
    with pytest.raises(CapabilityRefused, match="KV capability refused"):
        consumer().add_request("r", list(range(10)), RemotePrefill(42, b"forged"))
    other = consumer(world=1, instance_id="E")
    with pytest.raises(CapabilityRefused, match="KV capability refused"):
        other.add_request("r", list(range(10)), params)  # issued to D, not E
    assert not other.requests


@pytest.mark.parametrize("policy", list(KVLoadFailure))
def test_a_genuine_capability_taken_after_it_expired_is_a_failed_load(
    policy: KVLoadFailure, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode instance too busy to take a prefilled request within `claim_s`: the
    capability is its prefill's own but expired, so nothing is pulled and the request
    goes the way a failed pull goes under `kv_load_failure` (recomputed here, or
    failed), with the reason; not refused as a forgery is."""
    params = decode_params()
    late = time.time() + KVConnectorConfig.claim_s + 2
    monkeypatch.setattr("kvbridge.transfer.capability.time.time", lambda: late)
    c = consumer(policy)
    rec = c.add_request("r", list(range(10)), params)
    assert rec.capability is None and c.state("r") is S.WAITING_FOR_REMOTE_KV
    assert c.get_num_new_matched_tokens("r", 0) == (0, False)
    ended = c.pop_ended("r")
    want = S.RECOMPUTE if policy is KVLoadFailure.RECOMPUTE else S.FAILED
    assert ended.state is want
    assert "KV not pulled" in ended.reason and "expired" in ended.reason, ended.reason
    assert not c.build_connector_meta().reqs_to_recv


def test_orders_and_reports_cross_a_process_boundary_as_typed_bytes() -> None:
    p = producer()
    exposed(p)
    meta = p.build_connector_meta()
    assert metadata_decoder.decode(encode(meta)) == meta
    out = report(ConnectorEvent("r", True, "", 5), sending=True)
    assert output_decoder.decode(encode(out)) == out
    assert ConnectorMetadata().is_empty
