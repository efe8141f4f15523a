"""The connector's scheduler side between instances of different block sizes (no vLLM
needed: requests are the few fields it reads). A prefill instance of block 64 exposes
exactly the prompt's tokens; a decode instance of block 32 pulls them, or only the
tokens past its prefix cache hit, from the prefill block that holds the first of them."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from kvbridge.transfer.connector import Pull
from kvbridge.vllm.scheduler import EMPTY_STEP_WAIT_S, SchedulerSide
from kvbridge.vllm.settings import ConnectorSettings

PROMPT = list(range(100, 187))  # 87 tokens: 2 prefill blocks of 64, 3 decode blocks of 32


def request(rid: str, params: dict | None) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        kv_transfer_params=params,
        num_prompt_tokens=len(PROMPT),
        prompt_token_ids=PROMPT,
        num_computed_tokens=len(PROMPT),
    )


def prefilled() -> tuple[dict, int]:
    """kv_transfer_params a block-64 prefill instance returns for PROMPT in blocks 7, 3,
    and the generation of that exposure."""
    prefill = SchedulerSide(ConnectorSettings(), "p", "kv_both", 64)
    prefill.set_endpoints(["tcp://127.0.0.1:5000"])
    delay, params = prefill.request_finished(
        request("p-1", {"do_remote_decode": True}), [7, 3], finished_ok=True
    )
    assert delay and params is not None
    (expose,) = prefill.build_orders(1).exposes
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
    decode = SchedulerSide(ConnectorSettings(), "d", "kv_both", 32)
    params, generation = prefilled()
    req = request("d-1", params)
    count, is_async = decode.num_new_matched_tokens(req, hit)
    assert (count, is_async) == (len(PROMPT) - hit, True)
    decode.after_alloc(req, [5, 9, 2], count)
    orders = decode.build_orders(1)
    assert not orders.declines
    (order,) = orders.pulls
    want = Pull("p-1", "tcp://127.0.0.1:5000", remote, local, len(PROMPT), hit)
    # the exposure's generation, carried by the capability: the prefill confirms it
    assert order.pull == msgspec.structs.replace(want, generation=generation)


def test_only_a_step_with_nothing_to_compute_lets_the_workers_wait() -> None:
    """vLLM keeps stepping while a KV transfer is in flight; in a step with no token to
    compute the workers may sleep on their transfers (up to EMPTY_STEP_WAIT_S) instead
    of returning at once, and in any other step they never wait."""
    side = SchedulerSide(ConnectorSettings(), "d", "kv_both", 32)
    assert side.build_orders(0).idle_wait_s == EMPTY_STEP_WAIT_S > 0
    assert side.build_orders(1).idle_wait_s == 0


def test_the_decode_workers_meet_each_other_in_the_first_step_only() -> None:
    """The fan-out: every decode worker's sibling entry (from vLLM's handshake metadata)
    goes to all workers once, in the next step's orders, not in every step's."""
    decode = SchedulerSide(ConnectorSettings(), "d", "kv_both", 32)
    assert decode.build_orders(1).siblings == []
    decode.set_siblings(["c2libGluZyAw", "c2libGluZyAx"])
    assert decode.build_orders(1).siblings == ["c2libGluZyAw", "c2libGluZyAx"]
    assert decode.build_orders(1).siblings == []
