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


class DecodeRequest(msgspec.Struct, frozen=True):
    request: GenerateRequest
    prefill: PrefillResult | None = None  # None: compute the prompt here (colocated)


generate_request_decoder = msgspec.json.Decoder(GenerateRequest)
decode_request_decoder = msgspec.json.Decoder(DecodeRequest)
prefill_result_decoder = msgspec.json.Decoder(PrefillResult)
event_decoder = msgspec.json.Decoder(GenerateEvent)
