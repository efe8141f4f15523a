"""OpenAI-compatible response bodies: completions, chat completions, their stream
chunks, usage, and errors (``{"error": {"message", "type", "param", "code"}}``)."""

from __future__ import annotations

import time
import uuid
from typing import Any


def error_body(
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """The body of an OpenAI-style error response (text made safe to encode as UTF-8)."""

    def safe(text: str | None) -> str | None:
        return None if text is None else text.encode("utf-8", "backslashreplace").decode()

    return {"error": {"message": safe(message), "type": type_, "param": safe(param), "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = 0
) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: prompt tokens served from a prefix cache
    (None: not said, as with the proxy's --hide-cached-tokens)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def completion_body(
    rid: str,
    model: str,
    text: str,
    finish: str | None,
    use: dict[str, Any] | None,
    *,
    chunk: bool = False,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    if not chunk or use is not None:
        body["usage"] = use
    return body


def chat_body(
    rid: str, model: str, text: str, finish: str | None, use: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
        ],
        "usage": use,
    }


def chat_chunk(
    rid: str,
    model: str,
    delta: dict[str, Any],
    finish: str | None,
    use: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        if delta or finish
        else [],
    }
    if use is not None:
        body["usage"] = use
    return body
