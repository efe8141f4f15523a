"""Helpers the engine tests share."""

from __future__ import annotations

from pathlib import Path

from kvbridge.engine.tokenizer import Tokenizer
from kvbridge.engine.weights import resolve_model

PROMPTS = [[504, 3575, 282, 4649, 314], [6403, 1980, 253, 655, 28, 260, 2240]]


def save_model(kind: str, path: Path) -> list[list[int]]:
    """Save a random tiny model + SmolLM2's tokenizer; return transformers' greedy ids."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
        initializer_range=0.3,
    )  # large weights: well-separated logits
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_theta=5000.0, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    model.eval()
    model.save_pretrained(path)
    Tokenizer.load(resolve_model("smollm2-135m")).backend.save(str(path / "tokenizer.json"))
    out = []
    for ids in PROMPTS:
        x = torch.tensor([ids])
        with torch.inference_mode():
            g = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=None,
            )
        out.append(g[0, len(ids) :].tolist())
    return out
