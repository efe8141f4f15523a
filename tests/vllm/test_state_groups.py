"""Which of vLLM's KV cache groups hold an SSM layer's state (`state_groups`), read from
vLLM's own specs, and the Mamba settings refused at start-up: a state per block of
tokens (Mamba cache mode "align", vLLM's prefix caching of SSM hybrids) and speculative
decoding's scratch blocks, where a request's running state is not its last block.
Collected where vLLM is installed (tests/vllm/conftest.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

from kvbridge.errors import ConfigError
from kvbridge.vllm.connector import state_groups


def config(**mamba: object) -> SimpleNamespace:
    """tiny-nemotron-h's KV cache groups: each Mamba layer's, then the attention layer's."""
    state = MambaSpec(
        block_size=1024, shapes=((3, 320), (8, 32, 16)), dtypes=(torch.float32,) * 2, **mamba
    )
    attention = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    groups = [
        KVCacheGroupSpec(["model.layers.0.mixer"], state),
        KVCacheGroupSpec(["model.layers.4.mixer"], state),
        KVCacheGroupSpec(["model.layers.2.mixer.attn"], attention),
    ]
    return SimpleNamespace(kv_cache_groups=groups)


def test_the_mamba_groups_are_the_state_groups() -> None:
    assert state_groups(config()) == frozenset({0, 1})  # type: ignore[arg-type]
    assert state_groups(None) == frozenset()


def test_a_state_per_block_of_tokens_is_refused_naming_the_setting() -> None:
    with pytest.raises(
        ConfigError,
        match=r"mamba_cache_mode='align' \(KV cache group 0: model.layers.0.mixer\) .* use "
        r"--no-enable-prefix-caching",
    ):
        state_groups(config(mamba_cache_mode="align"))  # type: ignore[arg-type]


def test_speculative_scratch_blocks_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"num_speculative_blocks=2 scratch blocks"):
        state_groups(config(num_speculative_blocks=2))  # type: ignore[arg-type]
