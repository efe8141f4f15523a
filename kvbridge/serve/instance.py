"""A prefill or decode instance: one `LLMEngine` (with its tp workers and KV connector)
behind an internal HTTP API the proxy calls (`instance_app.py` has the routes).

`Instance` translates: an HTTP request becomes engine calls in the loop thread, the
engine's outputs become the caller's stream or result (`streams.py`). A request's
hand-over (expose, pull, decline, recompute or fail, freeing the blocks) lives in the
engine and its KV connector; an instance only says what the request asked for:
a prefill with `RemoteDecode(reader, start_token)`, a decode with the prefill instance's
`RemotePrefill` (its capability, checked by the connector: 403 when not valid here).

At most `max_queued_requests` requests (and reservations) are held at once; one more is
refused at once with 503 and Retry-After, without touching the engine (`admission.py`).
A caller that goes away stops its request: a prefill still queued or running is
dropped and its blocks freed, a stream is aborted (`disconnect.py`). A `request_id`
this instance still holds (running, streaming, or its blocks held by the connector) is
refused with 409; ids need be unique only while in use. Binds 127.0.0.1 unless told.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from kvbridge.connector import CapabilityRefused, RemoteDecode, RemotePrefill
from kvbridge.engine.llm_engine import Completion, LLMEngine
from kvbridge.errors import KVBridgeError
from kvbridge.serve import wire
from kvbridge.serve.admission import Admission, default_max_queued
from kvbridge.serve.backend import GenerateRequest
from kvbridge.serve.body_limit import DEFAULT_MAX_BODY_MB, mib_to_bytes
from kvbridge.serve.config import Role
from kvbridge.serve.engine_loop import EngineLoop
from kvbridge.serve.metrics import InstanceMetrics
from kvbridge.serve.streams import PendingPrefill, Stream

__all__ = ["Instance", "Refused"]


class Refused(KVBridgeError):
    """A request this instance refuses with HTTP `status` (4xx)."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class Instance:
    """The HTTP face of one engine. Owns the `EngineLoop` (and so the engine); the
    methods taking `engine` run in the loop thread (through `loop.call`)."""

    def __init__(
        self,
        loop: EngineLoop,
        role: Role,
        instance_id: str,
        model_name: str,
        max_body_bytes: int = mib_to_bytes(DEFAULT_MAX_BODY_MB),
        token: bytes | None = None,
        max_queued_requests: int | None = None,
    ) -> None:
        self.loop = loop
        self.role = role
        self.instance_id = instance_id
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.token = token  # requires signed calls (http_auth)
        self.endpoint = loop.engine.kv_endpoint  # the KV side channel (prefill)
        self.metrics = InstanceMetrics(instance_id, role.value)
        engine = loop.engine
        limit = max_queued_requests or default_max_queued(
            engine.block_manager.num_blocks, engine.config.max_num_seqs
        )
        self.admission = Admission(limit, f"{role.value} instance {instance_id}")
        self.metrics.max_queued.set(limit)

    # -- requests (loop thread) ---------------------------------------------------------
    def start_prefill(
        self, engine: LLMEngine, gen: GenerateRequest
    ) -> concurrent.futures.Future[wire.PrefillResult]:
        """Compute the prompt and first token; the engine exposes the KV for the reader."""
        self._claim(engine, gen.request_id)
        ids = self.prompt_ids(engine, gen)
        fut: concurrent.futures.Future[wire.PrefillResult] = concurrent.futures.Future()
        if engine.kv is not None:
            handover = RemoteDecode(gen.kv_reader or "", gen.kv_start_token)
            engine.add_request(
                ids,
                gen.sampling,
                gen.request_id,
                kv_transfer_params=handover,
                cache_salt=gen.cache_salt,
            )
        else:  # nothing to expose: the decode side computes the prompt
            engine.add_request(
                ids, gen.sampling, gen.request_id, prefill_only=True, cache_salt=gen.cache_salt
            )
        pending = PendingPrefill(fut, ids, self.instance_id, self._finished)
        self.loop.waiters[gen.request_id] = pending
        return fut

    def start_generate(self, engine: LLMEngine, req: wire.DecodeRequest, stream: Stream) -> None:
        """Decode a request: pull its KV from the prefill instance (`req.prefill`), or
        compute the prompt here (colocated; `prefill` None)."""
        gen, pf = req.request, req.prefill
        rid = gen.request_id
        self._claim(engine, rid)
        if pf is None:
            ids = self.prompt_ids(engine, gen)
            stream.prompt_tokens = len(ids)
            engine.add_request(ids, gen.sampling, rid, cache_salt=gen.cache_salt)
        elif engine.kv is None:  # nothing can be pulled here: compute prompt + first token
            sampling = gen.sampling.replace(max_tokens=max(gen.sampling.max_tokens - 1, 1))
            ids = [*pf.prompt_token_ids, pf.first_token_id]
            engine.add_request(ids, sampling, rid, cache_salt=gen.cache_salt)
        else:
            handover = pf.kv or RemotePrefill(pf.first_token_id)  # empty: nothing to pull
            try:
                engine.add_request(
                    pf.prompt_token_ids,
                    gen.sampling,
                    rid,
                    kv_transfer_params=handover,
                    cache_salt=gen.cache_salt,
                )
            except CapabilityRefused as exc:
                raise Refused(403, str(exc), code="capability_refused") from None
        self.loop.waiters[rid] = stream  # held from here on: its id is refused (409)

    def abort(self, engine: LLMEngine, rid: str, handle: Any) -> None:
        """The caller went away: stop its request (a no-op once it ended). `handle` is
        its stream or its prefill's future (the id may be in use by another request
        since). Blocks a pull still writes into are freed when the pull ends."""
        waiter = self.loop.waiters.get(rid)
        if waiter is not None and handle in (waiter, getattr(waiter, "future", None)):
            del self.loop.waiters[rid]
            engine.discard(rid)

    def cancel(self, engine: LLMEngine, rid: str, reason: str) -> bool:
        """Release a prefilled request's exposed KV now: no decode instance took it."""
        return engine.cancel_kv(rid, reason)

    def lookup(self, engine: LLMEngine, gen: GenerateRequest) -> wire.Lookup:
        hit = engine.lookup(self.prompt_ids(engine, gen), gen.cache_salt)
        held = self.admission.num_held
        return wire.Lookup(
            self.instance_id,
            hit.prompt_tokens,
            hit.cached_tokens,
            held,
            hit.kv_start_token,
            hit.holds_prompt,
        )

    def snapshot(self, engine: LLMEngine) -> None:
        """Fresh block and transfer figures for /metrics."""
        engine.poll_kv()  # handles the transfers' events first
        bm, m = engine.block_manager, self.metrics
        m.blocks_in_use.set(bm.num_blocks - bm.num_free_blocks)
        m.blocks_total.set(bm.num_blocks)
        m.blocks_cached_free.set(bm.num_cached_free_blocks)
        if engine.kv is not None:
            m.pinned_blocks.set(engine.kv.pinned_blocks)
            m.replays_refused.set(engine.kv.replays_refused)
            m.count_releases(engine.kv.releases)
            m.count_pull_failures(engine.kv.pull_failures)

    def _claim(self, engine: LLMEngine, rid: str) -> None:
        """Refuse an id this instance still holds (see the module docstring)."""
        if engine.has_request(rid) or rid in self.loop.waiters:
            raise Refused(
                409,
                f"request_id={rid!r} is in use on this instance (its request is running or "
                "still holds KV blocks); send a fresh id, or reuse it once that request ended",
                code="request_id_in_use",
            )

    def _finished(self, comp: Completion) -> None:
        """Count a finished request in the metrics (loop thread)."""
        m = self.metrics
        m.prefix_queries.inc()
        if comp.num_cached_tokens:
            m.prefix_hits.inc()
            m.prefix_hit_tokens.inc(comp.num_cached_tokens)
        if comp.kv_load_error is not None:
            m.load_failures.inc()
        if comp.kv_transfer_ms is not None:
            m.kv_bytes.inc(comp.kv_nbytes)
            m.kv_local_bytes.inc(comp.kv_local_nbytes)
            if comp.kv_load_error is None:
                spec = self.loop.engine.model_config.kv_spec(self.loop.engine.config.kv_dtype)
                m.kv_bytes_saved.inc(comp.num_cached_tokens * spec.bytes_per_token)

    @staticmethod
    def prompt_ids(engine: LLMEngine, gen: GenerateRequest) -> list[int]:
        try:
            if gen.prompt_token_ids is not None:
                return list(gen.prompt_token_ids)
            if gen.messages is not None:
                text = engine.tokenizer.apply_chat_template(
                    gen.messages, add_generation_prompt=True
                )
                return engine.tokenizer.encode(text)
            return engine.tokenizer.encode(gen.prompt or "")
        except KVBridgeError:
            raise
        except Exception as exc:  # a template or tokenizer refusing what it was given
            raise Refused(400, f"cannot build the prompt: {type(exc).__name__}: {exc}") from None

    def new_stream(self, prefill: wire.PrefillResult | None) -> Stream:
        """A stream for a generate request, on the calling event loop."""
        aloop = asyncio.get_running_loop()
        return Stream(aloop, asyncio.Queue(), self.instance_id, prefill, self._finished)
