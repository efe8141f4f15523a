"""tests/ray: the application builder and the credential pool run anywhere; the cluster
tests start Ray and vLLM's CPU build over three test hosts and run in vLLM's
environment with Ray (`make test-ray`, .venv-vllm after `make ray-setup`), so they are
collected only where both are installed."""

from __future__ import annotations

import importlib.util

_HAS_RAY_AND_VLLM = bool(importlib.util.find_spec("ray") and importlib.util.find_spec("vllm"))
collect_ignore_glob = [] if _HAS_RAY_AND_VLLM else ["test_cluster.py"]
