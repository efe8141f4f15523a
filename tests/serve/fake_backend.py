"""A test double for the proxy's unit tests: deterministic words, optional failures.
The real prefill -> decode path is tested end to end beside it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvbridge.serve.backend import (
    Backend,
    BackendError,
    GenerateEvent,
    GenerateRequest,
    RequestStages,
)

WORDS = [" Paris", ".", " It", " is", " the", " capital", " of", " France", ".", " The"]


class FakeBackend(Backend):
    def __init__(self) -> None:
        self.model_name = "fake-model"
        self.seen: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.fail_after: int | None = None
        self.delay = 0.0
        self.max_output: int | None = None  # stop at this many tokens ("length")
        self.kv_load_error: str | None = None  # report a failed KV pull (recomputed)
        self.first_delay = 0.0  # before the first event (a prefill waiting its turn)
        self.full_retry_after: float | None = None  # refuse every request: all full

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        self.seen.append(request)
        prompt = request.prompt or ""
        if request.messages is not None:
            prompt = " ".join(m["content"] for m in request.messages)
        if request.prompt_token_ids is not None:
            prompt = " ".join(map(str, request.prompt_token_ids))
        if not prompt:
            raise BackendError("prompt is empty; send at least one token", 400, "prompt")
        if self.full_retry_after is not None:
            raise BackendError(
                "decode instance d holds 4 requests (--max-queued-requests 4); retry after 2 s",
                503,
                retry_after_s=self.full_retry_after,
            )
        n_prompt = len(prompt.split())
        finished = False
        try:
            await asyncio.sleep(self.first_delay)
            n = request.sampling.max_tokens
            if self.max_output is not None:
                n = min(n, self.max_output)
            for i in range(n):
                await asyncio.sleep(self.delay)
                if self.fail_after is not None and i == self.fail_after:
                    yield GenerateEvent(error="decode instance died")
                    finished = True
                    return
                word = WORDS[i % len(WORDS)]
                if word.strip() in request.sampling.stop:
                    yield GenerateEvent(
                        finish_reason="stop", prompt_tokens=n_prompt, completion_tokens=i
                    )
                    finished = True
                    return
                last = i == n - 1
                stages = RequestStages(kv_bytes=1000, transfer_ms=2.0)
                if self.kv_load_error is not None:
                    stages = RequestStages(kv_load_failed=True)
                yield GenerateEvent(
                    text=word,
                    token_ids=[100 + i],
                    finish_reason="length" if last else None,
                    prompt_tokens=n_prompt,
                    completion_tokens=i + 1,
                    stages=stages if last else RequestStages(),
                    kv_load_error=self.kv_load_error if last else None,
                )
            finished = True
        finally:
            if not finished:
                self.aborted.append(request.request_id)
