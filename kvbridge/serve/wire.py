"""Messages between the proxy and the prefill/decode instances (msgspec JSON over HTTP).

Versioned (`backend.PROTOCOL_VERSION`) and size-limited by the instance server
(`--max-body-mb`, `body_limit.BodyLimit`); the decode stream is newline-delimited JSON
`GenerateEvent`s.
"""

from __future__ import annotations

import msgspec

from kvbridge.serve.backend import GenerateEvent, GenerateRequest


class KVParams(msgspec.Struct, frozen=True):
    """Where a decode instance finds a prefilled request's KV cache: the prefill
    instance's signed pull capability (`kvbridge.transfer.capability`: its side channel,
    the blocks, the token count, the decode instance it is issued to, an expiry). The
    decode instance takes all of it from the capability, nothing from the caller."""

    instance_id: str  # the prefill instance (for reports)
    capability: bytes


class PrefillResult(msgspec.Struct, frozen=True):
    """A prefill instance's answer: the prompt's ids, the first token and its KV.

    `kv` is None when the request already finished at its first token
    (`finish_reason` set: EOS, a stop string, or max_tokens=1)."""

    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    first_text: str
    finish_reason: str | None
    kv: KVParams | None
    prefill_ms: float
    cached_tokens: int = 0  # prompt tokens taken from the prefill instance's prefix cache
    instance_id: str = ""  # the prefill instance


class Lookup(msgspec.Struct, frozen=True):
    """An instance's answer to `/internal/lookup`: how much of a request's prompt its
    prefix cache holds now (a routing hint; nothing is held), and its load."""

    instance_id: str
    prompt_tokens: int
    cached_tokens: int  # leading tokens in whole cached blocks
    block_size: int
    num_requests: int  # held here: queued, running, streaming, reserved (admission)

    @property
    def full_block_tokens(self) -> int:
        """The prompt's tokens in whole blocks: a hit this long needs no pull."""
        return self.prompt_tokens // self.block_size * self.block_size

    @property
    def pull_start_token(self) -> int:
        """Where this decode instance's pull starts: its hit, leaving at least the last
        token to pull (whole blocks)."""
        last = (self.prompt_tokens - 1) // self.block_size * self.block_size
        return min(self.cached_tokens, last)


class DecodeRequest(msgspec.Struct, frozen=True):
    request: GenerateRequest
    prefill: PrefillResult | None = None  # None: compute the prompt here (colocated)


generate_request_decoder = msgspec.json.Decoder(GenerateRequest)
decode_request_decoder = msgspec.json.Decoder(DecodeRequest)
prefill_result_decoder = msgspec.json.Decoder(PrefillResult)
lookup_decoder = msgspec.json.Decoder(Lookup)
event_decoder = msgspec.json.Decoder(GenerateEvent)
