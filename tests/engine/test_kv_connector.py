"""The engine hosting the KV connector, with real NIXL agents: a prefill engine and a
decode engine (tp 1 each, in this process) hand requests over, and every state
transition, failures from each state included, ends with every block free on both
sides. tests/serve runs the same connector across processes at every layout/TP pair."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import torch

from kvbridge.connector import (
    ConnectorRole,
    ConnectorSpec,
    Credential,
    KVConnectorConfig,
    KVLoadFailure,
    RemoteDecode,
    RemotePrefill,
    RequestState,
    TransferConfig,
)
from kvbridge.engine import kv_host
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.errors import OutOfBlocksError
from kvbridge.engine.llm_engine import Completion, LLMEngine
from kvbridge.engine.sampling import SamplingParams
from kvbridge.engine.sequence import FinishReason
from kvbridge.engine.weights import resolve_model
from kvbridge.plan.geometry import load_model_spec
from kvbridge.transfer.capability import check, issue
from kvbridge.transfer.integrity import Integrity
from kvbridge.transfer.netdev import free_port

S = RequestState
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # 3+ blocks of 16
PARAMS = SamplingParams(max_tokens=6)
SYSTEM = (
    "You are a helpful assistant. The user asks about the geography of Europe and "
    "wants short, precise answers. Question: What is the capital of France?"
)


def make(
    role: ConnectorRole,
    instance_id: str,
    engine: EngineConfig | None = None,
    integrity: Integrity = TransferConfig.integrity,
    **kwargs: object,
) -> LLMEngine:
    # a producer that does not answer fails a handshake within a second
    transfer = TransferConfig(lease_s=30.0, handshake_timeout_s=1.0, integrity=integrity)
    spec = ConnectorSpec(role, instance_id, transfer)
    config = KVConnectorConfig(spec, claim_s=30.0, **kwargs)  # type: ignore[arg-type]
    return LLMEngine("smollm2-135m", engine or EngineConfig(num_blocks=24), connector=config)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[LLMEngine, LLMEngine]]:
    # an agent made in this process keeps UCX to the KV host's device through the
    # environment (UCX_NET_DEVICES=lo here); later tests' child processes on test hosts
    # must not inherit that
    saved = os.environ.get("UCX_NET_DEVICES")
    prefill = make(ConnectorRole.PRODUCER, "P")
    try:
        decode = make(ConnectorRole.CONSUMER, "D")
    except BaseException:
        prefill.shutdown()
        raise
    try:
        yield prefill, decode
    finally:
        decode.shutdown()
        prefill.shutdown()
        if saved is None:
            os.environ.pop("UCX_NET_DEVICES", None)
        else:
            os.environ["UCX_NET_DEVICES"] = saved


def drive(engines: list[LLMEngine], done: Callable[[], bool], timeout: float = 60.0) -> None:
    """Step and poll both engines (each owns its NIXL memory) until `done()`."""
    deadline = time.monotonic() + timeout
    while not done():
        for e in engines:
            if e.has_unfinished():
                e.step()
            e.poll_kv()
        assert time.monotonic() < deadline, "the engines did not get there in time"
        time.sleep(0.001)


def prefill_one(prefill: LLMEngine, rid: str, params: SamplingParams = PARAMS) -> Completion:
    ids = prefill.tokenizer.encode(PROMPT)
    prefill.add_request(ids, params, rid, kv_transfer_params=RemoteDecode("D"))
    assert prefill.kv_state(rid) is S.PREFILLING
    drive([prefill], lambda: prefill.is_finished(rid))
    return prefill.pop(rid)


def transitions(engine: LLMEngine, rid: str) -> list[tuple[S, S]]:
    assert engine.kv is not None
    return [(t.old, t.new) for t in engine.kv.log if t.request_id == rid]


def all_free(*engines: LLMEngine) -> bool:
    return all(
        e.block_manager.num_free_blocks == e.block_manager.num_blocks and not e.scheduler.held
        for e in engines
    )


def reference(engine: LLMEngine, params: SamplingParams = PARAMS) -> list[int]:
    ids = engine.tokenizer.encode(PROMPT)
    rid = engine.add_request(ids, params)
    drive([engine], lambda: engine.is_finished(rid))
    return engine.pop(rid).token_ids


@pytest.mark.slow
def test_prefilled_exposed_pulled_released_and_decoded(pair: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, decode = pair
    pre = prefill_one(prefill, "ok")
    assert pre.finish_reason is FinishReason.PREFILLED
    assert isinstance(pre.kv_transfer_params, RemotePrefill)
    assert prefill.kv_state("ok") is S.EXPOSED and prefill.has_request("ok")
    decode.add_request(pre.prompt_ids, PARAMS, "ok", kv_transfer_params=pre.kv_transfer_params)
    assert decode.kv_state("ok") is S.WAITING_FOR_REMOTE_KV
    drive([prefill, decode], lambda: decode.has_request("ok") and decode.is_finished("ok"))
    out = decode.pop("ok")
    drive([prefill, decode], lambda: all_free(prefill, decode))  # the release comes after
    assert out.token_ids == reference(decode) and out.kv_nbytes > 0 and out.kv_load_error is None
    assert transitions(prefill, "ok") == [(S.PREFILLING, S.EXPOSED), (S.EXPOSED, S.RELEASED)]
    assert transitions(decode, "ok") == [(S.WAITING_FOR_REMOTE_KV, S.RUNNING)]
    assert not prefill.has_request("ok")


@pytest.mark.slow
def test_the_engine_finishes_a_prefill_at_its_first_token_and_exposes_nothing(
    pair: tuple[LLMEngine, LLMEngine],
) -> None:
    prefill, _ = pair
    pre = prefill_one(prefill, "one", SamplingParams(max_tokens=1))
    assert pre.finish_reason is FinishReason.LENGTH and pre.kv_transfer_params is None
    assert transitions(prefill, "one") == [(S.PREFILLING, S.RELEASED)]
    # a stop string met by the first token's text ends it too, the text cut before it
    first = pre.text
    pre = prefill_one(prefill, "stop", SamplingParams(max_tokens=8, stop=(first[-1:],)))
    assert pre.finish_reason is FinishReason.STOP and pre.kv_transfer_params is None
    assert all_free(prefill)


@pytest.mark.slow
def test_failure_from_prefilling_and_from_exposed_frees_everything(
    pair: tuple[LLMEngine, LLMEngine],
) -> None:
    prefill, _ = pair
    ids = prefill.tokenizer.encode(PROMPT)
    prefill.add_request(ids, PARAMS, "gone", kv_transfer_params=RemoteDecode("D"))
    prefill.abort("gone")  # the caller went away while it was queued
    assert prefill.pop("gone").finish_reason is FinishReason.ABORT
    assert transitions(prefill, "gone") == [(S.PREFILLING, S.RELEASED)]
    prefill_one(prefill, "untaken")
    assert prefill.cancel_kv("untaken", "no decode instance took it")
    drive([prefill], lambda: all_free(prefill))
    assert transitions(prefill, "untaken")[-1] == (S.EXPOSED, S.RELEASED)
    assert not prefill.cancel_kv("untaken", "again")


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(KVLoadFailure))
def test_failure_from_waiting_recomputes_or_fails_by_policy(
    pair: tuple[LLMEngine, LLMEngine], policy: KVLoadFailure
) -> None:
    prefill, decode = pair
    assert decode.kv is not None
    config = decode.kv.config
    decode.kv.config = dataclasses.replace(config, kv_load_failure=policy)
    try:
        pre = prefill_one(prefill, f"lost-{policy.value}")
        rid = pre.request_id
        prefill.cancel_kv(rid, "the test took it away")
        drive([prefill], lambda: all_free(prefill))
        # the same capability, but its producer's side channel is gone (nobody listens)
        assert isinstance(pre.kv_transfer_params, RemotePrefill)
        cap = check(pre.kv_transfer_params.capability, None, "D")
        moved = msgspec.structs.replace(cap, endpoint=f"tcp://127.0.0.1:{free_port()}")
        dead = issue(moved, Credential.ephemeral(ConnectorRole.PRODUCER, "P"))  # open mode
        params = msgspec.structs.replace(pre.kv_transfer_params, capability=dead)
        decode.add_request(pre.prompt_ids, PARAMS, rid, kv_transfer_params=params)
        drive([prefill, decode], lambda: decode.is_finished(rid))
        out = decode.pop(rid)
    finally:
        decode.kv.config = config
    assert out.kv_load_error
    if policy is KVLoadFailure.RECOMPUTE:
        assert transitions(decode, rid) == [(S.WAITING_FOR_REMOTE_KV, S.RECOMPUTE)]
        assert out.token_ids == reference(decode) and out.finish_reason is FinishReason.LENGTH
    else:
        assert transitions(decode, rid) == [(S.WAITING_FOR_REMOTE_KV, S.FAILED)]
        assert out.finish_reason is FinishReason.ERROR and out.token_ids == []
        assert out.error == f"KV cache load failed: {out.kv_load_error}"
        assert "handshake" in out.kv_load_error and "timed out" in out.kv_load_error
    assert all_free(prefill, decode)


@pytest.mark.slow
def test_refused_before_pulling_declines_and_an_abort_mid_pull_waits_for_the_pull(
    pair: tuple[LLMEngine, LLMEngine],
) -> None:
    prefill, decode = pair
    # no blocks to receive it (a long request decodes in all but one): declined (the
    # prefill side frees at once), recomputed once that request gave its blocks back
    pre = prefill_one(prefill, "full")
    hog = filler(decode.block_manager.num_blocks - 1)
    decode.add_request(hog, SamplingParams(max_tokens=2, ignore_eos=True), "hog")
    drive([decode], lambda: bool(decode.scheduler.running))  # its prompt is computed
    decode.add_request(pre.prompt_ids, PARAMS, "full", kv_transfer_params=pre.kv_transfer_params)
    decode.step()
    assert transitions(decode, "full") == [(S.WAITING_FOR_REMOTE_KV, S.RECOMPUTE)]
    drive([prefill, decode], lambda: all_free(prefill))  # declined: released long before lease
    assert "no free blocks to receive the KV" in transitions_reason(prefill, "full")
    drive([decode], lambda: decode.is_finished("full"))
    assert len(decode.pop("hog").token_ids) == 2
    assert decode.pop("full").token_ids == reference(decode)
    # aborted while its pull is in flight: its blocks stay until the pull ends
    pre = prefill_one(prefill, "mid")
    decode.add_request(pre.prompt_ids, PARAMS, "mid", kv_transfer_params=pre.kv_transfer_params)
    decode.step()  # allocated, pull started
    # the worker's progress thread may finish the pull before the abort; whichever came
    # first, no block is left (the fake-transport test in tests/connector pins the order)
    in_flight = decode.kv_state("mid") is S.WAITING_FOR_REMOTE_KV
    decode.abort("mid")
    decode.pop("mid")
    if in_flight:
        assert decode.has_request("mid")  # held: the read may still write into its blocks
    drive([prefill, decode], lambda: all_free(prefill, decode))
    ended = S.FAILED if in_flight else S.RUNNING
    assert transitions(decode, "mid") == [(S.WAITING_FOR_REMOTE_KV, ended)]


def filler(num_blocks: int, first: int = 100) -> list[int]:
    """A prompt of `num_blocks` whole blocks of token ids in [first, first + 20000), which
    no prompt of text starts with (fillers of one `first` share their leading blocks)."""
    return [first + (i * 7919) % 20000 for i in range(num_blocks * 16)]


def transitions_reason(engine: LLMEngine, rid: str) -> str:
    """The reason the prefill engine's connector recorded for the request's release."""
    assert engine.kv is not None
    return " ".join(t.reason for t in engine.kv.log if t.request_id == rid)


@pytest.mark.slow
def test_blocks_the_connector_holds_refuse_a_request_that_needs_them_until_released(
    pair: tuple[LLMEngine, LLMEngine],
) -> None:
    """An exposed prefill's blocks are the connector's until its reader pulls them, the
    lease ends or `cancel_kv`: a request that needs them is refused with the numbers and
    withdrawn, and runs once they are released."""
    prefill, _ = pair
    bm = prefill.block_manager
    prefill.add_request(
        filler(bm.num_blocks - 4, 25000), PARAMS, "held", kv_transfer_params=RemoteDecode("D")
    )
    drive([prefill], lambda: prefill.is_finished("held"))
    assert prefill.pop("held").finish_reason is FinishReason.PREFILLED
    assert bm.num_free_blocks == 4 and prefill.has_request("held")
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with pytest.raises(
        OutOfBlocksError,
        match="than the 4 free of 24, and nothing running will free any; blocks the KV "
        "connector holds come back when it releases them",
    ):
        prefill.generate([PROMPT * 2], params)  # 6 blocks
    assert not prefill.has_unfinished()  # the refused request was withdrawn, not left queued
    assert prefill.cancel_kv("held", "the test gives them back")
    drive([prefill], lambda: all_free(prefill))
    assert len(prefill.generate([PROMPT * 2], params)[0].token_ids) == 2
    assert all_free(prefill)


@pytest.mark.slow
def test_a_decode_engine_keeps_its_cached_prefix_and_pulls_only_the_rest(
    pair: tuple[LLMEngine, LLMEngine], engine_factory: Callable[..., LLMEngine]
) -> None:
    """The decode engine computed a conversation's first turn; for the second the
    prefill engine exposes what follows the prefix the decode engine holds (`lookup`
    says where a pull starts), and the decode engine keeps that prefix and pulls only
    the rest: the tokens of an engine that caches nothing. Its cache is small: unrelated
    prompts then evict the conversation, the next request finds less (never a wrong
    block), and every block is free again after."""
    prefill, decode = pair
    plain = engine_factory(tp_size=1, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=8)
    first = decode.generate([SYSTEM], params)[0]
    second_ids = decode.tokenizer.encode(SYSTEM + first.text + " Question: and Spain?")
    start = decode.lookup(second_ids).kv_start_token
    bs = decode.config.block_size
    assert start >= len(first.prompt_ids) // bs * bs > 0 and start % bs == 0
    handover = RemoteDecode("D", start)
    prefill.add_request(second_ids, params, "turn", kv_transfer_params=handover)
    drive([prefill], lambda: prefill.is_finished("turn"))
    pre = prefill.pop("turn")
    decode.add_request(second_ids, params, "turn", kv_transfer_params=pre.kv_transfer_params)
    drive([prefill, decode], lambda: decode.is_finished("turn"))
    out = decode.pop("turn")
    expected = plain.generate([second_ids], params)[0].token_ids
    assert out.num_cached_tokens == start and out.token_ids == expected
    per_token = load_model_spec(resolve_model("smollm2-135m")).bytes_per_token
    assert out.kv_nbytes == (len(second_ids) - start) * per_token  # only the rest moved
    drive([prefill, decode], lambda: all_free(prefill, decode))
    evictions = decode.block_manager.num_evictions
    others = [f"Unrelated request {i} about the weather in a faraway town." * 3 for i in range(16)]
    decode.generate(others, SamplingParams(max_tokens=2))
    assert decode.block_manager.num_evictions > evictions
    assert decode.generate([second_ids], params)[0].token_ids == expected
    assert all_free(decode)


@pytest.mark.slow
def test_a_pull_slower_than_the_lease_never_decodes_from_reused_blocks(
    pair: tuple[LLMEngine, LLMEngine],
) -> None:
    """The decode engine pulls only after the prefill engine's lease released the
    blocks and a long prompt took every block (the KV there is another request's now):
    the pull is stale (the prefill worker answers its ReadDone held=False), counted, and
    the prompt recomputed: the tokens are the colocated ones."""
    prefill, decode = pair
    assert prefill.kv is not None and decode.kv is not None
    prompt = "Stale bytes must never be used, whatever the link does. " * 3
    ids = prefill.tokenizer.encode(prompt)
    config = prefill.kv.config
    prefill.kv.config = dataclasses.replace(config, exposure_lease_s=0.5)
    try:
        prefill.add_request(ids, PARAMS, "slow", kv_transfer_params=RemoteDecode("D"))
        drive([prefill], lambda: prefill.is_finished("slow"))
        pre = prefill.pop("slow")
    finally:
        prefill.kv.config = config
    drive([prefill], lambda: all_free(prefill))  # nobody came within the lease
    assert transitions(prefill, "slow")[-1] == (S.EXPOSED, S.RELEASED)
    bm = prefill.block_manager
    prefill.add_request(filler(bm.num_blocks - 1), SamplingParams(max_tokens=1), "filler")
    drive([prefill], lambda: prefill.is_finished("filler"))
    prefill.pop("filler")
    stale_before = decode.kv.pull_failures["stale"]
    decode.add_request(ids, PARAMS, "slow", kv_transfer_params=pre.kv_transfer_params)
    drive([prefill, decode], lambda: decode.is_finished("slow"))
    out = decode.pop("slow")
    assert out.kv_load_error is not None and "stale pull" in out.kv_load_error
    assert "released (lease_expired)" in out.kv_load_error
    assert decode.kv.pull_failures["stale"] == stale_before + 1
    assert transitions(decode, "slow") == [(S.WAITING_FOR_REMOTE_KV, S.RECOMPUTE)]
    rid = decode.add_request(ids, PARAMS)
    drive([decode], lambda: decode.is_finished(rid))
    assert out.token_ids == decode.pop(rid).token_ids
    drive([prefill, decode], lambda: all_free(prefill, decode))


@pytest.mark.slow
def test_a_pull_ending_within_the_wait_joins_the_running_decodes_in_the_step_that_started_it(
    pair: tuple[LLMEngine, LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request can join a batch only between steps: the step that starts a pull
    while others decode waits for it (up to a share of a decode step, here made long
    enough for any host), and the pulled request gets its second token in that same
    step, not one step later; unless recent pulls took longer than the wait allows.
    Tokens as colocated."""
    prefill, decode = pair
    monkeypatch.setattr(kv_host, "JOIN_WAIT_OF_STEP", 1e6)
    monkeypatch.setattr(kv_host, "JOIN_WAIT_MAX_S", 30.0)
    long = SamplingParams(max_tokens=12)
    first, second, third = (prefill_one(prefill, rid, long) for rid in ("run", "join", "late"))
    for pre in (first, second, third):
        assert isinstance(pre.kv_transfer_params, RemotePrefill)
    decode.add_request(first.prompt_ids, long, "run", kv_transfer_params=first.kv_transfer_params)
    drive([prefill, decode], lambda: bool(decode.scheduler.running))
    decode.step()  # "run" decodes alone: the engine knows how long a decode step takes
    decode.add_request(
        second.prompt_ids, long, "join", kv_transfer_params=second.kv_transfer_params
    )
    outputs = decode.step()  # starts the pull, waits for it, decodes both
    assert {o.request_id for o in outputs if o.new_token_ids} == {"run", "join"}
    assert transitions(decode, "join") == [(S.WAITING_FOR_REMOTE_KV, S.RUNNING)]
    # recent pulls took longer than any wait allows (a slow link): the next step that
    # starts one does not wait for it, the others decode at once
    assert decode._kv_host is not None
    decode._kv_host.pull_s.extend([60.0] * kv_host.RECENT_PULLS)
    decode.add_request(third.prompt_ids, long, "late", kv_transfer_params=third.kv_transfer_params)
    outputs = decode.step()
    assert {o.request_id for o in outputs if o.new_token_ids} == {"run", "join"}
    done = ("run", "join", "late")
    drive([prefill, decode], lambda: all(decode.is_finished(r) for r in done))
    want = reference(decode, long)
    assert [decode.pop(r).token_ids for r in done] == [want] * 3
    drive([prefill, decode], lambda: all_free(prefill, decode))


def prompt_blocks(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """The cache blocks of `ids`' full blocks (the prefix cache's), in prompt order, of
    an engine whose worker lives in this process."""
    blocks = engine.block_manager.match_prefix(ids)
    assert len(blocks) == len(ids) // engine.config.block_size > 0
    cache = engine.executor.runner.kv_cache  # type: ignore[attr-defined]
    return cache.tensor[torch.tensor(blocks)]  # BHLNC: blocks first


@pytest.mark.slow
@pytest.mark.parametrize("decode_tp", [1, 3], ids=["tp1to1", "tp1to3"])
def test_a_decode_cache_of_another_dtype_converts_the_kv_it_pulls(
    pair: tuple[LLMEngine, LLMEngine],
    engine_factory: Callable[..., LLMEngine],
    decode_tp: int,
) -> None:
    """A float32-cache prefill engine -> a bfloat16-cache decode engine: the decode
    workers read the float32 bytes into their staging (each pull checked against the
    prefill's digest of what it exposed, taken over the staging) and cast them into
    their cache before the pull is done. The tokens equal colocated generation with a bfloat16
    cache, and (tp 1) the decode cache's blocks hold exactly the colocated engine's
    bytes: both are the round-to-nearest-even bfloat16 of the same float32 K and V (a
    prompt within one prefill chunk attends to its own K/V, never the cache's)."""
    prefill, _ = pair
    engine = EngineConfig(num_blocks=24, kv_dtype="bfloat16", tp_size=decode_tp)
    decode = make(ConnectorRole.CONSUMER, f"D16-{decode_tp}", engine, Integrity.ON)
    try:
        ids = prefill.tokenizer.encode(PROMPT)
        rid = f"bf16-{decode_tp}"
        handover = RemoteDecode(f"D16-{decode_tp}")
        prefill.add_request(ids, PARAMS, rid, kv_transfer_params=handover)
        drive([prefill], lambda: prefill.is_finished(rid))
        pre = prefill.pop(rid)
        decode.add_request(ids, PARAMS, rid, kv_transfer_params=pre.kv_transfer_params)
        drive([prefill, decode], lambda: decode.is_finished(rid))
        out = decode.pop(rid)
        assert out.kv_load_error is None and decode.kv.pull_failures["integrity"] == 0
        assert transitions(decode, rid) == [(S.WAITING_FOR_REMOTE_KV, S.RUNNING)]
        per_token = load_model_spec(resolve_model("smollm2-135m")).bytes_per_token
        assert out.kv_nbytes == len(ids) * per_token  # float32 bytes crossed
        colocated = engine_factory(tp_size=decode_tp, kv_dtype="bfloat16")
        assert out.token_ids == reference(colocated)
        if decode_tp == 1:
            # the staging is the decode cache again in float32, whatever was pulled
            worker = decode.executor.connector.connector  # type: ignore[attr-defined]
            cache_bytes = decode.executor.runner.kv_cache.tensor.nbytes  # type: ignore[attr-defined]
            assert worker.consumer.staging.nbytes == 2 * cache_bytes
            got, want = prompt_blocks(decode, ids), prompt_blocks(colocated, ids)
            assert got.dtype == torch.bfloat16 and got.count_nonzero() > 0
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
            # not the float32 bytes truncated: the cast rounds
            f32 = prompt_blocks(prefill, ids)
            assert not torch.equal(got.view(torch.int16), (f32.view(torch.int32) >> 16).short())
        drive([prefill, decode], lambda: all_free(prefill, decode))
    finally:
        decode.shutdown()
