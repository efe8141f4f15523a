"""Shared fixtures: the transformers oracle (`oracle.py`) and engines, each loaded once
per package."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvbridge.engine.config import EngineConfig
from kvbridge.engine.llm_engine import LLMEngine
from tests.engine.oracle import Oracle

#: Prompts whose greedy completions the oracle tests compare.
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The quick brown fox jumps over",
    "I like to eat",
]


@pytest.fixture(scope="package")
def oracle() -> Oracle:
    return Oracle()


@pytest.fixture(scope="package")
def engine_factory() -> Iterator[Callable[..., LLMEngine]]:
    """Engines by config, kept for the session and shut down at its end."""
    engines: dict[Any, LLMEngine] = {}

    def make(**kwargs: Any) -> LLMEngine:
        key = tuple(sorted(kwargs.items()))
        if key not in engines:
            kwargs.setdefault("num_blocks", 96)
            engines[key] = LLMEngine("smollm2-135m", EngineConfig(**kwargs))
        return engines[key]

    yield make
    for e in engines.values():
        e.shutdown()


@pytest.fixture(scope="package")
def engine_tp1(engine_factory: Callable[..., LLMEngine]) -> LLMEngine:
    return engine_factory(tp_size=1)
