"""Continuous batching: which sequences run in the next step, and their blocks.

Policy (one step is either kind, like nano-vllm):
  * prefill first: the oldest waiting sequence gets its next chunk of at most
    `prefill_chunk_size` tokens, alone in the step, if its blocks can be allocated and
    fewer than `max_num_seqs` sequences are running;
  * otherwise every running sequence decodes one token; a sequence that needs a new block
    when none is free preempts the newest running sequence (its blocks are freed and it
    goes back to the front of the queue, to be recomputed).

With a KV connector (kvbridge.connector), at the start of each `schedule` a waiting
request whose prompt KV comes from another instance takes its local prefix-cache hit,
asks the connector how many tokens will come (`get_num_new_matched_tokens`), gets blocks
for them and hands them over (`update_state_after_alloc`); it then waits in
`waiting_for_kv` until the connector reports its pull ended. Blocks are given back in
one place, `free`: at a finish, a preemption, a failed load, or when the connector
releases the blocks it held (`held`: an exposed prefill, a decode aborted mid-pull).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvbridge.connector import KVConnectorScheduler, KVRequest
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
    """Owned by the LLMEngine; holds every unfinished sequence."""

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
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.waiting_for_kv: dict[str, Sequence] = {}  # blocks allocated, pull in flight
        self.held: dict[str, Sequence] = {}  # finished; the connector holds their blocks
        #: hand-overs that ended inside `schedule` (refused before pulling); the engine
        #: takes them (`take_ended_loads`)
        self._ended: list[tuple[Sequence, KVRequest]] = []

    def add(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.append(seq)  # its prompt KV is already in its blocks
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Whether a step has work (requests waiting for remote KV do not count)."""
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep | None:
        """The next step, or None if nothing can run (nothing queued)."""
        self.start_remote_loads()
        if self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
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
            # Otherwise it waits: decodes below may finish, or blocks kept for prefill-only
            # requests / reserved by allocate_blocks may be released by their owner.
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

    def start_remote_loads(self) -> None:
        """Waiting requests whose prompt KV comes from elsewhere: their cached prefix
        stays, blocks are allocated for the rest and the connector pulls into them (at
        least the last token: a prompt held whole is computed here, not pulled).
        `schedule` calls it first; the engine may call it earlier (a step that waits
        for the pulls it starts)."""
        kv = self.connector
        if kv is None:
            return
        bm = self.blocks
        for seq in [s for s in self.waiting if s.status is SequenceStatus.WAITING_FOR_REMOTE_KV]:
            self.waiting.remove(seq)
            rid, prompt = seq.request_id, seq.prompt_ids
            hit = bm.match_prefix(prompt, len(prompt) - 1, seq.cache_salt)
            num_external, load = kv.get_num_new_matched_tokens(rid, len(hit) * bm.block_size)
            if not load:  # nothing will come: recompute or fail (the connector's state)
                self._ended.append((seq, kv.pop_ended(rid)))
                continue
            bm.acquire(hit)  # held first: the allocation below cannot evict them
            try:
                fresh = bm.allocate(bm.blocks_for(len(prompt)) - len(hit))
            except OutOfBlocksError as exc:
                bm.free(hit)
                rec = kv.load_refused(rid, f"no free blocks to receive the KV: {exc}")
                self._ended.append((seq, rec))
                continue
            seq.block_ids = hit + fresh
            seq.num_cached_tokens = len(hit) * bm.block_size
            kv.update_state_after_alloc(rid, seq.block_ids, num_external)
            self.waiting_for_kv[rid] = seq

    def take_ended_loads(self) -> list[tuple[Sequence, KVRequest]]:
        out, self._ended = self._ended, []
        return out

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

    def finish(self, seq: Sequence, keep_blocks: bool = False, hold: bool = False) -> None:
        """Remove a finished or aborted sequence; free its blocks unless they are kept
        for the caller (`keep_blocks`: a prefill-only request without a connector) or
        the connector holds them (`hold`: until it releases them, `release_held`)."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.waiting_for_kv.pop(seq.request_id, None)
        if hold:
            self.held[seq.request_id] = seq
        elif not keep_blocks:
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
