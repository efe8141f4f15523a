"""The safetensors-directory loader: small random llama (untied embeddings) and qwen2 (qkv
bias) models saved by transformers give transformers' greedy tokens, at tp 1 and tp 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.engine.config import EngineConfig
from kvbridge.engine.llm_engine import LLMEngine
from kvbridge.engine.sampling import SamplingParams
from tests.engine.helpers import PROMPTS, save_model

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_directory_matches_transformers(tmp_path: Path, kind: str) -> None:
    expected = save_model(kind, tmp_path)
    for tp in (1, 2):
        with LLMEngine(str(tmp_path), EngineConfig(tp_size=tp, num_blocks=16)) as engine:
            assert engine.model_config.attention_bias is (kind == "qwen2")
            assert not engine.model_config.tie_word_embeddings
            outs = engine.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
            assert [o.token_ids for o in outs] == expected, f"tp {tp}"
