"""The driver: requests in, tokens out.

`LLMEngine` owns the tokenizer, the block manager, the scheduler and an `Executor` (the
workers). Each `step()` runs one scheduled forward pass on every worker, samples on the
driver and returns what changed. `generate` and `stream` loop over `step()`.

Disaggregation, with a KV connector (`connector=KVConnectorConfig`, kvbridge.connector):
a request's hand-over is given as its `kv_transfer_params` and lives in the engine:
  * prefill side: `add_request(ids, params, kv_transfer_params=RemoteDecode(reader,
    start_token))` computes the prompt and samples the first token; the engine's own
    finish checks (EOS unless `ignore_eos`, stop strings, max_tokens, the context) may
    end it there. Otherwise it finishes with FinishReason.PREFILLED, its KV exposed for
    the reader; `Completion.kv_transfer_params` is the `RemotePrefill` (signed
    capability, first token) to give the decode instance. The blocks stay until the
    reader pulled them, the lease expired or `cancel_kv` (then they are freed).
  * decode side: `add_request(ids, params, kv_transfer_params=RemotePrefill(...))` (a
    capability not valid here raises CapabilityRefused) keeps the prompt's cached prefix,
    pulls the rest and decodes; a failed pull recomputes the prompt here or ends the
    request with FinishReason.ERROR, by the connector's `kv_load_failure` policy.
  The connector's orders go to the workers in `step()` and `poll_kv()` (call it every
  `kv_poll_interval()` seconds when that is not None), which also collect the ended
  hand-overs; the workers' progress threads move the transfers in between. A decode
  step that starts pulls while others decode may wait for them (`JOIN_WAIT_OF_STEP`).
Without a connector, the seams a test or another transport uses by hand:
`add_request(..., prefill_only=True)` (or `prefill()`) keeps a prefill's blocks
(`Completion.block_ids`) until `release_blocks`; `allocate_blocks` /
`allocate_for_prompt` reserve blocks for an incoming prompt KV and
`add_prefilled_request` decodes from them.

Prefix caching (`EngineConfig.enable_prefix_caching`, on by default): the full blocks of
every prompt and output are registered in the block manager's prefix cache as they are
computed, and a new request computes only what follows its longest cached prefix
(`Completion.num_cached_tokens`). Outputs are the same with and without it. A request's
`cache_salt` (vLLM's parameter) puts its blocks in a namespace of their own: only requests
with the same salt share them (`BlockManager.root`).
"""

from __future__ import annotations

import collections
import itertools
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvbridge.connector import (
    BUSY_POLL_S,
    IDLE_POLL_S,
    ConnectorRole,
    KVConnectorConfig,
    KVConnectorScheduler,
    KVRequest,
    KVTransferParams,
    RemoteDecode,
    RemotePrefill,
    RequestState,
)
from kvbridge.engine.block_manager import BlockManager
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.errors import EngineError, OutOfBlocksError, RequestError
from kvbridge.engine.executor import Executor, InProcessExecutor
from kvbridge.engine.sampling import make_generator, sample
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.engine.scheduler import Scheduler
from kvbridge.engine.sequence import FinishReason, Sequence, SequenceStatus
from kvbridge.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from kvbridge.engine.weights import Progress, open_weights, read_model_config, resolve_model

ExecutorFactory = Callable[..., Executor]
#: A decode step about to start waits up to this share of the last decode step's time for
#: the pulls it starts (`LLMEngine._join_wait_s`). A request can only join a batch between
#: steps, so without the wait a pull that ends 40 ms into a step of 300 ms joins the step
#: after it: its second token comes a whole step later. The running requests pay the wait
#: (one pull's time, once per pulled request); the pulled one gains up to a step. When
#: the recent pulls (median of the last `RECENT_PULLS`) took longer than the wait allows
#: (a slow link, a prefill gone), a step does not wait: it would only delay the others.
JOIN_WAIT_OF_STEP = 0.5
RECENT_PULLS = 8
#: The longest such wait: the engine loop serves its other calls between steps.
JOIN_WAIT_MAX_S = 1.0
log = logging.getLogger("kvbridge.engine")


@dataclass(frozen=True)
class RequestOutput:
    """What one step changed for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    error: str | None = None  # with FinishReason.ERROR: why


@dataclass(frozen=True)
class PrefixHit:
    """What a decode instance holds of a prompt (a routing hint; nothing is held):
    `cached_tokens` leading tokens in whole cached blocks; a pull would start at
    `kv_start_token` (at least the last token is pulled); `holds_prompt`: every full
    block is cached, so this instance computes the rest itself and pulls nothing."""

    prompt_tokens: int
    cached_tokens: int
    kv_start_token: int
    holds_prompt: bool


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    ttft_s: float
    total_s: float
    block_ids: list[int]  # non-empty only for a prefill-only request without a connector
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    #: a prefill exposed for its reader: what the decode instance is given (RemotePrefill)
    kv_transfer_params: KVTransferParams | None = None
    kv_nbytes: int = 0  # KV bytes pulled for it (decode)
    kv_local_nbytes: int = 0  # ... and copied between decode workers on the host (fan-out)
    kv_transfer_ms: float | None = None  # how long its pull took (decode)
    kv_ready_ms: float | None = None  # the slowest decode worker's own time for it
    kv_load_error: str | None = None  # why its pull failed, if it did (decode)
    error: str | None = None  # with FinishReason.ERROR: why


class LLMEngine:
    """Not thread-safe: one thread calls add_request/step (the serving loop)."""

    def __init__(
        self,
        model: str = "smollm2-135m",
        config: EngineConfig | None = None,
        progress: Progress | None = None,
        executor_factory: ExecutorFactory | None = None,
        connector: KVConnectorConfig | None = None,
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
        if connector is not None:  # each worker attaches the connector to its cache
            self.executor = executor_factory(
                self.model_path, self.config, progress, connector=connector.spec
            )
        else:
            self.executor = executor_factory(self.model_path, self.config, progress)
        self.block_manager = BlockManager(
            self.executor.info.num_blocks,
            self.config.block_size,
            enable_prefix_caching=self.config.enable_prefix_caching,
            salt=self._cache_salt(),
        )
        self.kv: KVConnectorScheduler | None = None
        if connector is not None:
            endpoints = self.executor.kv_handshake_metadata()  # one per worker, rank order
            self.kv = KVConnectorScheduler(connector, self.config.block_size, len(endpoints))
            self.kv.set_worker_endpoints(endpoints)
        self.scheduler = Scheduler(
            self.block_manager,
            self.config.max_num_seqs,
            self.config.prefill_chunk_size,
            self.kv,
        )
        self._seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self._pending_outputs: list[RequestOutput] = []  # from calls between steps
        self._decode_step_s = 0.0  # the last decode step's forward (`_join_wait_s`)
        #: the workers' own time of the last pulls that ended (seconds; `_join_wait_s`)
        self._pull_s: collections.deque[float] = collections.deque(maxlen=RECENT_PULLS)
        # the workers learn their instance's endpoints now, before anyone can reach this
        # engine: a producer worker refuses handshakes until it knows them, and an idle
        # engine sends the connector's orders only at its first step or poll (a decode
        # instance introduced at start-up was refused, once per decode worker, until then)
        self._kv_flush(poll=False)

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
        kv_transfer_params: KVTransferParams | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request. With `kv_transfer_params` its hand-over goes through the
        connector (module docstring); CapabilityRefused if a decode request's capability
        is not valid here (nothing is held then)."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if kv_transfer_params is not None and self.kv is None:
            raise RequestError("kv_transfer_params given, but this engine has no KV connector")
        remote_decode = isinstance(kv_transfer_params, RemoteDecode)
        seq = self._new_seq(ids, params, request_id, prefill_only or remote_decode)
        seq.cache_salt = cache_salt  # its blocks are shared only with the same salt
        if self.kv is not None and kv_transfer_params is not None:
            try:
                self.kv.add_request(seq.request_id, ids, kv_transfer_params)
            except BaseException:
                self._forget(seq.request_id)
                raise
            seq.kv_params = kv_transfer_params
            if isinstance(kv_transfer_params, RemotePrefill):
                seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
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

    # ---- the KV connector ----
    def poll_kv(self) -> list[RequestOutput]:
        """Send the connector's pending orders to the workers, progress transfers and
        act on the hand-overs that ended; the outputs of requests that finished."""
        return self._kv_flush(poll=True)

    def kv_poll_interval(self) -> float | None:
        """How soon `poll_kv` is due: often while a transfer is in flight (to collect
        its outcome); for workers that do not progress their connectors on their own,
        also just after an introduction or a decline (the handshakes advance only in
        those polls) and now and then as an idle producer (it answers handshakes and
        runs leases in them); None when nothing needs it."""
        if self.kv is None:
            return None
        if self.kv.has_transfers:
            return BUSY_POLL_S
        if self.executor.connector_polls_itself:
            return None
        if time.monotonic() < self.kv.busy_until:
            return BUSY_POLL_S
        return IDLE_POLL_S if self.kv.role is ConnectorRole.PRODUCER else None

    @property
    def kv_endpoint(self) -> str:
        """A producer's side channel (worker 0's), which its capabilities name; else ""."""
        return self.kv.endpoint if self.kv is not None else ""

    def kv_state(self, request_id: str) -> RequestState | None:
        """The request's hand-over state while it is in flight (None otherwise)."""
        return self.kv.state(request_id) if self.kv is not None else None

    def cancel_kv(self, request_id: str, reason: str) -> bool:
        """Release an exposed prefill nobody will pull, now; False if not exposed."""
        if self.kv is None or not self.kv.cancel(request_id, reason):
            return False
        self._pending_outputs += self._kv_flush(poll=True)
        return True

    def connect_kv(self, endpoints: list[str], instance_ids: list[str] | None = None) -> list[str]:
        """Decode: meet producer instances before their first request (returns at once,
        with the endpoints every worker has met already: repeat until all have)."""
        if self.kv is None:
            raise RequestError("this engine has no KV connector")
        self.kv.connect(endpoints, instance_ids or ())
        self._pending_outputs += self._kv_flush(poll=False)
        return [e for e in endpoints if e in self.kv.connected]

    def lookup(self, prompt_ids: list[int], cache_salt: str | None = None) -> PrefixHit:
        """What this engine's prefix cache holds of a prompt now under `cache_salt`, and
        where a pull of it would start (see PrefixHit)."""
        bs = self.block_manager.block_size
        n = len(prompt_ids)
        cached = self.cached_prefix_len(prompt_ids, cache_salt)
        start = min(cached, (n - 1) // bs * bs) if n else 0
        return PrefixHit(n, cached, start, 0 < cached == n // bs * bs)

    def has_request(self, request_id: str) -> bool:
        """Whether the id is in use: queued, running, finished but not popped, or its
        blocks still held by the connector (exposed, or a pull ending)."""
        return request_id in self._seqs or request_id in self.scheduler.held

    def _kv_flush(self, poll: bool, recv_wait_s: float = 0.0) -> list[RequestOutput]:
        kv = self.kv
        if kv is None:
            return []
        meta = kv.build_connector_meta(recv_wait_s)
        if meta.is_empty and not poll:
            return []
        ended = kv.update_connector_output(self.executor.kv_step(meta))
        for error in kv.errors:
            log.warning("KV connector: %s", error)
        outputs = []
        for rec in ended:
            out = self._kv_ended(rec)
            if out is not None:
                outputs.append(out)
        return outputs

    def _kv_ended(self, rec: KVRequest, seq: Sequence | None = None) -> RequestOutput | None:
        """A request's hand-over ended: give back, or use, its blocks."""
        rid = rec.request_id
        if rec.state is RequestState.RELEASED or rec.aborted:
            self.scheduler.release_held(rid)  # exposed blocks, or a pull's aborted request
            return None
        seq = seq or self.scheduler.waiting_for_kv.pop(rid, None)
        if seq is None or seq.is_finished:
            return None
        seq.kv_nbytes, seq.kv_transfer_ms = rec.nbytes, rec.transfer_ms
        seq.kv_local_nbytes = rec.local_nbytes
        seq.kv_ready_ms = rec.worker_ms
        if rec.worker_ms:  # (0: refused before any worker began)
            self._pull_s.append(rec.worker_ms / 1e3)
        first = rec.first_token_id
        assert first is not None
        if rec.state is RequestState.FAILED:
            seq.kv_load_error = rec.reason
            seq.error = f"KV cache load failed: {rec.reason}"
            self._finish(seq, FinishReason.ERROR)
            return RequestOutput(rid, [], "", True, FinishReason.ERROR, seq.error)
        if rec.state is RequestState.RECOMPUTE:  # the prompt and first token, computed here
            seq.kv_load_error = rec.reason
            self.scheduler.free(seq)
            seq.status = SequenceStatus.WAITING
        else:  # RUNNING: the prompt's KV is in its blocks
            seq.num_computed = len(seq.prompt_ids)
            self.block_manager.cache_blocks(seq.block_ids, seq.prompt_ids, seq.cache_salt)
            seq.status = SequenceStatus.RUNNING
            seq.first_token_time = time.perf_counter()
        self._append_token(seq, first)  # sampled by the prefill instance (already sent)
        if seq.is_finished:  # the first token filled the context: no step will come
            return RequestOutput(rid, [], "", True, seq.finish_reason)
        self.scheduler.add(seq)
        return None

    @property
    def connector_polls_itself(self) -> bool:
        """Whether the workers progress their KV connector without `poll_kv` calls."""
        return self.executor.connector_polls_itself

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
        if rid in self.scheduler.held:
            raise RequestError(
                f"request_id={rid!r} still holds KV blocks (exposed, or its pull ending); "
                "use a fresh id"
            )
        seq = Sequence(rid, ids, params, self.max_model_len, make_generator(params), prefill_only)
        self._seqs[rid] = seq
        self._detok[rid] = IncrementalDetokenizer(self.tokenizer)
        return seq

    # ---- the loop ----
    def has_unfinished(self) -> bool:
        """Whether `step()` has work (requests waiting for their KV wait in `poll_kv`)."""
        return self.scheduler.has_unfinished() or bool(self._pending_outputs)

    def step(self) -> list[RequestOutput]:
        """Run one forward step; the outputs of every request that got a token or finished."""
        outputs, self._pending_outputs = self._pending_outputs, []
        wait = self._join_wait_s()
        if wait:  # pulls that end within `wait` join this step's decodes, not the next
            self.scheduler.start_remote_loads()
            outputs += self._take_ended_loads()
            outputs += self._kv_flush(poll=False, recv_wait_s=wait)
        step = self.scheduler.schedule()
        outputs += self._take_ended_loads()
        outputs += self._kv_flush(poll=False)  # start the pulls allocated just now
        if step is None:
            return outputs
        began = time.perf_counter()
        logits = self.executor.execute(step.to_batch(self.config.block_size))
        if not step.is_prefill:
            self._decode_step_s = time.perf_counter() - began
        self.scheduler.after_step(step)
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
        outputs += self._kv_flush(poll=False)  # expose the prefills that finished now
        return outputs

    def _take_ended_loads(self) -> list[RequestOutput]:
        """Requests whose pull was refused before it began (no blocks, no KV to come)."""
        outputs = []
        for seq, rec in self.scheduler.take_ended_loads():
            out = self._kv_ended(rec, seq)
            if out is not None:
                outputs.append(out)
        return outputs

    def _join_wait_s(self) -> float:
        """How long this step waits for the pulls it is about to start: with decodes
        running and only pulled requests waiting, up to `JOIN_WAIT_OF_STEP` of the last
        decode step (at most `JOIN_WAIT_MAX_S`), so a pull that ends by then joins this
        step instead of the next one; 0 when there is nothing to join, when the workers
        do not progress their pulls by themselves (nothing would move while we wait) or
        when recent pulls took longer than the wait."""
        sched = self.scheduler
        if (
            self.kv is None
            or not self._decode_step_s
            or not sched.running
            or not sched.waiting
            or not self.executor.connector_polls_itself
            or any(s.status is not SequenceStatus.WAITING_FOR_REMOTE_KV for s in sched.waiting)
        ):
            return 0.0
        wait = min(JOIN_WAIT_OF_STEP * self._decode_step_s, JOIN_WAIT_MAX_S)
        if self._pull_s and statistics.median(self._pull_s) > wait:
            return 0.0
        return wait

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.output_ids.append(token)
        is_eos = token in self.eos_ids and not seq.params.ignore_eos
        if not is_eos:
            seq.text += self._detok[seq.request_id].update(seq.output_ids)
        # a prefill's first token is judged like any other: it may finish the request
        if is_eos or self._cut_at_stop(seq):
            self._finish(seq, FinishReason.STOP)
        elif len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= seq.max_len:
            self._finish(seq, FinishReason.LENGTH)
        elif seq.prefill_only:
            self._finish(seq, FinishReason.PREFILLED)

    def _cut_at_stop(self, seq: Sequence) -> bool:
        hits = [i for i in (seq.text.find(s) for s in seq.params.stop) if i >= 0]
        if hits:
            seq.text = seq.text[: min(hits)]
        return bool(hits)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        hold = False
        if self.kv is not None and seq.kv_params is not None:
            first = seq.output_ids[0] if seq.output_ids else None
            done = reason is not FinishReason.PREFILLED
            hold, seq.kv_transfer_params = self.kv.request_finished(
                seq.request_id, seq.block_ids, first, done
            )
        keep = reason is FinishReason.PREFILLED and seq.kv_params is None
        self.scheduler.finish(seq, keep_blocks=keep, hold=hold)

    # ---- conveniences ----
    def completion(self, request_id: str) -> Completion:
        seq = self._seqs[request_id]
        if not seq.is_finished or seq.finish_reason is None:
            raise EngineError(f"request {request_id} has not finished")
        end = seq.finish_time or time.perf_counter()
        first = seq.first_token_time or end
        prefilled = seq.finish_reason is FinishReason.PREFILLED and seq.kv_params is None
        kept = seq.block_ids if prefilled else []
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
            seq.kv_transfer_params,
            seq.kv_nbytes,
            seq.kv_local_nbytes,
            seq.kv_transfer_ms,
            seq.kv_ready_ms,
            seq.kv_load_error,
            seq.error,
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
        """The finished request's completion; forgets the request (blocks the connector
        still holds stay until it releases them)."""
        out = self.completion(request_id)
        self._forget(request_id)
        return out

    def discard(self, request_id: str) -> None:
        """Stop a request if it runs and forget it (no completion wanted); a no-op for
        an unknown id. Blocks its connector still holds stay until released."""
        if request_id in self._seqs:
            self.abort(request_id)
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
        self._detok.pop(request_id, None)

    def shutdown(self) -> None:
        self.executor.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
