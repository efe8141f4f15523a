"""A request's state on the driver: its tokens, its blocks and how far the cache has got."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvbridge.connector import KVTransferParams
from kvbridge.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # prompt (or part of it) not yet in the cache
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # prompt KV comes from another instance
    RUNNING = "running"  # decoding
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context is full
    PREFILLED = "prefilled"  # prefill-only request: first token out (its KV exposed, if any)
    ABORT = "abort"
    ERROR = "error"  # `Sequence.error` says why (a KV load failed and the policy is fail)


@dataclass
class Sequence:
    """Invariant: the cache holds K/V for all_ids[:num_computed] in blocks `block_ids`."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_len: int  # the context limit: prompt + output never exceed it
    generator: torch.Generator | None = None
    prefill_only: bool = False
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = 0  # of the prompt, taken from the prefix cache (not computed)
    #: the prefix-cache namespace of the request (`BlockManager.root`); None: the shared one
    cache_salt: str | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    text: str = ""
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    #: the hand-over record it came with (RemoteDecode: expose for a reader; RemotePrefill:
    #: pull the prompt's KV), and the one it finished with (a prefill's RemotePrefill)
    kv_params: KVTransferParams | None = None
    kv_transfer_params: KVTransferParams | None = None
    kv_nbytes: int = 0  # KV bytes pulled for it
    kv_local_nbytes: int = 0  # ... and copied between decode workers on the host (fan-out)
    kv_transfer_ms: float | None = None  # how long its pull took
    kv_ready_ms: float | None = None  # the slowest worker's own time for the pull
    kv_handshakes: int = 0  # workers whose pull waited for a handshake
    kv_cold_peers: int = 0  # paths to producer workers its pull's READs crossed first
    kv_load_error: str | None = None  # why its pull failed, when it did

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        return (self.prompt_ids + self.output_ids)[start:end]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def cut_at_stop(self) -> bool:
        """Whether the text holds a stop string; if so the text ends before the first."""
        hits = [i for i in (self.text.find(s) for s in self.params.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
        return bool(hits)
