"""A request of an SSM hybrid through the hand-over contract: attention layers' KV by
token, and state groups (a Mamba layer's conv and SSM state, one per request, no token
axis) whose running block moves whole. The decode recomputes the prompt's last token,
so the prefill computes, and its capability covers, the prompt less that token.
No NIXL: the scheduler sides alone (tests/vllm/test_pd.py moves an SSM hybrid between
real vLLM instances, tests/vllm/test_state_cache.py its state pages byte for byte)."""

from __future__ import annotations

import msgspec
import pytest

from kvbridge.connector import CapabilityRefused, RemoteDecode, RemotePrefill, RequestState
from kvbridge.connector.scheduler import BlockTable
from tests.connector.test_scheduler_states import BS, consumer, producer

PROMPT = list(range(10))  # blocks of 4: the prompt less its last token is [0, 9)
STATE = frozenset({1})  # group 0: attention; group 1: a Mamba layer's state
S = RequestState


def exposed() -> RemotePrefill:
    """The prefill of PROMPT: its host computed (and passes) the prompt less its last
    token; the attention group holds 3 blocks, the state group one."""
    p = producer(world=1, state_groups=STATE)
    covered = p.covered_prompt(PROMPT)
    assert covered == PROMPT[:9]
    p.add_request("r", covered, RemoteDecode("D"))
    delay, params = p.request_finished("r", [BlockTable([5, 6, 7]), BlockTable([8])], 42, False)
    assert delay and isinstance(params, RemotePrefill)
    sends = p.build_connector_meta().reqs_to_send
    # the state group's block whole: tokens [0, block_size), nothing cleared past a token
    assert [(e.request_id, e.block_ids, e.start_token, e.num_tokens) for e in sends] == [
        ("r", [5, 6, 7], 0, 9),
        ("r#g1", [8], 0, BS),
    ]
    return msgspec.structs.replace(params, request_id="r")


def test_a_decode_pulls_the_prompt_less_its_last_token_and_the_state_whole() -> None:
    params = exposed()
    c = consumer(world=1, state_groups=STATE)
    cap = c.add_request("d", PROMPT, params).capability
    assert cap is not None and cap.num_tokens == 9
    # vLLM loads 9 tokens and computes the 10th from the state after them
    assert c.get_num_new_matched_tokens("d", 0) == (9, True)
    c.update_state_after_alloc("d", [BlockTable([1, 2, 3]), BlockTable([4])], 9)
    got = [
        (x.request_id, x.producer_block_ids, x.local_block_ids, x.num_tokens, x.is_state)
        for x in c.build_connector_meta().reqs_to_recv
    ]
    assert got == [("r", [5, 6, 7], [1, 2, 3], 9, False), ("r#g1", [8], [4], BS, True)]


def test_a_decode_without_state_groups_refuses_such_a_capability() -> None:
    """The capability covers 9 tokens: a decode of another model has 10 to cover."""
    with pytest.raises(CapabilityRefused, match=r"'r' with 9 tokens, not 'r' with 10"):
        consumer(world=1).add_request("d", PROMPT, exposed())


def test_the_capability_binds_the_covered_tokens_not_their_number() -> None:
    other = [*PROMPT[:8], 99, PROMPT[9]]  # the same length, another token in the prefix
    with pytest.raises(CapabilityRefused, match=r"covers another prompt of 9 tokens"):
        consumer(world=1, state_groups=STATE).add_request("d", other, exposed())


def test_a_state_between_block_sizes_is_refused_before_any_pull() -> None:
    """A state page moves whole: both instances must page it alike."""
    c = consumer(world=1, state_groups=STATE, block_size=2 * BS)
    c.add_request("d", PROMPT, exposed())
    c.get_num_new_matched_tokens("d", 0)
    c.update_state_after_alloc("d", [BlockTable([1, 2]), BlockTable([4])], 9)
    ended = c.pop_ended("d")
    assert ended.state is S.RECOMPUTE
    assert "block_size=4 differs from this instance's 8" in ended.reason
    meta = c.build_connector_meta()
    assert not meta.reqs_to_recv and [d.request_id for d in meta.reqs_to_decline] == [
        "r",
        "r#g1",
    ]


def test_a_one_token_prompt_is_computed_by_the_decode() -> None:
    """The decode recomputes a prompt's last token: of a one-token prompt, nothing is
    left to pull (the state after it would be applied twice)."""
    p = producer(world=1, state_groups=STATE)
    p.add_request("r", p.covered_prompt([5]), RemoteDecode("D"))
    delay, params = p.request_finished("r", [BlockTable([5]), BlockTable([8])], 42, False)
    assert delay and isinstance(params, RemotePrefill)
    c = consumer(world=1, state_groups=STATE)
    c.add_request("d", [5], msgspec.structs.replace(params, request_id="r"))
    assert c.get_num_new_matched_tokens("d", 0) == (0, False)
    ended = c.pop_ended("d")
    assert ended.state is S.RECOMPUTE and "covers no token" in ended.reason
    assert [d.request_id for d in c.build_connector_meta().reqs_to_decline] == ["r", "r#g1"]
