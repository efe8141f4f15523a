"""The driver: requests in, tokens out.

`LLMEngine` owns the tokenizer, the block manager, the scheduler and an `Executor` (the
workers). Each `step()` runs one scheduled forward pass on every worker, samples on the
driver and returns what changed. `generate` and `stream` loop over `step()`.

Disaggregation seams (used by kvbridge.serve; the KV transfer itself is not here):
  * prefill side: `add_request(..., prefill_only=True)` (or `prefill()`) runs the prompt,
    samples the first token and finishes with FinishReason.PREFILLED, keeping the blocks
    allocated (`Completion.block_ids`) until `release_blocks(block_ids)`.
  * decode side: `allocate_blocks(num_tokens)` reserves blocks for an incoming prompt KV
    (`allocate_for_prompt(prompt_ids)` also takes the prompt's cached prefix, whose K/V
    need not come); once it has been written into them, `add_prefilled_request(
    prompt_ids, first_token, block_ids, params)` continues decoding from there (the
    request owns the blocks).

Prefix caching (`EngineConfig.enable_prefix_caching`, on by default): the full blocks of
every prompt and output are registered in the block manager's prefix cache as they are
computed, and a new request computes only what follows its longest cached prefix
(`Completion.num_cached_tokens`). Outputs are the same with and without it. A request's
`cache_salt` (vLLM's parameter) puts its blocks in a namespace of their own: only requests
with the same salt share them (`BlockManager.root`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvbridge.engine.block_manager import BlockManager
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.errors import EngineError, OutOfBlocksError, RequestError
from kvbridge.engine.executor import Executor, InProcessExecutor
from kvbridge.engine.sampling import SamplingParams, make_generator, sample
from kvbridge.engine.scheduler import Scheduler
from kvbridge.engine.sequence import FinishReason, Sequence, SequenceStatus
from kvbridge.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from kvbridge.engine.weights import Progress, open_weights, read_model_config, resolve_model
from kvbridge.transfer.connector import (
    ConnectorReply,
    ConnectorRequest,
    ConnectorRole,
    ConnectorSpec,
)

ExecutorFactory = Callable[..., Executor]


@dataclass(frozen=True)
class RequestOutput:
    """What one step changed for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    ttft_s: float
    total_s: float
    block_ids: list[int]  # non-empty only for a prefill-only request (blocks kept)
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache


class LLMEngine:
    """Not thread-safe: one thread calls add_request/step (the serving loop)."""

    def __init__(
        self,
        model: str = "smollm2-135m",
        config: EngineConfig | None = None,
        progress: Progress | None = None,
        executor_factory: ExecutorFactory | None = None,
        connector: ConnectorSpec | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.model_path = resolve_model(model)
        # Refuse a bad tp_size from the metadata alone, then build the weight cache once
        # before starting workers, so that they only memory-map it.
        self.config.check(read_model_config(self.model_path))
        self.model_config = open_weights(self.model_path, progress).config
        self.tokenizer = Tokenizer.load(self.model_path)
        self.eos_ids = set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_ids)
        self.max_model_len = self.config.model_len(self.model_config)
        if executor_factory is None:
            if self.config.tp_size == 1:
                executor_factory = InProcessExecutor
            else:
                from kvbridge.engine.shm_executor import ShmExecutor

                executor_factory = ShmExecutor
        self.connector = connector
        if connector is not None:  # each worker attaches the transfer runtime to its cache
            self.executor = executor_factory(
                self.model_path, self.config, progress, connector=connector
            )
        else:
            self.executor = executor_factory(self.model_path, self.config, progress)
        self.block_manager = BlockManager(
            self.executor.info.num_blocks,
            self.config.block_size,
            enable_prefix_caching=self.config.enable_prefix_caching,
            salt=self._cache_salt(),
        )
        self.scheduler = Scheduler(
            self.block_manager, self.config.max_num_seqs, self.config.prefill_chunk_size
        )
        self._seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()

    def _cache_salt(self) -> bytes:
        """What besides the tokens makes a block's bytes: the model file, the layout
        (tp, block size, axis order) and the dtype."""
        c = self.config
        return (
            f"{self.model_path.name}|{self.model_path.stat().st_size}|{c.layout().describe()}"
            f"|{c.kv_dtype}"
        ).encode()

    # ---- requests ----
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prefill_only: bool = False,
        cache_salt: str | None = None,
    ) -> str:
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        seq = self._new_seq(ids, params, request_id, prefill_only)
        seq.cache_salt = cache_salt
        self.scheduler.add(seq)
        return seq.request_id

    def add_prefilled_request(
        self,
        prompt_ids: list[int],
        first_token: int,
        block_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        num_cached_tokens: int = 0,
        cache_salt: str | None = None,
    ) -> str:
        """Decode a request whose prompt K/V already sits in `block_ids` (from
        `allocate_blocks` or `allocate_for_prompt`, whose cached tokens `num_cached_tokens`
        reports); its first token was sampled by the prefill instance. Its blocks join
        the prefix cache under `cache_salt` (the one `allocate_for_prompt` was given)."""
        params = params or SamplingParams()
        need = self.block_manager.blocks_for(len(prompt_ids))
        if len(block_ids) != need:
            raise RequestError(
                f"block_ids has {len(block_ids)} blocks but a prompt of "
                f"{len(prompt_ids)} tokens needs {need}"
            )
        seq = self._new_seq(list(prompt_ids), params, request_id, False)
        seq.block_ids = list(block_ids)
        seq.num_computed = len(prompt_ids)
        seq.num_cached_tokens = num_cached_tokens
        seq.cache_salt = cache_salt
        self.block_manager.cache_blocks(seq.block_ids, seq.prompt_ids, cache_salt)
        seq.status = SequenceStatus.RUNNING
        seq.first_token_time = time.perf_counter()
        self._append_token(seq, first_token)
        if not seq.is_finished:
            self.scheduler.add(seq)
        return seq.request_id

    def allocate_blocks(self, num_tokens: int) -> list[int]:
        """Blocks to receive a `num_tokens`-token prompt's K/V (OutOfBlocksError if full)."""
        return self.block_manager.allocate(self.block_manager.blocks_for(num_tokens))

    def allocate_for_prompt(
        self, prompt_ids: list[int], max_cached: int | None = None, cache_salt: str | None = None
    ) -> tuple[list[int], int]:
        """Blocks to receive a prompt's K/V, the first ones taken from the prefix cache
        under `cache_salt`: (block ids, number of leading tokens they hold already: a
        multiple of block_size, at most `max_cached`). OutOfBlocksError (nothing taken)
        if full."""
        bm = self.block_manager
        hit = bm.match_prefix(prompt_ids, max_cached, cache_salt)
        bm.acquire(hit)  # held first: the allocation below cannot evict them
        try:
            fresh = bm.allocate(bm.blocks_for(len(prompt_ids)) - len(hit))
        except OutOfBlocksError:
            bm.free(hit)
            raise
        return hit + fresh, len(hit) * bm.block_size

    def cached_prefix_len(self, prompt_ids: list[int], cache_salt: str | None = None) -> int:
        """How many leading tokens of `prompt_ids` the prefix cache holds now under
        `cache_salt` (whole blocks); a hint for routing, nothing is held."""
        hit = self.block_manager.match_prefix(prompt_ids, cache_salt=cache_salt)
        return len(hit) * self.block_manager.block_size

    def release_blocks(self, block_ids: list[int]) -> None:
        """Give back blocks kept by a prefill-only request or from `allocate_blocks`."""
        self.block_manager.free(block_ids)

    def connector_call(self, request: ConnectorRequest) -> list[ConnectorReply]:
        """Send `request` to every worker's KV connector; one reply per worker, in rank
        order (see kvbridge.transfer.connector)."""
        return self.executor.connector_call(request)

    @property
    def connector_polls_itself(self) -> bool:
        """Whether the workers progress their KV connector without "poll" calls."""
        return self.executor.connector_polls_itself

    @property
    def connector_needs_idle_polls(self) -> bool:
        """Whether the serving loop must poll the connector even with no transfer in
        flight: a producer answers handshakes and runs its leases in those polls, unless
        its workers poll themselves. An idle consumer has nothing to progress."""
        return (
            self.connector is not None
            and self.connector.role is ConnectorRole.PRODUCER
            and not self.connector_polls_itself
        )

    def is_finished(self, request_id: str) -> bool:
        """Whether the request has finished (its completion waits for `pop`)."""
        return self._seqs[request_id].is_finished

    def check_workers(self) -> None:
        """Raise WorkerError naming a worker process that has died, without waiting
        (a no-op for tp 1). Lets an idle server notice a dead worker."""
        self.executor.check_workers()

    def abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None and not seq.is_finished:
            self._finish(seq, FinishReason.ABORT)

    def _new_seq(
        self, ids: list[int], params: SamplingParams, request_id: str | None, prefill_only: bool
    ) -> Sequence:
        if not ids:
            raise RequestError("prompt is empty; give at least one token of text")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(ids)} tokens but max_model_len={self.max_model_len}; "
                f"shorten it to at most {self.max_model_len - 1} tokens"
            )
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt has {len(ids)} tokens and max_tokens={params.max_tokens}: together "
                f"{len(ids) + params.max_tokens} exceed the model's context of "
                f"max_model_len={self.max_model_len} tokens; ask for at most "
                f"max_tokens={self.max_model_len - len(ids)} or shorten the prompt"
            )
        blocks = self.block_manager.blocks_for(len(ids) + 1)
        if blocks > self.block_manager.num_blocks:
            raise RequestError(
                f"prompt of {len(ids)} tokens needs {blocks} KV blocks but the cache has "
                f"num_blocks={self.block_manager.num_blocks}; start with more blocks"
            )
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside [0, {self.model_config.vocab_size})")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._seqs and not self._seqs[rid].is_finished:
            raise RequestError(f"request_id={rid!r} is already running; use a fresh id")
        seq = Sequence(rid, ids, params, self.max_model_len, make_generator(params), prefill_only)
        self._seqs[rid] = seq
        self._detok[rid] = IncrementalDetokenizer(self.tokenizer)
        return seq

    # ---- the loop ----
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one forward step; the outputs of every request that got a token or finished."""
        step = self.scheduler.schedule()
        if step is None:
            return []
        logits = self.executor.execute(step.to_batch(self.config.block_size))
        self.scheduler.after_step(step)
        outputs = []
        row = 0
        for seq in step.seqs:
            if seq.num_computed < seq.num_tokens:
                continue  # a prefill chunk that did not reach the end: no logits
            before = len(seq.text)
            token = sample(logits[row], seq.params, seq.generator)
            row += 1
            if seq.first_token_time is None:
                seq.first_token_time = time.perf_counter()
            self._append_token(seq, token)
            outputs.append(
                RequestOutput(
                    seq.request_id, [token], seq.text[before:], seq.is_finished, seq.finish_reason
                )
            )
        return outputs

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.output_ids.append(token)
        is_eos = token in self.eos_ids and not seq.params.ignore_eos
        if not is_eos:
            seq.text += self._detok[seq.request_id].update(seq.output_ids)
        if seq.prefill_only:
            self._finish(seq, FinishReason.PREFILLED)
        elif is_eos or self._cut_at_stop(seq):
            self._finish(seq, FinishReason.STOP)
        elif len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= seq.max_len:
            self._finish(seq, FinishReason.LENGTH)

    def _cut_at_stop(self, seq: Sequence) -> bool:
        hits = [i for i in (seq.text.find(s) for s in seq.params.stop) if i >= 0]
        if hits:
            seq.text = seq.text[: min(hits)]
        return bool(hits)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self.scheduler.finish(seq, keep_blocks=reason is FinishReason.PREFILLED)

    # ---- conveniences ----
    def completion(self, request_id: str) -> Completion:
        seq = self._seqs[request_id]
        if not seq.is_finished or seq.finish_reason is None:
            raise EngineError(f"request {request_id} has not finished")
        end = seq.finish_time or time.perf_counter()
        first = seq.first_token_time or end
        kept = seq.block_ids if seq.finish_reason is FinishReason.PREFILLED else []
        return Completion(
            seq.request_id,
            seq.prompt_ids,
            list(seq.output_ids),
            seq.text,
            seq.finish_reason,
            first - seq.arrival_time,
            end - seq.arrival_time,
            list(kept),
            seq.num_cached_tokens,
        )

    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | None = None
    ) -> list[Completion]:
        """Run every prompt to completion, batched; results in prompt order."""
        rids = [self.add_request(p, params) for p in prompts]
        try:
            while any(not self._seqs[r].is_finished for r in rids):
                self._step_or_raise()
        except BaseException:
            for r in rids:  # a caller that got an exception does not expect them to go on
                self.abort(r)
                self._seqs.pop(r, None)
                self._detok.pop(r, None)
            raise
        return [self.pop(r) for r in rids]

    def _step_or_raise(self) -> list[RequestOutput]:
        """step(), for synchronous callers: nothing schedulable means nothing ever will be."""
        if self.scheduler.schedule_would_idle():
            bm = self.block_manager
            raise OutOfBlocksError(
                f"the next waiting request needs more KV blocks than the {bm.num_free_blocks} "
                f"free of {bm.num_blocks}, and nothing running will free any; release blocks "
                "kept by prefill-only requests or allocate_blocks (release_blocks)"
            )
        return self.step()

    def prefill(self, prompt: str | list[int], params: SamplingParams | None = None) -> Completion:
        """Prefill-only, synchronously: first token in token_ids, kept blocks in block_ids."""
        rid = self.add_request(prompt, params, prefill_only=True)
        while not self._seqs[rid].is_finished:
            self._step_or_raise()
        return self.pop(rid)

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield this request's outputs as they come (other requests keep running too)."""
        rid = self.add_request(prompt, params)
        try:
            while not self._seqs[rid].is_finished:
                for out in self._step_or_raise():
                    if out.request_id == rid:
                        yield out
        finally:
            if not self._seqs[rid].is_finished:
                self.abort(rid)
            self._seqs.pop(rid, None)
            self._detok.pop(rid, None)

    def pop(self, request_id: str) -> Completion:
        """The finished request's completion; forgets the request."""
        out = self.completion(request_id)
        del self._seqs[request_id]
        del self._detok[request_id]
        return out

    def shutdown(self) -> None:
        self.executor.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
