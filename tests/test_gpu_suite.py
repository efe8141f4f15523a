"""`make test-gpu`'s tests (tests/gpu) as a host without a GPU sees them: collected only
when asked (KVBRIDGE_TEST_GPU=1), then every case the GPU run makes, imported without
vLLM's GPU build or CUDA; run here, each fails at once saying it needs a GPU (none is
skipped). In whichever environment runs it (.venv, .venv-vllm)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: pytest's exit status for a run that collected nothing
NO_TESTS = 5


def pytest_in_subprocess(*args: str, gpu_tests: bool) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("KVBRIDGE_TEST_GPU", None)
    if gpu_tests:
        env["KVBRIDGE_TEST_GPU"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_gpu_tests_are_collected_only_when_asked_for() -> None:
    plain = pytest_in_subprocess("--collect-only", "tests/gpu", gpu_tests=False)
    assert plain.returncode == NO_TESTS, plain.stdout + plain.stderr
    asked = pytest_in_subprocess("--collect-only", "tests/gpu", gpu_tests=True)
    assert asked.returncode == 0, asked.stdout + asked.stderr
    ids = {line for line in asked.stdout.splitlines() if "::" in line}
    layouts = "tests/gpu/test_device_caches.py::test_"
    pd = "tests/gpu/test_pd_gpu.py::test_pd_on_one_gpu_is_token_exact"
    elements = f"{layouts}each_element_of_a_gpu_cache_lies_where_the_connector_says"
    # the table's GPU rows: FlashAttention under each of the 6 layouts, FlashInfer's 2,
    # FlashMLA's 6 (vLLM's CPU kernels write host memory only: not here)
    assert sum(i.startswith(elements) for i in ids) == 14
    assert f"{elements}[FLASHINFER-LBHNC]" in ids
    assert not any("CPU_ATTN" in i or "CPU_MLA" in i for i in ids)
    assert sum(i.startswith(f"{layouts}each_layout_moves_byte_exact_between_gpu") for i in ids) == 7
    assert f"{layouts}a_fan_out_copies_between_the_decode_workers_gpu_caches" in ids
    assert f"{layouts}a_dtype_conversion_into_a_gpu_cache_fails_the_pull_naming_why" in ids
    backend = "FLASHINFER" if _has("flashinfer") else "FLASH_ATTN"
    assert f"{pd}[smollm2-135m-b32-FLASH_ATTN-b16-{backend}]" in ids
    assert f"{pd}[smollm2-135m-b16-FLASH_ATTN-b32-FLASH_ATTN]" in ids


def test_without_a_gpu_each_gpu_test_fails_saying_so() -> None:
    run = pytest_in_subprocess(
        "tests/gpu/test_device_caches.py", "-k", "registers_as_vram", gpu_tests=True
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "tests/gpu need a CUDA or ROCm GPU" in run.stdout and "1 error" in run.stdout
    assert "skipped" not in run.stdout


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
