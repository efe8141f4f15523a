"""LLMEngine behaviour users rely on: batching, paging, stopping, sampling, errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvbridge.engine.config import EngineConfig
from kvbridge.engine.errors import ModelLoadError, RequestError
from kvbridge.engine.llm_engine import LLMEngine
from kvbridge.engine.sampling import SamplingParams
from kvbridge.engine.sequence import FinishReason
from kvbridge.errors import KVBridgeError, LayoutError

from .conftest import PROMPTS
from .oracle import Oracle

GREEDY8 = SamplingParams(max_tokens=8)


@pytest.mark.slow
def test_batched_equals_one_at_a_time(engine_tp1: LLMEngine) -> None:
    batched = engine_tp1.generate(PROMPTS, GREEDY8)
    alone = [engine_tp1.generate([p], GREEDY8)[0] for p in PROMPTS[:3]]
    assert [o.token_ids for o in batched[:3]] == [o.token_ids for o in alone]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["BHLNC", "LBNHC", "NBHLKC"])
def test_small_blocks_chunked_prefill_and_preemption_keep_tokens(
    engine_factory: Callable[..., LLMEngine], oracle: Oracle, layout: str
) -> None:
    # 4-token blocks, 3-token prefill chunks, and a cache too small for all five
    # prompts at once: sequences get preempted and recomputed, tokens must not change.
    engine = engine_factory(
        tp_size=1, block_size=4, cache_layout=layout, prefill_chunk_size=3, num_blocks=12
    )
    outs = engine.generate(PROMPTS, GREEDY8)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == oracle.greedy(oracle.encode(prompt), 16)[:8], prompt
    assert engine.block_manager.num_free_blocks == 12


@pytest.mark.slow
def test_no_blocks_leak_after_many_requests(engine_tp1: LLMEngine) -> None:
    bm = engine_tp1.block_manager
    prompts = [f"Request number {i} says" for i in range(20)]  # more than max_num_seqs
    outs = engine_tp1.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
    assert all(len(o.token_ids) == 2 for o in outs)
    assert bm.num_free_blocks == bm.num_blocks
    assert all(bm.ref_count(i) == 0 for i in range(bm.num_blocks))


@pytest.mark.slow
def test_stop_string_cuts_text(engine_tp1: LLMEngine) -> None:
    out = engine_tp1.generate(
        ["The capital of France is"], SamplingParams(max_tokens=16, stop=(".",))
    )[0]
    assert out.text == " Paris"
    assert out.finish_reason is FinishReason.STOP


@pytest.mark.slow
def test_chat_stops_at_eos(engine_tp1: LLMEngine) -> None:
    tok = engine_tp1.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hi."}])
    out = engine_tp1.generate([prompt], SamplingParams(max_tokens=64))[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.token_ids[-1] in tok.eos_token_ids
    assert "<|im_end|>" not in out.text and out.text


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_and_batch_independent(engine_tp1: LLMEngine) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=7)
    a = engine_tp1.generate(["Once upon a time"], params)[0]
    b = engine_tp1.generate(["Once upon a time", "I like to eat"], params)[0]
    other = engine_tp1.generate(
        ["Once upon a time"], SamplingParams(max_tokens=10, temperature=0.9, seed=8)
    )[0]
    assert a.token_ids == b.token_ids
    assert other.token_ids != a.token_ids


@pytest.mark.slow
def test_tiny_temperatures_sample_greedily(engine_tp1: LLMEngine) -> None:
    """logits / 1e-300 would be inf and the probabilities NaN (a failed step)."""
    greedy = engine_tp1.generate(["Once upon a time"], GREEDY8)[0]
    for t in (1e-300, 5e-324, 1e-6):
        out = engine_tp1.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=t))
        assert out[0].token_ids == greedy.token_ids


@pytest.mark.slow
def test_stream_deltas_add_up_to_the_completion(engine_tp1: LLMEngine) -> None:
    deltas = list(engine_tp1.stream("Once upon a time", SamplingParams(max_tokens=12)))
    whole = engine_tp1.generate(["Once upon a time"], SamplingParams(max_tokens=12))[0]
    assert [t for d in deltas for t in d.new_token_ids] == whole.token_ids
    assert "".join(d.new_text for d in deltas) == whole.text
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])


@pytest.mark.slow
def test_a_prefill_only_request_ends_at_its_first_token_and_keeps_no_block(
    engine_tp1: LLMEngine, oracle: Oracle
) -> None:
    # Without a KV connector nothing is exposed (the hand-over itself, the KV decoded on
    # another engine, is test_kv_connector.py's): the first token, then every block free.
    prompt_ids = oracle.encode("The quick brown fox jumps over")
    rid = engine_tp1.add_request(prompt_ids, GREEDY8, prefill_only=True)
    while engine_tp1.has_unfinished():
        engine_tp1.step()
    pre = engine_tp1.pop(rid)
    assert pre.finish_reason is FinishReason.PREFILLED
    assert pre.token_ids == oracle.greedy(prompt_ids, 16)[:1]
    assert engine_tp1.block_manager.num_free_blocks == engine_tp1.block_manager.num_blocks


@pytest.mark.slow
def test_bad_requests_are_refused_with_reasons(engine_tp1: LLMEngine) -> None:
    with pytest.raises(RequestError, match="prompt is empty"):
        engine_tp1.add_request("")
    with pytest.raises(RequestError, match="prompt has 5000 tokens but max_model_len=4096"):
        engine_tp1.add_request([1] * 5000)
    with pytest.raises(RequestError, match=r"needs \d+ KV blocks but the cache has"):
        engine_tp1.add_request([1] * 2000)  # fits the context, not the 96-block cache
    with pytest.raises(RequestError, match="outside"):
        engine_tp1.add_request([10**6])
    # issue #21: max_tokens 2**62 ran to the context end; prompt + max_tokens must fit
    with pytest.raises(
        RequestError,
        match=r"prompt has 10 tokens and max_tokens=4611686018427387904: together .* exceed "
        r"the model's context of max_model_len=4096 tokens; ask for at most max_tokens=4086",
    ):
        engine_tp1.add_request([1] * 10, SamplingParams(max_tokens=2**62))
    assert not engine_tp1.has_unfinished()


def test_unknown_model_path_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="neither a file nor a directory nor a known name"):
        LLMEngine("/nonexistent/model.gguf")


@pytest.mark.parametrize("tp", [2, 4, 6])
def test_tp_size_invalid_for_the_model_is_refused(tp: int) -> None:
    with pytest.raises(
        LayoutError, match=f"tp_size={tp} does not divide num_attention_heads=9.*use one of 1, 3, 9"
    ):
        LLMEngine("smollm2-135m", EngineConfig(tp_size=tp))


def test_a_channel_major_cache_layout_is_refused_with_the_token_major_one() -> None:
    with pytest.raises(
        ModelLoadError, match=r"cache_layout='LBHKNC:K=CN' keeps a half channel-major.*use LBHKNC"
    ):
        EngineConfig(cache_layout="LBHKNC:K=CN")


def test_torch_threads_are_the_setting_then_omp_num_threads_then_2_at_tp_1_else_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [EngineConfig(tp_size=tp).torch_threads() for tp in (1, 3)] == [2, 1]
    for unusable in ("", "0", "two"):
        monkeypatch.setenv("OMP_NUM_THREADS", unusable)
        assert EngineConfig(tp_size=1).torch_threads() == 2, unusable
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert [EngineConfig(tp_size=tp).torch_threads() for tp in (1, 3)] == [3, 3]
    assert EngineConfig(tp_size=3, num_threads=4).torch_threads() == 4


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"max_tokens": 0}, "max_tokens=0"),
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_k": -2}, "top_k=-2"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"seed": 2**64}, r"seed=18446744073709551616 is outside \[-9223372036854775808, "),
        ({"seed": -(2**63) - 1}, "use a 64-bit seed"),
    ],
)
def test_bad_sampling_params_are_refused(kwargs: dict[str, float], words: str) -> None:
    with pytest.raises(KVBridgeError, match=words):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
