"""The engine gives exactly transformers' greedy tokens for the same GGUF, at tp 1, 3 and 9,
on the cross-layer (BHLNC, the default), BLHNC and per-layer (LBHNC) cache layouts."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvbridge.engine.config import EngineConfig
from kvbridge.engine.llm_engine import LLMEngine
from kvbridge.engine.sampling import SamplingParams
from kvbridge.engine.tokenizer import Tokenizer
from kvbridge.engine.weights import resolve_model

from .conftest import PROMPTS
from .oracle import Oracle

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "Ünïcödé: naïve café, 日本語, emoji 🙂👍🏽, math ∑ x²",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "def f(x):\n    return x ** 2  # comment",
    "1234567890 3.14159 -42 1e-9",
]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_gives_transformers_ids(oracle: Oracle, text: str) -> None:
    tok = Tokenizer.load(resolve_model("smollm2-135m"))
    ids = tok.encode(text)
    assert ids == oracle.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == oracle.tokenizer.decode(ids)


def test_chat_template_matches_transformers(oracle: Oracle) -> None:
    tok = Tokenizer.load(resolve_model("smollm2-135m"))
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = tok.apply_chat_template(messages)
    expected = oracle.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert text == expected
    assert tok.encode(text) == oracle.encode(expected)


def _check(engine: LLMEngine, oracle: Oracle, prompts: list[str], n: int) -> None:
    outs = engine.generate(prompts, SamplingParams(max_tokens=n))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_ids == oracle.encode(prompt)
        assert out.token_ids == oracle.greedy(out.prompt_ids, n), prompt


def test_tp1_greedy_equals_transformers(engine_tp1: LLMEngine, oracle: Oracle) -> None:
    _check(engine_tp1, oracle, PROMPTS, 16)


def test_capital_of_france_is_paris(engine_tp1: LLMEngine) -> None:
    out = engine_tp1.generate(["The capital of France is"], SamplingParams(max_tokens=4))[0]
    assert out.text.startswith(" Paris")


def test_tp3_greedy_equals_transformers(
    engine_factory: Callable[..., LLMEngine], oracle: Oracle
) -> None:
    engine = engine_factory(tp_size=3)
    _check(engine, oracle, PROMPTS, 16)
    assert engine.executor.info.num_local_kv_heads == 1


def test_tp9_greedy_equals_transformers(
    engine_factory: Callable[..., LLMEngine], oracle: Oracle
) -> None:
    engine = engine_factory(tp_size=9, num_blocks=16)
    _check(engine, oracle, PROMPTS[:2], 16)
    engine.shutdown()


#: Each other layout at tp 1 and 3; at tp 9 (one KV head per rank, as at tp 3) the
#: per-layer one only: a tp-9 engine costs nine worker starts on two cores.
OTHER_LAYOUTS = [(1, "BLHNC"), (1, "LBHNC"), (3, "BLHNC"), (3, "LBHNC"), (9, "LBHNC")]


@pytest.mark.parametrize(
    "tp_size, layout", OTHER_LAYOUTS, ids=[f"{name}-{tp}" for tp, name in OTHER_LAYOUTS]
)
def test_other_cache_layouts_greedy_equal_transformers(
    oracle: Oracle, tp_size: int, layout: str
) -> None:
    """The default BHLNC is checked above; the cache's axis order must not change a token."""
    engine = LLMEngine(
        "smollm2-135m", EngineConfig(tp_size=tp_size, cache_layout=layout, num_blocks=16)
    )
    try:
        assert engine.config.cache_layout.name == layout
        _check(engine, oracle, PROMPTS[1:2], 12)
    finally:
        engine.shutdown()
