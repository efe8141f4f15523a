"""Messages between the proxy and the prefill/decode instances (msgspec JSON over HTTP).

Versioned (`backend.PROTOCOL_VERSION`) and size-limited by the instance server
(`--max-body-mb`, `body_limit.BodyLimit`); the decode stream is newline-delimited JSON
`GenerateEvent`s.
"""

from __future__ import annotations

import msgspec

from kvbridge.connector import RemotePrefill
from kvbridge.serve.backend import GenerateEvent, GenerateRequest


class PrefillResult(msgspec.Struct, frozen=True):
    """A prefill instance's answer: the prompt's ids, the first token and its KV.

    `kv` is the request's hand-over record for the decode instance (the prefill
    instance's signed pull capability: its side channel, the blocks, the token range,
    the decode instance it is issued to, an expiry; the decode instance takes all of it
    from the capability, nothing from the caller). None when the request already
    finished at its first token (`finish_reason` set: EOS, a stop string, max_tokens)."""

    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    first_text: str
    finish_reason: str | None
    kv: RemotePrefill | None
    prefill_ms: float
    cached_tokens: int = 0  # prompt tokens taken from the prefill instance's prefix cache
    instance_id: str = ""  # the prefill instance


class Lookup(msgspec.Struct, frozen=True):
    """An instance's answer to `/internal/lookup`: how much of a request's prompt its
    prefix cache holds now (a routing hint; nothing is held), and its load. The instance
    decides what it would pull; the proxy only passes that on (it knows no block size)."""

    instance_id: str
    prompt_tokens: int
    cached_tokens: int  # leading tokens in whole cached blocks
    num_requests: int  # held here: queued, running, streaming, reserved (admission)
    kv_start_token: int = 0  # a decode instance's pull would start here
    holds_prompt: bool = False  # every full block cached: it computes the rest, pulls nothing


class DecodeRequest(msgspec.Struct, frozen=True):
    request: GenerateRequest
    prefill: PrefillResult | None = None  # None: compute the prompt here (colocated)


generate_request_decoder = msgspec.json.Decoder(GenerateRequest)
decode_request_decoder = msgspec.json.Decoder(DecodeRequest)
prefill_result_decoder = msgspec.json.Decoder(PrefillResult)
lookup_decoder = msgspec.json.Decoder(Lookup)
event_decoder = msgspec.json.Decoder(GenerateEvent)
