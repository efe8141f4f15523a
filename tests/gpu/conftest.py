"""tests/gpu: the device path on a real GPU (CUDA or ROCm), run by `make test-gpu` only.

Collected only with KVBRIDGE_TEST_GPU=1 (`make test-gpu` sets it), so `make test` and
`make test-vllm` neither collect nor skip them. Their modules import nothing that needs
a GPU (vLLM's GPU code, CUDA) at collection: that is done inside the tests, so they are
collected anywhere, and on a host without a GPU every test fails at its set-up, saying
so (`gpu`), instead of skipping. tests/test_gpu_suite.py checks both on the CPU hosts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

#: `make test-gpu` sets it; without it nothing here is collected
ENABLED = os.environ.get("KVBRIDGE_TEST_GPU") == "1"
collect_ignore_glob = [] if ENABLED else ["test_*.py"]
#: the message a test run here without a GPU fails with
NO_GPU = "tests/gpu need a CUDA or ROCm GPU"


@pytest.fixture(scope="session", autouse=True)
def gpu() -> Iterator[str]:
    """The torch device the tests use ("cuda:0"); fails every test without one."""
    import torch

    if not torch.cuda.is_available():
        pytest.fail(
            f"{NO_GPU}: torch {torch.__version__} sees none (torch.cuda.is_available() is "
            "False); run `make test-gpu` on a host with one",
            pytrace=False,
        )
    yield "cuda:0"
