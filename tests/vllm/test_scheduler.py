"""The connector's scheduler side in vLLM between instances of different block sizes (no
vLLM needed: requests are the few fields it reads). A prefill instance of block 64
exposes exactly the prompt's tokens; a decode instance of block 32 pulls them, or only
the tokens past its prefix cache hit, from the prefill block that holds the first of
them. The request states themselves are the hand-over contract's
(tests/connector/test_hosts.py drives both hosts through them)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from kvbridge.connector import ConnectorRole, RequestState
from kvbridge.connector.metadata import CAPABILITY_KEY, KVWorkerOutput
from kvbridge.connector.scheduler import BlockTable
from kvbridge.connector.settings import ConnectorSettings
from kvbridge.transfer.connector import ConnectorEvent, Pull
from kvbridge.vllm.scheduler import EMPTY_STEP_WAIT_S, SchedulerSide, group_tables
from kvbridge.vllm.settings import ROLES

PROMPT = list(range(100, 187))  # 87 tokens: 2 prefill blocks of 64, 3 decode blocks of 32
P, C = ConnectorRole.PRODUCER, ConnectorRole.CONSUMER


def request(rid: str, params: dict | None) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        kv_transfer_params=params,
        num_prompt_tokens=len(PROMPT),
        prompt_token_ids=PROMPT,
        num_computed_tokens=len(PROMPT),
        output_token_ids=[7],
    )


def side(name: str, block_size: int) -> SchedulerSide:
    out = SchedulerSide(ConnectorSettings().configs(name, ROLES["kv_both"]), block_size, 1)
    out.set_worker_endpoints(["tcp://127.0.0.1:5000"], ["c2libGluZyAw"])
    return out


def prefilled(rid: str = "p-1") -> tuple[dict, int]:
    """kv_transfer_params a block-64 prefill instance returns for PROMPT in blocks 7, 3,
    and the generation of that exposure."""
    prefill = side("p", 64)
    req = request(rid, {"do_remote_decode": True})
    prefill.on_new_request(req)
    delay, params = prefill.request_finished(req, ([7, 3, 11],), finished_ok=True)
    assert delay and params is not None and params["remote_request_id"] == rid
    (expose,) = prefill.build_orders(1)[0][P].reqs_to_send
    assert (expose.block_ids, expose.num_tokens) == ([7, 3], len(PROMPT))  # not 128
    return params, expose.generation


@pytest.mark.parametrize(
    ("hit", "remote", "local"),
    [
        (0, [7, 3], [5, 9, 2]),
        (32, [7, 3], [9, 2]),  # starts inside prefill block 0
        (64, [3], [2]),
    ],
)
def test_a_smaller_decode_block_pulls_the_prompt_past_its_hit(hit, remote, local) -> None:
    decode = side("d", 32)
    params, generation = prefilled()
    req = request("d-1", params)
    decode.on_new_request(req)
    count, is_async = decode.num_new_matched_tokens(req, hit)
    assert (count, is_async) == (len(PROMPT) - hit, True)
    decode.after_alloc(req, ([5, 9, 2, 4],), count)  # a block past the prompt is not read
    orders = decode.build_orders(1)[0][C]
    assert not orders.reqs_to_decline
    (pull,) = orders.reqs_to_recv
    # the pull names the prefill's request; the workers report it under vLLM's id here
    assert orders.recv_request_ids == ["d-1"]
    want = Pull("p-1", "tcp://127.0.0.1:5000", remote, local, len(PROMPT), hit)
    # the exposure's generation, carried by the capability: the prefill confirms it
    assert pull == msgspec.structs.replace(want, generation=generation)
    assert req.kv_transfer_params["do_remote_prefill"] is False  # one pull per request


def test_a_refused_capability_is_computed_here() -> None:
    """A forged capability pulls nothing and holds nothing: vLLM computes the prompt."""
    decode = side("d", 32)
    params, _ = prefilled()
    params[CAPABILITY_KEY] = params[CAPABILITY_KEY][:-8] + "AAAAAAA="
    req = request("d-1", params)
    decode.on_new_request(req)
    assert decode.num_new_matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params["do_remote_prefill"] is False
    assert not decode.consumer.requests and not decode.build_orders(1)[0][C].reqs_to_recv


def test_only_a_step_with_nothing_to_compute_lets_the_workers_wait() -> None:
    """vLLM keeps stepping while a KV transfer is in flight; in a step with no token to
    compute the workers may sleep on their transfers (up to EMPTY_STEP_WAIT_S) instead
    of returning at once, and in any other step they never wait."""
    decode = side("d", 32)
    assert decode.build_orders(0)[0][C].idle_wait_s == EMPTY_STEP_WAIT_S > 0
    assert decode.build_orders(1)[0][C].idle_wait_s == 0


def test_the_instance_workers_meet_each_other_in_the_first_step_only() -> None:
    """The fan-out: every decode worker's sibling entry (from vLLM's handshake metadata)
    goes to all workers once, in the next step's orders, and so do the prefill workers'
    endpoints."""
    decode = side("d", 32)
    first = decode.build_orders(1)[0]
    assert first[C].siblings == ["c2libGluZyAw"]
    assert first[P].worker_endpoints == ["tcp://127.0.0.1:5000"]
    second = decode.build_orders(1)[0]
    assert second[C].siblings is None and second[P].worker_endpoints is None


def test_a_hybrid_models_groups_start_past_the_blocks_vllm_freed() -> None:
    """vLLM's sliding-window groups lead their block tables with its null block (0)
    where the window freed a block: a group's table starts at the first block it holds.
    The prefill exposes each group from there, the decode pulls each past what either
    side freed (87 tokens, window 32: vLLM frees the first block of 32 on both sides)."""
    assert group_tables([[0, 0, 4, 5], [1, 2]], 32) == [
        BlockTable([4, 5], 64),
        BlockTable([1, 2], 0),
    ]
    prefill = side("p", 32)
    req = request("p-1", {"do_remote_decode": True})
    prefill.on_new_request(req)
    _, params = prefill.request_finished(req, ([0, 3, 11], [7, 8, 9]), finished_ok=True)
    sends = prefill.build_orders(1)[0][P].reqs_to_send
    assert [(e.request_id, e.block_ids, e.start_token) for e in sends] == [
        ("p-1", [3, 11], 32),
        ("p-1#g1", [7, 8, 9], 0),
    ]
    decode = side("d", 32)
    req = request("d-1", params)
    decode.on_new_request(req)
    count, _ = decode.num_new_matched_tokens(req, 0)
    decode.after_alloc(req, ([0, 12, 13, 14], [15, 16, 17, 18]), count)
    pulls = decode.build_orders(1)[0][C].reqs_to_recv
    assert [(p.producer_block_ids, p.local_block_ids, p.start_token) for p in pulls] == [
        ([3, 11], [12, 13], 32),
        ([7, 8, 9], [15, 16, 17], 0),
    ]


def test_a_pull_from_a_producer_pulled_from_before_goes_in_step() -> None:
    """The first pull from a producer is asynchronous (its handshake may take seconds);
    once one has put its KV in place, the next ones load in step: vLLM is told the
    prompt but its last token loads synchronously (it computes that token in the step
    that allocated the blocks, and samples the first token there), while the pull
    still brings the whole prompt and the workers finish it before that step's forward."""
    decode = side("d", 32)
    params, _ = prefilled("p-1")
    first = request("d-1", params)
    decode.on_new_request(first)
    assert decode.num_new_matched_tokens(first, 0) == (len(PROMPT), True)
    decode.after_alloc(first, ([5, 9, 2],), len(PROMPT))
    orders, in_step = decode.build_orders(0)
    assert in_step == [] and orders[C].recv_request_ids == ["d-1"]
    done = ConnectorEvent("d-1", True, nbytes=1)  # the worker's report, under vLLM's id
    (ended,) = decode.update_connector_output({C: [KVWorkerOutput(finished_recving=[done])]})
    assert ended.state is RequestState.RUNNING and decode.met == {"tcp://127.0.0.1:5000"}

    params, _ = prefilled("p-2")
    second = request("d-2", params)
    decode.on_new_request(second)
    assert decode.num_new_matched_tokens(second, 0) == (len(PROMPT) - 1, False)
    decode.after_alloc(second, ([4, 6, 8],), len(PROMPT) - 1)
    orders, in_step = decode.build_orders(1)
    assert in_step == ["d-2"]
    (pull,) = orders[C].reqs_to_recv
    assert (pull.local_block_ids, pull.num_tokens, pull.start_token) == ([4, 6, 8], 87, 0)
    assert decode.build_orders(1)[1] == []  # in step once


def test_an_in_step_request_aborted_before_its_blocks_is_forgotten() -> None:
    decode = side("d", 32)
    decode.met.add("tcp://127.0.0.1:5000")
    params, _ = prefilled()
    req = request("d-1", params)
    decode.on_new_request(req)
    assert decode.num_new_matched_tokens(req, 0) == (len(PROMPT) - 1, False)
    decode.request_finished(req, ((),), finished_ok=False)
    assert not decode.in_step and not decode.consumer.requests


def vllm_prefill_request(rid: str) -> Any:
    """vLLM's own Request where vLLM is installed (the adapter edits its prompt), else the
    attributes the adapter reads and edits."""
    params = {"do_remote_decode": True}
    if importlib.util.find_spec("vllm") is None:
        return SimpleNamespace(
            request_id=rid,
            kv_transfer_params=params,
            prompt_token_ids=list(PROMPT),
            _all_token_ids=list(PROMPT),
            num_prompt_tokens=len(PROMPT),
            num_computed_tokens=0,
            output_token_ids=[],
            num_tokens=len(PROMPT),
        )
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    return Request(rid, list(PROMPT), sampling, None)


def test_a_prefill_with_state_groups_computes_the_prompt_less_its_last_token() -> None:
    """A prefill instance of an SSM hybrid (state group 1) drops the prompt's last token
    before vLLM schedules it, and exposes those tokens (the decode computes the last one
    from the state after them) and the state group's block whole."""
    configs = ConnectorSettings().configs("p", ROLES["kv_both"])
    prefill = SchedulerSide(configs, 32, 1, state_groups=frozenset({1}))
    prefill.set_worker_endpoints(["tcp://127.0.0.1:5000"], ["c2libGluZyAw"])
    req = vllm_prefill_request("p-1")
    prefill.on_new_request(req)
    assert req.prompt_token_ids == PROMPT[:-1] and req.num_prompt_tokens == len(PROMPT) - 1
    assert req._all_token_ids == PROMPT[:-1]  # vLLM's request: num_tokens follows it
    req.num_computed_tokens = req.num_prompt_tokens
    if isinstance(req, SimpleNamespace):  # its first token sampled
        req.output_token_ids = [7]
    else:
        req.append_output_token_ids(7)
    delay, out = prefill.request_finished(req, ([7, 3, 11], [5]), finished_ok=True)
    assert delay and out is not None
    sends = prefill.build_orders(1)[0][P].reqs_to_send
    assert [(e.block_ids, e.num_tokens) for e in sends] == [([7, 3, 11], 86), ([5], 32)]
