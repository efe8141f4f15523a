"""KVBridgeConnector in vLLM's GPU build: a P/D pair sharing one GPU, token-exact.

Two vLLM instances on the same GPU (a small `--gpu-memory-utilization` each), a prefill
and a decode with different block sizes and, where FlashInfer is installed, different
attention backends (FlashAttention's KV cache layout -> FlashInfer's), vLLM's two-step
P/D request: the tokens equal colocated vLLM's at both instances' settings (the same
instances asked without kv_transfer_params, with a cache salt), and the decode worker
pulled exactly the prompt's KV bytes from the prefill's GPU cache into its own.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

#: FlashInfer as the decode's backend where it is installed, else FlashAttention again
DECODE_BACKEND = "FLASHINFER" if importlib.util.find_spec("flashinfer") else "FLASH_ATTN"
#: each instance's share of the GPU's memory (two share it)
GPU_MEMORY = "0.3"
MODEL = "smollm2-135m"
DTYPE = "float16"  # FlashAttention keeps no float32 cache


@dataclass(frozen=True)
class Case:
    prefill_backend: str
    prefill_block: int
    decode_backend: str
    decode_block: int

    @property
    def id(self) -> str:
        return (
            f"{MODEL}-b{self.prefill_block}-{self.prefill_backend}"
            f"-b{self.decode_block}-{self.decode_backend}"
        )


CASES = [
    Case("FLASH_ATTN", 32, DECODE_BACKEND, 16),  # a larger prefill block, two backends
    Case("FLASH_ATTN", 16, "FLASH_ATTN", 32),  # a smaller one
]


def gpu_args(backend: str) -> tuple[str, ...]:
    return (
        "--dtype", DTYPE, "--gpu-memory-utilization", GPU_MEMORY,
        "--attention-backend", backend,
    )  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_pd_on_one_gpu_is_token_exact(case: Case, tmp_path: Path, gpu: str) -> None:
    from kvbridge.plan.geometry import load_model_spec
    from tests.vllm.harness import MODELS, VLLMServer, pd_token_exact, text
    from tests.vllm.test_pd import MAX_TOKENS, PROMPT

    prefill = VLLMServer(
        MODEL, 1, case.prefill_block, tmp_path / "prefill.log", kv_role="kv_producer",
        vllm_args=gpu_args(case.prefill_backend),
    )  # fmt: skip
    decode = VLLMServer(
        MODEL, 1, case.decode_block, tmp_path / "decode.log", kv_role="kv_consumer",
        vllm_args=gpu_args(case.decode_backend),
    )  # fmt: skip
    try:
        out, since = pd_token_exact(prefill, decode, PROMPT, MAX_TOKENS)
        assert text(out).startswith(" Paris.")
        n = out["usage"]["prompt_tokens"]
        (pull,) = decode.pulled(since)
        assert (pull.rank, pull.start_token, pull.num_tokens) == (0, 0, n), decode.log_tail()
        assert pull.nbytes == n * load_model_spec(MODELS / MODEL).with_dtype(DTYPE).bytes_per_token
        assert decode.metric("kvbridge_failed_pulls_total") == 0
    finally:
        prefill.stop()
        decode.stop()
