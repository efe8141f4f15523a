"""A model's KV-cache geometry: what one token leaves behind in every layer.

`ModelKVSpec` is built from a model's configuration in config.json's keys, as
`model_config` reads it from a `config.json` or a GGUF header (`from_hf_config`,
`from_gguf`, `load_model_spec`). It knows nothing of parallelism: how the heads
and layers are split over workers is `layout.py`'s business.

For MLA models (DeepSeek V2/V3) the cache holds one latent vector per token and
layer (`kv_lora_rank + qk_rope_head_dim` elements), which we model as a single
logical KV head that every tensor-parallel worker holds whole.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.plan.model_config import ConfigFile, read_config, read_gguf_config, read_hf_config


class AttentionKind(enum.Enum):
    MHA = "mha"  # one KV head per query head
    GQA = "gqa"  # groups of query heads share a KV head
    MQA = "mqa"  # a single KV head
    MLA = "mla"  # a compressed latent per token (DeepSeek), one logical head


#: KV-cache element types, by name, with their size in bytes.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def normalize_dtype(name: object, *, field: str = "dtype", source: str = "") -> str:
    """Return the canonical dtype name for `name` or raise naming the accepted ones."""
    if isinstance(name, str):
        key = name.removeprefix("torch.").lower()
        key = _DTYPE_ALIASES.get(key, key)
        if key in DTYPE_SIZES:
            return key
    where = f" in {source}" if source else ""
    raise ConfigError(
        f"{field}={name!r}{where} is not a KV-cache dtype; use one of {', '.join(DTYPE_SIZES)}"
    )


@dataclass(frozen=True)
class ModelKVSpec:
    """The KV-cache geometry of one model, independent of how it is parallelized.

    Attributes:
        num_layers: decoder layers that keep a KV cache.
        num_attention_heads: query heads (tp_size must divide it).
        num_kv_heads: KV heads; 1 for MQA and for MLA's single latent.
        head_dim: elements per head in one K or V entry; for MLA the latent width.
        dtype: canonical name of the cache element type (see DTYPE_SIZES).
        attention: the attention kind.
        name: where the spec came from, for error messages.
    """

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    attention: AttentionKind
    name: str = "model"

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim"):
            _require_positive_int(field, getattr(self, field), self.name)
        normalize_dtype(self.dtype, source=self.name)
        if self.attention is AttentionKind.MLA:
            if self.num_kv_heads != 1:
                raise ConfigError(
                    f"num_kv_heads={self.num_kv_heads} for MLA model {self.name}; "
                    "an MLA cache is one latent per token, use num_kv_heads=1"
                )
        elif self.num_attention_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads} in {self.name}; GQA needs whole groups"
            )

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def is_mla(self) -> bool:
        return self.attention is AttentionKind.MLA

    @property
    def num_kv_tensors(self) -> int:
        """Cache tensors per layer: K and V, or MLA's single latent."""
        return 1 if self.is_mla else 2

    @property
    def head_bytes(self) -> int:
        """Bytes of one head's entry for one token in one cache tensor."""
        return self.head_dim * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token occupies over all layers and heads (K and V)."""
        return self.num_layers * self.num_kv_tensors * self.num_kv_heads * self.head_bytes

    def with_dtype(self, dtype: str) -> ModelKVSpec:
        """The same geometry with another cache dtype (e.g. an fp8 KV cache)."""
        return ModelKVSpec(
            num_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=normalize_dtype(dtype),
            attention=self.attention,
            name=self.name,
        )

    def describe(self) -> str:
        return (
            f"{self.name}: {self.num_layers} layers, {self.num_attention_heads} query heads, "
            f"{self.num_kv_heads} KV heads ({self.attention.value}), head_dim {self.head_dim}, "
            f"{self.dtype}"
        )


def _require_positive_int(field: str, value: object, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer() and value > 0:
            return int(value)
        raise ConfigError(f"{field}={value!r} in {source} must be a positive integer")
    if value <= 0:
        raise ConfigError(f"{field}={value} in {source} must be a positive integer")
    return value


def _get_int(cfg: ConfigFile, keys: tuple[str, ...]) -> int:
    """The first of `keys` present in `cfg`, checked to be a positive integer."""
    for key in keys:
        if cfg.fields.get(key) is not None:
            return _require_positive_int(cfg.key(key), cfg.fields[key], cfg.source)
    names = [cfg.key(k) for k in keys]
    raise ConfigError(
        f"{names[0]} is missing from {cfg.source}"
        + (f" (also looked for {', '.join(names[1:])})" if len(names) > 1 else "")
    )


def from_hf_config(
    config: Mapping[str, Any] | str | Path | ConfigFile,
    *,
    dtype: str | None = None,
    name: str | None = None,
) -> ModelKVSpec:
    """Build the spec from a model configuration in config.json's keys: a `ConfigFile`
    (`model_config.read_config`, any format), a `config.json` path or the parsed dict.

    Handles llama, mistral, qwen2/qwen3(-moe), gemma2/gemma3 (`text_config` nesting),
    phi3, gpt_oss, deepseek_v2/v3 (MLA) and falcon/gpt_bigcode-style `multi_query`.
    `dtype` overrides the config's `torch_dtype` (e.g. for an fp8 KV cache).
    """
    if isinstance(config, ConfigFile):
        cfg_file = config
    elif isinstance(config, (str, Path)):
        cfg_file = read_hf_config(config)
    else:
        flat = dict(config)
        if isinstance(flat.get("text_config"), Mapping):
            flat = {**{k: v for k, v in flat.items() if k != "text_config"}, **flat["text_config"]}
        cfg_file = ConfigFile(flat, name or "config", "config.json")
    if name is not None:
        cfg_file = ConfigFile(cfg_file.fields, name, cfg_file.format, cfg_file.file_keys)
    cfg, source = cfg_file.fields, cfg_file.source

    num_layers = _get_int(cfg_file, ("num_hidden_layers", "n_layer", "num_layers"))
    num_heads = _get_int(cfg_file, ("num_attention_heads", "n_head", "num_heads"))

    if dtype is None:
        raw = cfg.get("torch_dtype", cfg.get("dtype"))
        if raw is None:
            raise ConfigError(
                f"torch_dtype is missing from {source}; pass the cache dtype explicitly "
                f"(--dtype, one of {', '.join(DTYPE_SIZES)})"
            )
        dtype = normalize_dtype(raw, field="torch_dtype", source=source)
    else:
        dtype = normalize_dtype(dtype, source=source)

    model_type = str(cfg.get("model_type", ""))
    if cfg.get("kv_lora_rank") is not None or model_type.startswith("deepseek_v"):
        rank = _get_int(cfg_file, ("kv_lora_rank",))
        rope = _get_int(cfg_file, ("qk_rope_head_dim",))
        return ModelKVSpec(
            num_layers=num_layers,
            num_attention_heads=num_heads,
            num_kv_heads=1,
            head_dim=rank + rope,
            dtype=dtype,
            attention=AttentionKind.MLA,
            name=source,
        )

    kv_keys = ("num_key_value_heads", "num_kv_heads", "n_head_kv")
    if cfg.get("multi_query") is True and cfg.get("new_decoder_architecture") is not True:
        num_kv_heads = 1
    elif any(cfg.get(k) is not None for k in kv_keys):
        num_kv_heads = _get_int(cfg_file, kv_keys)
    else:
        # Transformers' own default when the field is absent: plain multi-head attention.
        num_kv_heads = num_heads

    if cfg.get("head_dim") is not None:
        head_dim = _get_int(cfg_file, ("head_dim",))
    else:
        hidden = _get_int(cfg_file, ("hidden_size", "n_embd", "d_model"))
        if hidden % num_heads:
            raise ConfigError(
                f"{cfg_file.key('hidden_size')}={hidden} in {source} is not a multiple of "
                f"{cfg_file.key('num_attention_heads')}={num_heads}; set head_dim explicitly"
            )
        head_dim = hidden // num_heads
    return ModelKVSpec(
        num_layers=num_layers,
        num_attention_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        attention=attention_kind(num_heads, num_kv_heads),
        name=source,
    )


def attention_kind(num_heads: int, num_kv_heads: int) -> AttentionKind:
    """MHA, MQA or GQA by the head counts (MLA is told by its own fields)."""
    if num_kv_heads == num_heads:
        return AttentionKind.MHA
    return AttentionKind.MQA if num_kv_heads == 1 else AttentionKind.GQA


def from_gguf(path: str | Path, *, dtype: str = "float32") -> ModelKVSpec:
    """Build the spec from a GGUF file's metadata (the tensors are not read).

    GGUF records the weights' quantization, not the KV cache's type, so the cache
    dtype is a parameter; float32 is what kvbridge's CPU engine computes in.
    """
    return from_hf_config(read_gguf_config(path), dtype=dtype)


def load_model_spec(path: str | Path, *, dtype: str | None = None) -> ModelKVSpec:
    """Load a spec from a `.gguf` file, a `config.json`, a directory holding one of them,
    or the name of a bundled config (e.g. ``llama-3.2-1b``); see `model_config`."""
    cfg = read_config(path)
    if cfg.format == "gguf":
        return from_hf_config(cfg, dtype=dtype or "float32")
    return from_hf_config(cfg, dtype=dtype)
