"""The message a driver sends every worker for one forward step, and the reply.

Typed msgspec structs (never pickle): the same bytes go to every rank of the tp group,
which is what lets one `ModelRunner.execute` run SPMD on all of them.
"""

from __future__ import annotations

import msgspec
import numpy as np

#: Bump when a field changes meaning; workers refuse other versions.
STEP_VERSION = 1


class StepBatch(msgspec.Struct, frozen=True, kw_only=True):
    """One forward step over several sequences, their new tokens flattened in order.

    Sequence i contributes query_lens[i] tokens (a prefill chunk, or 1 for decode) and after
    the step holds context_lens[i] tokens in blocks block_tables[i]. Logits are returned for
    the last token of every sequence whose `want_logits[i]` is true.
    """

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    want_logits: list[bool]
    version: int = STEP_VERSION


class StepResult(msgspec.Struct, frozen=True, kw_only=True):
    """Logits [num_rows, vocab_size] float32 as raw little-endian bytes."""

    logits: bytes
    num_rows: int
    vocab_size: int

    @classmethod
    def from_array(cls, logits: np.ndarray) -> StepResult:
        a = np.ascontiguousarray(logits, dtype="<f4")
        return cls(logits=a.tobytes(), num_rows=a.shape[0], vocab_size=a.shape[1])

    def array(self) -> np.ndarray:
        return np.frombuffer(self.logits, dtype="<f4").reshape(self.num_rows, self.vocab_size)


class RunnerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker reports once loaded."""

    num_blocks: int
    num_local_kv_heads: int
    kv_cache_shape: list[int]
    vocab_size: int


encode = msgspec.msgpack.encode
step_decoder = msgspec.msgpack.Decoder(StepBatch)
result_decoder = msgspec.msgpack.Decoder(StepResult)
info_decoder = msgspec.msgpack.Decoder(RunnerInfo)
