"""tests/vllm: the connector's unit tests run anywhere; the end-to-end cases start vLLM's
CPU build and run in its own environment (`make test-vllm`, .venv-vllm), so they are
collected only where vLLM is installed."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = (
    []
    if importlib.util.find_spec("vllm")
    else [
        "test_pd.py",
        "test_stats.py",
        "test_hybrid_failure.py",
        "test_pd_hosts.py",
        "test_state_groups.py",
    ]
)
