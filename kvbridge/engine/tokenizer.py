"""Text <-> token ids, and the chat template, from a GGUF file or an HF directory.

For a GGUF with a byte-level BPE vocabulary (``tokenizer.ggml.model == "gpt2"``) we rebuild
exactly the tokenizer transformers builds from the same file (GPT2Tokenizer: BPE with the
file's merges, ByteLevel pre-tokenizer and decoder, control tokens added as special tokens,
user-defined ones as added tokens), so both give the same ids. An HF directory brings its
own ``tokenizer.json`` and ``tokenizer_config.json``.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from kvbridge.engine.errors import ModelLoadError
from kvbridge.plan import gguf_meta

_CONTROL, _USER_DEFINED = 3, 4


@cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


class Tokenizer:
    """Immutable after construction; safe to share between threads for encode/decode."""

    def __init__(
        self,
        backend: Any,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids = eos_token_ids

    @classmethod
    def load(cls, path: Path) -> Tokenizer:
        return cls.from_hf_dir(path) if path.is_dir() else cls.from_gguf(path)

    @classmethod
    def from_gguf(cls, path: Path) -> Tokenizer:
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as Backend

        keep = frozenset(
            {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"}
        )
        meta = gguf_meta.read_metadata(path, keep)
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(
                f"tokenizer.ggml.model={kind!r} in {path} is not supported; the engine reads "
                "byte-level BPE ('gpt2') vocabularies from GGUF, or use an HF directory"
            )
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {
            (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
            for i, t in enumerate(tokens)
        }
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        backend = Backend(
            models.BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        special = [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _CONTROL and set(t) <= alphabet
        ]
        backend.add_special_tokens(special)
        user = [
            AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _USER_DEFINED and t in vocab
        ]
        if user:
            backend.add_tokens(user)

        def token(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            backend,
            meta.get("tokenizer.chat_template"),
            token("bos_token_id"),
            token("eos_token_id"),
            () if eos is None else (int(eos),),
        )

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        from tokenizers import Tokenizer as Backend

        file = path / "tokenizer.json"
        if not file.exists():
            raise ModelLoadError(f"{path} has no tokenizer.json; the engine needs one")
        backend = Backend.from_file(str(file))
        cfg: dict[str, Any] = {}
        if (path / "tokenizer_config.json").exists():
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()

        def name(v: Any) -> str | None:
            return v.get("content") if isinstance(v, dict) else v

        eos = name(cfg.get("eos_token"))
        eos_ids: tuple[int, ...] = ()
        model_cfg = path / "config.json"
        if model_cfg.exists():
            e = json.loads(model_cfg.read_text()).get("eos_token_id")
            eos_ids = tuple(e) if isinstance(e, list) else (() if e is None else (int(e),))
        eos_id = backend.token_to_id(eos) if eos is not None else None
        if not eos_ids and eos_id is not None:
            eos_ids = (int(eos_id),)
        return cls(backend, template, name(cfg.get("bos_token")), eos, eos_ids)

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in it (e.g. <|im_start|>) stay whole."""
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render the model's chat template as transformers does (jinja2, sandboxed,
        trim_blocks + lstrip_blocks)."""
        if not self.chat_template:
            raise ModelLoadError("this model has no chat template; prompt it without --chat")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self.chat_template)
        return str(
            template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        )


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting a UTF-8 char."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = ""

    def update(self, ids: list[int]) -> str:
        """All output ids so far -> the new text since the previous call ('' if incomplete)."""
        text = self.tokenizer.decode(ids)
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self.text) :] if text.startswith(self.text) else text
        self.text = text
        return delta
