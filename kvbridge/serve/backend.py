"""What the proxy asks of whatever generates tokens.

The proxy speaks OpenAI to clients and `Backend` to the instances behind it. A backend
turns one `GenerateRequest` into a stream of `GenerateEvent`s: text deltas as tokens
come, then one event with `finish_reason` set and the usage and stage timings.
The messages are msgspec Structs because they also travel between processes.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator

import msgspec

from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.errors import KVBridgeError

__all__ = [
    "PROTOCOL_VERSION",
    "Backend",
    "BackendError",
    "GenerateEvent",
    "GenerateRequest",
    "RequestStages",
    "SamplingParams",
]

#: Version of the proxy <-> instance messages; bumped on any incompatible change.
PROTOCOL_VERSION = 4


class RequestStages(msgspec.Struct, omit_defaults=True):
    """What one request's stages took, as the last event reports them (and the API's
    `kvbridge_stages` shows them: only the fields that apply)."""

    prefill_ms: float | None = None  # the prefill instance's prefill (first token)
    prefill_cached_tokens: int | None = None  # its prefix-cache hit
    transfer_ms: float | None = None  # the KV pull, from its start to every worker's end
    #: the slowest decode worker's own time from Pull to done (no wait for a step in flight)
    kv_ready_ms: float | None = None
    kv_bytes: int | None = None  # KV bytes pulled (0: the decode instance held it all)
    #: KV bytes its decode workers copied from each other on their host (a fan-out:
    #: read over the link once, `kv_bytes`, then copied to the workers that share them)
    kv_local_bytes: int | None = None
    #: decode workers whose pull waited for a handshake with the prefill instance (0
    #: once the proxy's introduction met it), and paths from a decode worker to a
    #: prefill worker that no READ had crossed before this pull's (0 once warmed up)
    kv_handshakes: int | None = None
    kv_cold_peers: int | None = None
    decode_ms: float | None = None  # this instance's part after the KV load
    cached_tokens: int | None = None  # the decode (or colocated) engine's prefix-cache hit
    kv_load_failed: bool | None = None  # the pull failed (`kv_load_error` says why)

    def as_dict(self) -> dict[str, float | int | bool]:
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}


class GenerateRequest(msgspec.Struct, frozen=True):
    """One completion: exactly one of `prompt`, `prompt_token_ids`, `messages` is set."""

    request_id: str
    sampling: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = (
        None  # chat: {"role", "content"}; template applied by the instance
    )
    #: prefill only: the decode instance that will pull its KV (its capability's reader)
    kv_reader: str | None = None
    #: prefill only: that reader holds the prompt's first tokens already (its prefix
    #: cache), so only the KV from this token on is exposed
    kv_start_token: int = 0
    #: the prefix-cache namespace (vLLM's `cache_salt`, as the proxy's isolation policy
    #: makes it): its blocks are shared only with requests of the same salt, on every
    #: instance and in routing lookups; None: the shared namespace
    cache_salt: str | None = None
    version: int = PROTOCOL_VERSION


class GenerateEvent(msgspec.Struct):
    """A piece of a completion. The last one has `finish_reason` ("stop" or "length")."""

    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: stage figures of the finished request (set on the last event)
    stages: RequestStages = msgspec.field(default_factory=RequestStages)
    error: str | None = None  # set on a failure after streaming began
    #: the HTTP status a non-streamed response answers `error` with: 503 when what
    #: served the request cannot serve any more (its engine failed), 500 otherwise
    error_status: int = 500
    #: why the KV pull failed, when it did (then `stages.kv_load_failed` is true)
    kv_load_error: str | None = None
    #: prompt tokens whose KV this request did not compute (prefix caches; usage's
    #: prompt_tokens_details.cached_tokens)
    cached_tokens: int = 0
    #: which instances served it ({"prefill_instance", "decode_instance"}), last event
    route: dict[str, str] = msgspec.field(default_factory=dict)


class BackendError(KVBridgeError):
    """A request the backend refused or could not finish; `status` is the HTTP status
    the proxy answers with (400 bad request, 503 unavailable, 500 internal). With
    `retry_after_s` it was refused for lack of room (every instance full): the proxy
    answers 503 with that `Retry-After` and the error code "overloaded"."""

    def __init__(
        self,
        message: str,
        status: int = 500,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.retry_after_s = retry_after_s


class Backend(abc.ABC):
    """Generates tokens for the proxy. Owned by the proxy process; called from its
    event loop, concurrently for many requests."""

    model_name: str

    @abc.abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateEvent, None]:
        """Stream the completion. Raises BackendError before the first event if the
        request cannot start; a failure after that arrives as an event with `error`.
        Closing the iterator early (client went away) aborts the request."""

    async def health(self) -> dict[str, object]:
        """Readiness of what sits behind the backend: `status` "ok" (everything up),
        "degraded" (something down, requests still served) or "unavailable" (requests
        cannot be served now; the proxy's /health answers 503), with details."""
        return {"status": "ok"}

    async def instance_metrics(self) -> dict[str, str | None]:
        """Each instance's Prometheus text (blocks in use, ...) by URL, None for one that
        did not answer; the proxy appends them to its /metrics."""
        return {}

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Called once the proxy serves (before its first request is answered)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
