"""The one reader of model configuration files: every layer asks this module.

A model's configuration is returned in Hugging Face's vocabulary (the keys of
`config.json`), whether it was read from a `config.json` or translated from a GGUF
file's metadata header (`gguf_meta`, tensors untouched). The planner builds its
`ModelKVSpec` from it (`geometry.py`), the engine its `ModelConfig`; neither parses a
file itself. Errors name the key as the file spells it (`llama.block_count` for GGUF).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.plan import gguf_meta

#: GGUF metadata key (after "<architecture>.") -> the config.json key it stands for.
GGUF_TO_HF = {
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "context_length": "max_position_embeddings",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "attention.kv_lora_rank": "kv_lora_rank",
    "rope.dimension_count": "qk_rope_head_dim",
    "vocab_size": "vocab_size",
}
#: Keys of the whole file (not per architecture).
GGUF_GLOBAL_TO_HF = {
    "general.architecture": "model_type",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
}

_CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass(frozen=True)
class ConfigFile:
    """A model's configuration in config.json's keys, and where it came from.

    `file_keys` maps a config.json key to the key the file itself uses (GGUF), so that
    messages name what the user can find in the file.
    """

    fields: Mapping[str, Any]
    source: str
    format: str  # "config.json" or "gguf"
    file_keys: Mapping[str, str] = field(default_factory=dict)

    def key(self, name: str) -> str:
        """How the file spells config.json key `name`."""
        return self.file_keys.get(name, name)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or ConfigError naming the defect."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read model config {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds a JSON {type(data).__name__}, expected an object")
    return data


def read_hf_config(path: str | Path) -> ConfigFile:
    """A Hugging Face `config.json`; multimodal wrappers' `text_config` is flattened in."""
    cfg = read_json(Path(path))
    if isinstance(cfg.get("text_config"), Mapping):
        cfg = {**{k: v for k, v in cfg.items() if k != "text_config"}, **cfg["text_config"]}
    return ConfigFile(cfg, str(path), "config.json")


def read_gguf_config(path: str | Path) -> ConfigFile:
    """A GGUF file's metadata translated to config.json keys (header only)."""
    source = str(path)
    meta = gguf_meta.read_metadata(path)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ConfigError(f"general.architecture is missing from {source}")
    fields: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for suffix, hf in GGUF_TO_HF.items():
        keys[hf] = f"{arch}.{suffix}"
        if meta.get(keys[hf]) is not None:
            fields[hf] = meta[keys[hf]]
    for gguf_key, hf in GGUF_GLOBAL_TO_HF.items():
        keys[hf] = gguf_key
        if meta.get(gguf_key) is not None:
            fields[hf] = meta[gguf_key]
    kv = fields.get("num_key_value_heads")
    if isinstance(kv, list):  # per-layer counts (some hybrid models): must agree here
        if len(set(kv)) != 1:
            raise ConfigError(f"{keys['num_key_value_heads']}={kv} in {source} varies per layer")
        fields["num_key_value_heads"] = kv[0]
    if "vocab_size" not in fields and isinstance(meta.get("tokenizer.ggml.tokens"), list):
        fields["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    return ConfigFile(fields, source, "gguf", keys)


def bundled_config_names() -> list[str]:
    return sorted(p.stem for p in _CONFIG_DIR.glob("*.json"))


def bundled_config(name: str) -> Path | None:
    p = _CONFIG_DIR / f"{name}.json"
    return p if p.exists() else None


def find_config(path: str | Path) -> Path:
    """The file to read for `path`: a `.gguf` file, a `config.json`, a directory holding
    one of them, or the name of a bundled config (e.g. ``llama-3.2-1b``)."""
    p = Path(path)
    if not p.exists():
        bundled = bundled_config(str(path))
        if bundled is None:
            names = ", ".join(bundled_config_names())
            raise ConfigError(
                f"model config {path} does not exist; give a config.json, a .gguf file, "
                f"or a bundled name ({names})"
            )
        p = bundled
    if p.is_dir():
        if (p / "config.json").exists():
            return p / "config.json"
        ggufs = sorted(p.glob("*.gguf"))
        if not ggufs:
            raise ConfigError(f"{p} holds neither config.json nor a .gguf file")
        return ggufs[0]
    return p


def read_config(path: str | Path) -> ConfigFile:
    """The configuration at `path` (see `find_config`), whatever its format."""
    p = find_config(path)
    return read_gguf_config(p) if p.suffix == ".gguf" else read_hf_config(p)
