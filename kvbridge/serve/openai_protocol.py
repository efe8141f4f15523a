"""OpenAI-compatible requests (the subset kvbridge serves); the answers are in
`openai_responses.py`.

`parse_request(raw, CompletionRequest | ChatCompletionRequest)` turns a request body
into a validated request or raises `ProtocolError` (an HTTP 4xx with the parameter it
is about). Nothing a client sends ends in a 5xx: the body must be a JSON object of
valid Unicode (a lone surrogate such as "\\ud800" is refused), numbers are bounded
(ints to 64 bits, floats finite), types are strict (no "1" for 1, no true for 1), and a
parameter kvbridge does not implement (`tools`, `logprobs`, `n` > 1, ...; see
`UNSUPPORTED`) is refused naming it, as is a parameter the API does not have, rather
than silently ignored. Such a parameter set to its neutral value (`"n": 1`,
`"tools": []`, `"echo": false`, null) changes nothing and is accepted.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvbridge.errors import KVBridgeError

#: Bounds of the integer parameters: 64-bit, as the instances and torch take them.
MAX_INT64 = 2**63 - 1
#: A seed is anything torch.Generator.manual_seed takes.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
#: Token ids are 32-bit (every vocabulary is far smaller; the instance checks its own).
MAX_TOKEN_ID = 2**31 - 1


class ProtocolError(KVBridgeError):
    """A request refused before it reaches a backend: HTTP `status` (4xx), the message
    naming the parameter, `param` for the error body."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


def _none_or(*neutral: object) -> Callable[[Any], bool]:
    """A check that a value is null or one of `neutral`, of the same JSON type
    (true is not 1, 1.0 is 1 for a number)."""

    def check(value: Any) -> bool:
        if value is None:
            return True
        return any(
            type(value) is type(n) or (type(n) in (int, float) and type(value) in (int, float))
            for n in neutral
            if value == n
        )

    return check


#: Parameters of the OpenAI API that kvbridge does not implement: the values that
#: change nothing, and what to do instead. Any other value is refused with 400.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (_none_or(1), "use n=1 (one choice per request)"),
    "best_of": (_none_or(1), "leave best_of unset (one choice per request)"),
    "echo": (_none_or(False), "leave echo unset"),
    "suffix": (_none_or(""), "leave suffix unset (no insertion)"),
    "logprobs": (_none_or(False), "leave logprobs unset"),
    "top_logprobs": (_none_or(0), "leave top_logprobs unset"),
    "logit_bias": (_none_or({}), "leave logit_bias unset"),
    "presence_penalty": (_none_or(0), "leave presence_penalty unset (no penalties)"),
    "frequency_penalty": (_none_or(0), "leave frequency_penalty unset (no penalties)"),
    "tools": (_none_or([]), "leave tools unset (kvbridge generates plain text)"),
    "tool_choice": (_none_or("none"), "leave tool_choice unset (no tools)"),
    "parallel_tool_calls": (_none_or(True, False), "leave parallel_tool_calls unset (no tools)"),
    "functions": (_none_or([]), "leave functions unset (kvbridge generates plain text)"),
    "function_call": (_none_or("none"), "leave function_call unset (no functions)"),
    "response_format": (_none_or({"type": "text"}), "leave response_format unset (plain text)"),
    "modalities": (_none_or(["text"]), "leave modalities unset (text only)"),
    "audio": (_none_or(), "leave audio unset (text only)"),
    "prediction": (_none_or(), "leave prediction unset"),
    "reasoning_effort": (_none_or(), "leave reasoning_effort unset"),
    "web_search_options": (_none_or(), "leave web_search_options unset"),
    "store": (_none_or(False), "leave store unset (nothing is stored)"),
    "metadata": (_none_or({}), "leave metadata unset (nothing is stored)"),
    "service_tier": (_none_or("auto", "default"), "leave service_tier unset"),
}


class _Strict(BaseModel):
    # strict: 1 is not true and "1" is not 1; floats are finite; no unknown fields
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT64)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_INT64)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    #: vLLM's prefix-cache namespace: blocks are shared only between requests with the
    #: same salt (`isolation.py`); a non-empty string when given
    cache_salt: str | None = Field(default=None, min_length=1)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        if value is None:
            return value
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("must be a non-empty string or a list of non-empty strings")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(default=16, ge=1, le=MAX_INT64)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(p, str) for p in value):
            return value
        if isinstance(value, list) and all(
            type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in value
        ):
            return value
        raise ValueError(
            "must be a string, a list of strings, or a list of token ids "
            f"(integers in [0, {MAX_TOKEN_ID}])"
        )


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = ""
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of text parts")
        for i, part in enumerate(value):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
                or set(part) != {"type", "text"}
            ):
                raise ValueError(
                    f'part {i} must be {{"type": "text", "text": "..."}} (kvbridge takes text only)'
                )
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(part["text"]) for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT64)


R = TypeVar("R", CompletionRequest, ChatCompletionRequest)


def parse_request(raw: bytes, kind: type[R]) -> R:
    """The validated request of body `raw`, or ProtocolError naming what is wrong."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ProtocolError("request body is nested too deeply to be a request") from None
    except ValueError as exc:  # bad JSON, bad UTF-8, an int of thousands of digits
        raise ProtocolError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"request body must be a JSON object, not {_json_type(body)}")
    _check_unicode(body)
    fields = set(kind.model_fields)
    for name, value in body.items():
        if name in fields:
            continue
        if name in UNSUPPORTED:
            neutral, hint = UNSUPPORTED[name]
            if not neutral(value):
                raise ProtocolError(
                    f"{name}={_show(value)} is not supported; {hint}", name, code="unsupported"
                )
        else:
            raise ProtocolError(
                f"unrecognized parameter {name!r}; this endpoint takes {', '.join(sorted(fields))}",
                name,
                code="unrecognized_parameter",
            )
    body = {k: v for k, v in body.items() if k in fields}
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        raise ProtocolError(f"{'.'.join(loc) or 'body'}: {msg}", loc[0] if loc else None) from None


def _check_unicode(body: dict[str, Any]) -> None:
    """Refuse a lone surrogate anywhere (JSON allows the escape; UTF-8 cannot carry it)."""
    stack: list[tuple[str, dict[str, Any] | list[Any]]] = [("", body)]
    while stack:
        path, node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str):
                _check_text(key, where)
            if isinstance(value, str):
                _check_text(value, where)
            elif isinstance(value, dict | list):
                stack.append((where, value))


def _check_text(text: str, where: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = ord(text[exc.start])
        where = where.encode("ascii", "backslashreplace").decode()
        raise ProtocolError(
            f"{where}: lone surrogate \\u{bad:04x} at character {exc.start} is not valid "
            "Unicode; send UTF-8 text",
            where.split(".", 1)[0],
        ) from None


def _json_type(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 60 else text[:57] + "..."
