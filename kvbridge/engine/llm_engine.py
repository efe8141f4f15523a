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
  step that starts pulls while others decode may wait for them (`kv_host.py`).
Without a connector, `add_request(..., prefill_only=True)` computes the prompt and its
first token only (FinishReason.PREFILLED; its blocks are freed, nothing is exposed).

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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvbridge.connector import (
    KVConnectorConfig,
    KVConnectorScheduler,
    KVRequest,
    KVTransferParams,
    RemoteDecode,
    RemotePrefill,
    RequestState,
)
from kvbridge.engine.block_manager import BlockManager
from kvbridge.engine.config import EngineConfig, ModelConfig
from kvbridge.engine.errors import EngineError, OutOfBlocksError, RequestError
from kvbridge.engine.executor import Executor, InProcessExecutor
from kvbridge.engine.kv_host import KVHost
from kvbridge.engine.sampling import make_generator, sample
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.engine.scheduler import Scheduler
from kvbridge.engine.sequence import FinishReason, Sequence, SequenceStatus
from kvbridge.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from kvbridge.engine.weights import Progress, open_weights, read_model_config, resolve_model
from kvbridge.settings import DEFAULT_MODEL

ExecutorFactory = Callable[..., Executor]


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
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    #: a prefill exposed for its reader: what the decode instance is given (RemotePrefill)
    kv_transfer_params: KVTransferParams | None = None
    kv_nbytes: int = 0  # KV bytes pulled for it (decode)
    kv_local_nbytes: int = 0  # ... and copied between decode workers on the host (fan-out)
    kv_transfer_ms: float | None = None  # how long its pull took (decode)
    kv_ready_ms: float | None = None  # the slowest decode worker's own time for it
    kv_handshakes: int = 0  # decode workers whose pull waited for a handshake
    kv_cold_peers: int = 0  # paths to producer workers its pull's READs crossed first
    kv_load_error: str | None = None  # why its pull failed, if it did (decode)
    error: str | None = None  # with FinishReason.ERROR: why


class LLMEngine:
    """Not thread-safe: one thread calls add_request/step (the serving loop)."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
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
            salt=_cache_salt(self.model_path, self.config),
        )
        self.kv: KVConnectorScheduler | None = None  # the connector's scheduler side
        self._kv_host: KVHost | None = None
        if connector is not None:
            endpoints = self.executor.kv_handshake_metadata()  # one per worker, rank order
            self.kv = KVConnectorScheduler(connector, self.config.block_size, len(endpoints))
            self.kv.set_worker_endpoints(endpoints)
            self._kv_host = KVHost(self.kv, self.executor)
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
        # the workers learn their instance's endpoints now, before anyone can reach this
        # engine: a producer worker refuses handshakes until it knows them, and an idle
        # engine sends the connector's orders only at its first step or poll (a decode
        # instance introduced at start-up was refused, once per decode worker, until then)
        self._kv_flush()

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
        _check_prompt(ids, params, self.max_model_len, self.block_manager, self.model_config)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._seqs and not self._seqs[rid].is_finished:
            raise RequestError(f"request_id={rid!r} is already running; use a fresh id")
        if rid in self.scheduler.held:
            raise RequestError(
                f"request_id={rid!r} still holds KV blocks (exposed, or its pull ending); "
                "use a fresh id"
            )
        prefill_only = prefill_only or isinstance(kv_transfer_params, RemoteDecode)
        seq = Sequence(rid, ids, params, self.max_model_len, make_generator(params), prefill_only)
        seq.cache_salt = cache_salt  # its blocks are shared only with the same salt
        self._seqs[rid] = seq
        self._detok[rid] = IncrementalDetokenizer(self.tokenizer)
        if self.kv is not None and kv_transfer_params is not None:
            try:
                self.kv.add_request(rid, ids, kv_transfer_params)
            except BaseException:
                self._forget(rid)
                raise
            seq.kv_params = kv_transfer_params
            if isinstance(kv_transfer_params, RemotePrefill):
                seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None and not seq.is_finished:
            self._finish(seq, FinishReason.ABORT)

    def is_finished(self, request_id: str) -> bool:
        """Whether the request has finished (its completion waits for `pop`)."""
        return self._seqs[request_id].is_finished

    def lookup(self, prompt_ids: list[int], cache_salt: str | None = None) -> PrefixHit:
        """What this engine's prefix cache holds of a prompt now under `cache_salt`, and
        where a pull of it would start (see PrefixHit)."""
        bs = self.block_manager.block_size
        n = len(prompt_ids)
        # whole blocks; a hint for routing, nothing is held
        cached = len(self.block_manager.match_prefix(prompt_ids, cache_salt=cache_salt)) * bs
        start = min(cached, (n - 1) // bs * bs) if n else 0
        return PrefixHit(n, cached, start, 0 < cached == n // bs * bs)

    def has_request(self, request_id: str) -> bool:
        """Whether the id is in use: queued, running, finished but not popped, or its
        blocks still held by the connector (exposed, or a pull ending)."""
        return request_id in self._seqs or request_id in self.scheduler.held

    # ---- the KV connector ----
    def poll_kv(self) -> list[RequestOutput]:
        """Send the connector's pending orders to the workers, progress transfers and
        act on the hand-overs that ended; the outputs of requests that finished."""
        return self._kv_flush(poll=True)

    def kv_poll_interval(self) -> float | None:
        """How soon `poll_kv` is due (`KVHost.poll_interval`); None when nothing needs
        it, or without a connector."""
        return self._kv_host.poll_interval() if self._kv_host is not None else None

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

    def _kv_flush(
        self,
        poll: bool = False,
        recv_wait_s: float = 0.0,
        refused: Iterable[tuple[Sequence, KVRequest]] = (),
    ) -> list[RequestOutput]:
        """Act on the loads `start_remote_loads` ended at once (`refused`), then send
        the connector's orders to the workers and act on the hand-overs they ended
        (`KVHost.flush`); the outputs of the requests that finished."""
        outputs = [out for seq, rec in refused if (out := self._kv_ended(rec, seq)) is not None]
        if self._kv_host is not None:
            records = self._kv_host.flush(poll, recv_wait_s)
            outputs += [out for rec in records if (out := self._kv_ended(rec)) is not None]
        return outputs

    def _kv_ended(self, rec: KVRequest, seq: Sequence | None = None) -> RequestOutput | None:
        """A request's hand-over ended: the scheduler frees or uses its blocks
        (`Scheduler.load_ended`); a decode request continues from the prefill's first
        token, or ends."""
        seq = self.scheduler.load_ended(rec, seq)
        if seq is None:
            return None
        assert self._kv_host is not None  # (a record comes from the connector)
        seq.kv_nbytes, seq.kv_transfer_ms = rec.nbytes, rec.transfer_ms
        seq.kv_local_nbytes = rec.local_nbytes
        seq.kv_ready_ms = rec.worker_ms
        seq.kv_handshakes, seq.kv_cold_peers = rec.handshakes, rec.cold_peers
        self._kv_host.pulled(rec)
        first = rec.first_token_id
        assert first is not None
        if rec.state is RequestState.FAILED:
            seq.kv_load_error = rec.reason
            seq.error = f"KV cache load failed: {rec.reason}"
            self._finish(seq, FinishReason.ERROR)
            return RequestOutput(rec.request_id, [], "", True, FinishReason.ERROR, seq.error)
        if rec.state is RequestState.RECOMPUTE:  # the prompt and first token, computed here
            seq.kv_load_error = rec.reason
        else:  # RUNNING: the prompt's KV is in its blocks
            seq.first_token_time = time.perf_counter()
        self._append_token(seq, first)  # sampled by the prefill instance (already sent)
        if seq.is_finished:  # the first token filled the context: no step will come
            return RequestOutput(rec.request_id, [], "", True, seq.finish_reason)
        self.scheduler.add(seq)
        return None

    # ---- the loop ----
    def has_unfinished(self) -> bool:
        """Whether `step()` has work (requests waiting for their KV wait in `poll_kv`)."""
        return self.scheduler.has_unfinished() or bool(self._pending_outputs)

    def check_workers(self) -> None:
        """Raise WorkerError naming a worker process that has died, without waiting
        (a no-op for tp 1). Lets an idle server notice a dead worker."""
        self.executor.check_workers()

    def step(self) -> list[RequestOutput]:
        """Run one forward step; the outputs of every request that got a token or finished.

        The connector's orders go out twice at most: before the forward (the pulls
        allocated for it) and after it (the prefills it finished, exposed)."""
        outputs, self._pending_outputs = self._pending_outputs, []
        host = self._kv_host
        wait = host.join_wait_s(self.scheduler) if host is not None else 0.0
        refused = self.scheduler.start_remote_loads()
        if wait:  # pulls that end within `wait` join this step's decodes, not the next
            outputs += self._kv_flush(recv_wait_s=wait, refused=refused)
            step = self.scheduler.schedule()
        else:  # the requests a flush brings back join the next step
            step = self.scheduler.schedule()
            outputs += self._kv_flush(refused=refused)  # start the pulls allocated just now
        if step is None:
            return outputs
        began = time.perf_counter()
        logits = self.executor.execute(step.to_batch(self.config.block_size))
        if host is not None and not step.is_prefill:
            host.decode_step_s = time.perf_counter() - began
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
        outputs += self._kv_flush()  # expose the prefills that finished now
        return outputs

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.output_ids.append(token)
        is_eos = token in self.eos_ids and not seq.params.ignore_eos
        if not is_eos:
            seq.text += self._detok[seq.request_id].update(seq.output_ids)
        # a prefill's first token is judged like any other: it may finish the request
        if is_eos or seq.cut_at_stop():
            self._finish(seq, FinishReason.STOP)
        elif len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= seq.max_len:
            self._finish(seq, FinishReason.LENGTH)
        elif seq.prefill_only:
            self._finish(seq, FinishReason.PREFILLED)

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
        self.scheduler.finish(seq, hold=hold)

    # ---- conveniences ----
    def completion(self, request_id: str) -> Completion:
        seq = self._seqs[request_id]
        if not seq.is_finished or seq.finish_reason is None:
            raise EngineError(f"request {request_id} has not finished")
        end = seq.finish_time or time.perf_counter()
        first = seq.first_token_time or end
        return Completion(
            seq.request_id,
            seq.prompt_ids,
            list(seq.output_ids),
            seq.text,
            seq.finish_reason,
            first - seq.arrival_time,
            end - seq.arrival_time,
            seq.num_cached_tokens,
            seq.kv_transfer_params,
            seq.kv_nbytes,
            seq.kv_local_nbytes,
            seq.kv_transfer_ms,
            seq.kv_ready_ms,
            seq.kv_handshakes,
            seq.kv_cold_peers,
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
                f"free of {bm.num_blocks}, and nothing running will free any; blocks the KV "
                "connector holds come back when it releases them (poll_kv), else start the "
                "engine with more blocks (num_blocks / kv_cache_mb)"
            )
        return self.step()

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


def _cache_salt(model_path: Path, config: EngineConfig) -> bytes:
    """What besides the tokens makes a block's bytes: the model file, the layout (tp,
    block size, axis order) and the dtype."""
    return (
        f"{model_path.name}|{model_path.stat().st_size}|{config.layout().describe()}"
        f"|{config.kv_dtype}"
    ).encode()


def _check_prompt(
    ids: list[int],
    params: SamplingParams,
    max_model_len: int,
    bm: BlockManager,
    model_config: ModelConfig,
) -> None:
    """Refuse (RequestError) a prompt this engine cannot run, naming what would fit."""
    if not ids:
        raise RequestError("prompt is empty; give at least one token of text")
    if len(ids) >= max_model_len:
        raise RequestError(
            f"prompt has {len(ids)} tokens but max_model_len={max_model_len}; "
            f"shorten it to at most {max_model_len - 1} tokens"
        )
    if len(ids) + params.max_tokens > max_model_len:
        raise RequestError(
            f"prompt has {len(ids)} tokens and max_tokens={params.max_tokens}: together "
            f"{len(ids) + params.max_tokens} exceed the model's context of "
            f"max_model_len={max_model_len} tokens; ask for at most "
            f"max_tokens={max_model_len - len(ids)} or shorten the prompt"
        )
    blocks = bm.blocks_for(len(ids) + 1)
    if blocks > bm.num_blocks:
        raise RequestError(
            f"prompt of {len(ids)} tokens needs {blocks} KV blocks but the cache has "
            f"num_blocks={bm.num_blocks}; start with more blocks"
        )
    bad = [t for t in ids if not 0 <= t < model_config.vocab_size]
    if bad:
        raise RequestError(f"token id {bad[0]} is outside [0, {model_config.vocab_size})")
