"""tests/ray: the application builder and the credential pool run anywhere; the cluster
tests start Ray and vLLM's CPU build over test hosts and run in vLLM's environment with
Ray (`make test-ray`, .venv-vllm after `make ray-setup`), so they are collected only
where both are installed. Each cluster module names its cluster's settings in
`CLUSTER` (`ClusterConfig` fields besides the model) and gets one `cluster` for its
tests."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_HAS_RAY_AND_VLLM = bool(importlib.util.find_spec("ray") and importlib.util.find_spec("vllm"))
collect_ignore_glob = [] if _HAS_RAY_AND_VLLM else ["test_cluster.py", "test_scale_out.py"]


@pytest.fixture(scope="module")
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """A Ray cluster over test hosts running the P/D application (`RayCluster`), with the
    module's `CLUSTER` settings; stopped after the module, whatever its tests did."""
    from kvbridge.harness.hosts import missing
    from kvbridge.ray.cluster import ClusterConfig, RayCluster
    from kvbridge.settings import DEFAULT_MODEL
    from kvbridge.vllm.models import DEFAULT_DIR, make

    reason = missing()
    if reason:
        pytest.fail(f"the Ray cluster tests need test hosts: {reason}")
    model = str(make(DEFAULT_MODEL, DEFAULT_DIR).resolve())
    cfg = ClusterConfig(model, **request.module.CLUSTER)
    with RayCluster(cfg, Path(tmp_path_factory.mktemp("ray"))) as c:
        yield c
