"""What the engine needs to know about a model and about itself.

`ModelConfig` is the architecture of a Llama-family decoder (llama, mistral, qwen2 and
smollm2 share it: RMSNorm, RoPE, GQA attention, SwiGLU MLP), built from what
`kvbridge.plan.model_config` reads from a GGUF file's metadata or an HF `config.json`. `EngineConfig` is how one instance runs it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbridge.engine.cpu_share import check_cpu_nice
from kvbridge.engine.errors import ModelLoadError
from kvbridge.plan.cast import CASTABLE
from kvbridge.plan.geometry import ModelKVSpec, attention_kind, normalize_dtype
from kvbridge.plan.layout import DEFAULT_BLOCK_SIZE, CacheLayout, InstanceLayout, check_tp_size
from kvbridge.plan.model_config import ConfigFile, read_config

#: Architectures whose decoder layer is the one `models/llama.py` implements.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "smollm")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder; `name` is for messages."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"architecture={self.architecture!r} of {self.name} is not supported; "
                f"the engine runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for f in (
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "max_position",
        ):
            value = getattr(self, f)
            if not isinstance(value, int) or value <= 0:
                raise ModelLoadError(f"{f}={value!r} in {self.name} must be a positive integer")
        if self.num_attention_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads} in {self.name}"
            )

    def kv_spec(self, dtype: str = "float32") -> ModelKVSpec:
        """The planner's view of this model's KV cache."""
        return ModelKVSpec(
            self.num_layers,
            self.num_attention_heads,
            self.num_kv_heads,
            self.head_dim,
            dtype,
            attention_kind(self.num_attention_heads, self.num_kv_heads),
            self.name,
        )

    @classmethod
    def from_config(cls, cfg: ConfigFile) -> ModelConfig:
        """The architecture from a configuration in config.json's keys (any format; see
        `kvbridge.plan.model_config`). For GGUF, whether the LM head is tied and whether
        attention has biases are guesses the weight loader corrects."""
        f, name = cfg.fields, cfg.source

        def need(key: str) -> Any:
            if f.get(key) is None:
                raise ModelLoadError(f"{cfg.key(key)} is missing from {name}")
            return f[key]

        model_type = str(f.get("model_type", "llama"))
        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        eos = f.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope = f.get("rope_parameters") or f.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ModelLoadError(
                f"rope type {rope.get('rope_type', rope.get('type'))!r} in {name} is not "
                "supported; the engine implements plain RoPE (rope_type 'default')"
            )
        theta = f.get("rope_theta") or rope.get("rope_theta") or 10000.0
        max_position = int(f.get("max_position_embeddings") or 2048)
        # Within one sliding window, sliding-window attention is full attention.
        window = f.get("sliding_window")
        if window and f.get("use_sliding_window", True):
            max_position = min(max_position, int(window))
        return cls(
            architecture=model_type,
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_attention_heads=num_heads,
            num_kv_heads=int(f.get("num_key_value_heads") or num_heads),
            head_dim=int(f.get("head_dim") or hidden // num_heads),
            vocab_size=int(need("vocab_size")),
            max_position=max_position,
            rms_norm_eps=float(f.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            tie_word_embeddings=bool(f.get("tie_word_embeddings", cfg.format == "gguf")),
            attention_bias=bool(f.get("attention_bias", model_type == "qwen2")),
            bos_token_id=f.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            name=name,
        )

    @classmethod
    def read(cls, path: Path) -> ModelConfig:
        """The architecture of the model at `path` (a .gguf file, a config.json or a
        directory holding one), from metadata only."""
        return cls.from_config(read_config(path))


@dataclass(frozen=True)
class EngineConfig:
    """How one engine instance runs its model.

    `num_blocks` None sizes each worker's cache to `kv_cache_mb` MiB (at most what
    `max_num_seqs` sequences of `max_model_len` tokens need). `kv_dtype` is the cache's
    element type (the model computes in float32; K and V are cast on write). `max_model_len` None is the
    model's context, capped at 4096 on this CPU engine.
    """

    tp_size: int = 1
    block_size: int = DEFAULT_BLOCK_SIZE
    cache_layout: CacheLayout = CacheLayout.BHLNC
    num_blocks: int | None = None
    max_num_seqs: int = 16
    max_model_len: int | None = None
    prefill_chunk_size: int = 512
    kv_dtype: str = "float32"
    num_threads: int | None = None  # torch threads per worker: `torch_threads()`
    kv_cache_mb: int = 256
    worker_timeout_s: float = 300.0
    enable_prefix_caching: bool = True  # reuse the K/V of prompts' common full blocks
    #: how much the compute threads' nice value is raised above the process's (not the
    #: KV connector's threads): `cpu_share.py`
    cpu_nice: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_layout", CacheLayout.parse(self.cache_layout))
        kv_dtype = normalize_dtype(self.kv_dtype, field="kv_dtype")
        if kv_dtype not in CASTABLE:
            raise ModelLoadError(
                f"kv_dtype={self.kv_dtype!r}: the engine computes in float32 and keeps its KV "
                f"cache in one of {', '.join(CASTABLE)}; use one of those"
            )
        object.__setattr__(self, "kv_dtype", kv_dtype)
        check_cpu_nice(self.cpu_nice)
        if self.cache_layout.is_channel_major:
            raise ModelLoadError(
                f"cache_layout={self.cache_layout.name!r} keeps a half channel-major, as "
                "vLLM's CPU pages do; kvbridge's engine writes token-major halves: use "
                f"{CacheLayout(self.cache_layout.order).name}"
            )
        # InstanceLayout validates tp_size and block_size with the planner's words.
        self.layout()
        for f in ("max_num_seqs", "prefill_chunk_size", "kv_cache_mb"):
            if getattr(self, f) <= 0:
                raise ModelLoadError(f"{f}={getattr(self, f)} must be a positive integer")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ModelLoadError(f"num_blocks={self.num_blocks} must be a positive integer")

    def torch_threads(self) -> int:
        """Torch threads per worker: `num_threads`; if None, `OMP_NUM_THREADS` where it
        is set (as torch itself reads it), else 2 at tp 1 (the engine in its process) and
        1 per worker otherwise. OpenMP's threads spin while they wait: two per engine on
        a host whose cores other processes keep busy made a step 2-4x slower than one
        (measured: docs/benchmarks.md, "Measurements behind the defaults")."""
        if self.num_threads is not None:
            return self.num_threads
        env = os.environ.get("OMP_NUM_THREADS", "")
        if env.isdigit() and int(env) > 0:
            return int(env)
        return 2 if self.tp_size == 1 else 1

    def layout(self) -> InstanceLayout:
        return InstanceLayout(
            tp_size=self.tp_size,
            block_size=self.block_size,
            cache_layout=self.cache_layout,
            dtype=self.kv_dtype,
        )

    def check(self, model: ModelConfig) -> None:
        """Raise the planner's LayoutError if tp_size does not suit `model`."""
        check_tp_size(model.kv_spec(self.kv_dtype), self.tp_size)

    def model_len(self, model: ModelConfig) -> int:
        if self.max_model_len is not None:
            return min(self.max_model_len, model.max_position)
        return min(model.max_position, 4096)

    def blocks(self, model: ModelConfig, block_bytes: int) -> int:
        """Blocks per worker; `block_bytes` is one block over all of a worker's layers."""
        if self.num_blocks is not None:
            return self.num_blocks
        wanted = -(-self.model_len(model) // self.block_size) * self.max_num_seqs
        return max(1, min(wanted, self.kv_cache_mb * 2**20 // block_bytes))
