"""Continuous batching: which sequences run in the next step, and their blocks.

Policy (one step is either kind, like nano-vllm):
  * prefill first: the oldest waiting sequence gets its next chunk of at most
    `prefill_chunk_size` tokens, alone in the step, if its blocks can be allocated and
    fewer than `max_num_seqs` sequences are running;
  * otherwise every running sequence decodes one token; a sequence that needs a new block
    when none is free preempts the newest running sequence (its blocks are freed and it
    goes back to the front of the queue, to be recomputed).

Every sequence the scheduler holds is in exactly one queue (a sequence that finished
without being held is in none):

    queue            status                 what waits there            blocks
    ---------------  ---------------------  --------------------------  -------------------------
    waiting          WAITING                a prompt (or a preempted    its chunks' so far, each
                                            sequence) to compute        taken at `schedule`
    waiting          WAITING_FOR_REMOTE_KV  a decode request whose      none yet
                                            prompt KV comes from
                                            another instance
    waiting_for_kv   WAITING_FOR_REMOTE_KV  the same, its pull in       the cached prefix and the
                                            flight (the connector's)    rest, being written
    running          RUNNING                decoding, one token a step  its context's
    held             FINISHED               a prefill exposed and held  held for the connector
                                            for its reader, a decode    until `release_held`
                                            aborted mid-pull

With a KV connector (kvbridge.connector) the engine calls `start_remote_loads` before
each `schedule`: a waiting request whose prompt KV comes from elsewhere takes its local
prefix-cache hit, asks the connector how many tokens will come
(`get_num_new_matched_tokens`), gets blocks for them and hands them over
(`update_state_after_alloc`), then waits in `waiting_for_kv` until the connector reports
the pull ended (`load_ended`). Blocks go back to the block manager in one place, `free`:
at a finish, a preemption, a failed or refused load, or when the connector releases the
blocks it held (`release_held`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvbridge.connector import KVConnectorScheduler, KVRequest, RequestState
from kvbridge.engine.block_manager import BlockManager
from kvbridge.engine.errors import OutOfBlocksError
from kvbridge.engine.sequence import Sequence, SequenceStatus
from kvbridge.engine.step import StepBatch


@dataclass
class ScheduledStep:
    seqs: list[Sequence]
    query_lens: list[int]
    is_prefill: bool

    def to_batch(self, block_size: int) -> StepBatch:
        """The worker message; the caller has allocated blocks for the new tokens."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        ctx_lens, tables, want = [], [], []
        for seq, qlen in zip(self.seqs, self.query_lens, strict=True):
            start, end = seq.num_computed, seq.num_computed + qlen
            ids += seq.tokens(start, end)
            positions += range(start, end)
            slots += [
                seq.block_ids[p // block_size] * block_size + p % block_size
                for p in range(start, end)
            ]
            ctx_lens.append(end)
            tables.append(seq.block_ids[: -(-end // block_size)])
            want.append(end == seq.num_tokens)
        return StepBatch(
            input_ids=ids,
            positions=positions,
            slot_mapping=slots,
            query_lens=list(self.query_lens),
            context_lens=ctx_lens,
            block_tables=tables,
            want_logits=want,
        )


class Scheduler:
    """Owned by the LLMEngine, called from its thread only; holds every unfinished
    sequence and the finished ones whose blocks the connector holds, each in one queue
    (the module docstring), and is the only one that frees their blocks."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        prefill_chunk_size: int,
        connector: KVConnectorScheduler | None = None,
    ) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.chunk = prefill_chunk_size
        self.connector = connector
        # the queues of the module docstring
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.waiting_for_kv: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.append(seq)  # its prompt KV is already in its blocks
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Whether a step has work (requests waiting for remote KV do not count)."""
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep | None:
        """The next step, or None if nothing can run (nothing queued). With a connector,
        `start_remote_loads` comes first (the requests it hands over are not prefilled)."""
        if self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            assert seq.status is not SequenceStatus.WAITING_FOR_REMOTE_KV, "start_remote_loads"
            hit, start, qlen, need = self._next_chunk(seq)
            if self.blocks.can_allocate(need + self.blocks.num_to_acquire(hit)):
                if hit:
                    self.blocks.acquire(hit)
                    seq.block_ids += hit
                    seq.num_computed = start
                    if not seq.output_ids:  # (not a preempted sequence coming back)
                        seq.num_cached_tokens = start
                seq.block_ids += self.blocks.allocate(need)
                return ScheduledStep([seq], [qlen], is_prefill=True)
            # Otherwise it waits: decodes below may finish, or the connector may release
            # the blocks it holds.
        if not self.running:
            return None
        scheduled: list[Sequence] = []
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below by an older sequence
            while self.blocks.blocks_for(seq.num_tokens) > len(seq.block_ids):
                if self.blocks.can_allocate(1):
                    seq.block_ids += self.blocks.allocate(1)
                elif self.running[-1] is not seq:
                    self.preempt(self.running[-1])
                else:
                    self.preempt(seq)
                    break
            if seq in self.running:
                scheduled.append(seq)
        if not scheduled:
            return self.schedule() if self.waiting else None
        return ScheduledStep(scheduled, [1] * len(scheduled), is_prefill=False)

    def start_remote_loads(self) -> list[tuple[Sequence, KVRequest]]:
        """Waiting requests whose prompt KV comes from elsewhere: their cached prefix
        stays, blocks are allocated for the rest and the connector pulls into them (at
        least the last token: a prompt held whole is computed here, not pulled). Returns
        the hand-overs that ended at once (nothing to pull, no free blocks: recompute or
        fail, the connector's state), for the engine to act on (`load_ended`)."""
        kv = self.connector
        if kv is None:
            return []
        bm, ended = self.blocks, []
        for seq in [s for s in self.waiting if s.status is SequenceStatus.WAITING_FOR_REMOTE_KV]:
            self.waiting.remove(seq)
            rid, prompt = seq.request_id, seq.prompt_ids
            hit = bm.match_prefix(prompt, len(prompt) - 1, seq.cache_salt)
            num_external, load = kv.get_num_new_matched_tokens(rid, len(hit) * bm.block_size)
            if not load:  # nothing will come: recompute or fail (the connector's state)
                ended.append((seq, kv.pop_ended(rid)))
                continue
            bm.acquire(hit)  # held first: the allocation below cannot evict them
            seq.block_ids = list(hit)
            try:
                seq.block_ids += bm.allocate(bm.blocks_for(len(prompt)) - len(hit))
            except OutOfBlocksError as exc:
                self.free(seq)
                rec = kv.load_refused(rid, f"no free blocks to receive the KV: {exc}")
                ended.append((seq, rec))
                continue
            seq.num_cached_tokens = len(hit) * bm.block_size
            kv.update_state_after_alloc(rid, seq.block_ids, num_external)
            self.waiting_for_kv[rid] = seq
        return ended

    def load_ended(self, rec: KVRequest, seq: Sequence | None = None) -> Sequence | None:
        """A hand-over ended (`rec`, the connector's record; `seq`, a load
        `start_remote_loads` ended at once): free or use its blocks. Returns the decode
        request whose load ended, for the engine to continue from the prefill's first
        token (RUNNING: its prompt KV is in place; RECOMPUTE: back to the queue, its
        blocks freed) or to end (FAILED); None when there is none to continue (a release
        of held blocks, a request finished meanwhile)."""
        rid = rec.request_id
        if rec.state is RequestState.RELEASED or rec.aborted:
            self.release_held(rid)  # exposed blocks, or a pull's aborted request
            return None
        seq = seq or self.waiting_for_kv.pop(rid, None)
        if seq is None or seq.is_finished:
            return None
        if rec.state is RequestState.RECOMPUTE:  # the prompt and first token, computed here
            self.free(seq)
            seq.status = SequenceStatus.WAITING
        elif rec.state is RequestState.RUNNING:  # the prompt's KV is in its blocks
            seq.num_computed = len(seq.prompt_ids)
            self.blocks.cache_blocks(seq.block_ids, seq.prompt_ids, seq.cache_salt)
            seq.status = SequenceStatus.RUNNING
        return seq

    def _next_chunk(self, seq: Sequence) -> tuple[list[int], int, int, int]:
        """A waiting sequence's next prefill chunk: (cached blocks it starts with, first
        token to compute, tokens to compute, blocks to allocate). Only a sequence not yet
        begun looks in the prefix cache, and its last token is always computed (its
        logits give the next token)."""
        hit = []
        if not seq.num_computed and not seq.block_ids:
            hit = self.blocks.match_prefix(
                seq.tokens(0, seq.num_tokens), seq.num_tokens - 1, seq.cache_salt
            )
        start = seq.num_computed + len(hit) * self.blocks.block_size
        qlen = min(seq.num_tokens - start, self.chunk)
        need = self.blocks.blocks_for(start + qlen) - len(seq.block_ids) - len(hit)
        return hit, start, qlen, need

    def schedule_would_idle(self) -> bool:
        """True if requests wait but none can run: nothing running, and the first waiting
        one's next chunk does not fit the free blocks. (Decodes always make progress.)"""
        if self.running or not self.waiting:
            return False
        hit, _, _, need = self._next_chunk(self.waiting[0])
        return not self.blocks.can_allocate(need + self.blocks.num_to_acquire(hit))

    def preempt(self, seq: Sequence) -> None:
        """Drop `seq`'s cache; it will be recomputed from its prompt and outputs so far."""
        self.running.remove(seq)
        self.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def after_step(self, step: ScheduledStep) -> None:
        """Advance num_computed; a sequence whose prompt is now cached starts decoding."""
        for seq, qlen in zip(step.seqs, step.query_lens, strict=True):
            seq.num_computed += qlen
            bs = self.blocks.block_size
            if seq.num_computed // bs > (seq.num_computed - qlen) // bs:  # a block filled
                self.blocks.cache_blocks(
                    seq.block_ids, seq.tokens(0, seq.num_computed), seq.cache_salt
                )
            if step.is_prefill and seq.num_computed == seq.num_tokens:
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)

    def finish(self, seq: Sequence, hold: bool = False) -> None:
        """Remove a finished or aborted sequence; free its blocks unless the connector
        holds them (`hold`: until it releases them, `release_held`)."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.waiting_for_kv.pop(seq.request_id, None)
        if hold:
            self.held[seq.request_id] = seq
        else:
            self.free(seq)
        seq.status = SequenceStatus.FINISHED

    def release_held(self, request_id: str) -> None:
        """The connector let go of a finished request's blocks: free them."""
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.free(seq)

    def free(self, seq: Sequence) -> None:
        """Give `seq`'s blocks back: the one place a request's blocks are freed."""
        if seq.block_ids:
            self.blocks.free(seq.block_ids)
            seq.block_ids = []
        seq.num_computed = 0
