"""`SamplingParams`: how one request samples, the one type every layer uses (the proxy
builds it from an OpenAI request, it travels to the instances inside
`GenerateRequest`, the engine samples with it). A msgspec struct without torch, so the
proxy imports it cheaply; validated on construction and on decoding."""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvbridge.engine.errors import RequestError

#: Temperatures below this sample greedily (vLLM's threshold too).
GREEDY_BELOW = 1e-5
#: The seeds torch.Generator.manual_seed takes (negative ones are mapped to positive).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class SamplingParams(msgspec.Struct, frozen=True):
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or OpenAI's -1): no limit
    seed: int | None = None
    stop: tuple[Annotated[str, msgspec.Meta(max_length=4096)], ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.stop, tuple):
            msgspec.structs.force_setattr(self, "stop", tuple(self.stop))
        if self.top_k < -1:
            raise RequestError(f"top_k={self.top_k} must be >= 0 (0 or -1 disables it)")
        if self.top_k == -1:  # OpenAI's "no limit"
            msgspec.structs.force_setattr(self, "top_k", 0)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise RequestError(f"max_tokens={self.max_tokens!r} must be a positive integer")
        if self.max_tokens <= 0:
            raise RequestError(f"max_tokens={self.max_tokens!r} must be a positive integer")
        if not self.temperature >= 0:  # NaN too
            raise RequestError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p={self.top_p} must be in (0, 1]")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must be non-empty")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise RequestError(
                f"seed={self.seed} is outside [{SEED_MIN}, {SEED_MAX}]; use a 64-bit seed"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def replace(self, **changes: object) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)
