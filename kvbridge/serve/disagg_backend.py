"""The proxy's backend for disaggregated serving: prefill on one instance, decode on another.

    proxy ──GenerateRequest──▶ prefill instance   (prompt KV + first token, blocks exposed)
          ◀──PrefillResult───  (first token streamed to the client at once)
          ──DecodeRequest───▶ decode instance    (pulls the KV over NIXL, decodes)
          ◀──NDJSON events───

Instances are chosen round-robin. With no prefill instance, or when the prefill
instance cannot be reached and `recompute_on_failure` is set, the decode instance
computes the whole request itself (colocated), so the answer is still correct.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncGenerator, Sequence

import httpx
import msgspec

from kvbridge.serve import wire
from kvbridge.serve.backend import Backend, BackendError, GenerateEvent, GenerateRequest

log = logging.getLogger("kvbridge.serve")


class DisaggBackend(Backend):
    """Routes each request to a prefill instance, then a decode instance (HTTP)."""

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        model_name: str,
        *,
        recompute_on_failure: bool = True,
        timeout_s: float = 300.0,
    ) -> None:
        if not decode_urls:
            raise BackendError("at least one decode instance is needed", 500)
        self.prefill_urls = list(prefill_urls)
        self.decode_urls = list(decode_urls)
        self.model_name = model_name
        self.recompute_on_failure = recompute_on_failure
        self._prefill_rr = itertools.cycle(self.prefill_urls) if self.prefill_urls else None
        self._decode_rr = itertools.cycle(self.decode_urls)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    async def _prefill(self, url: str, request: GenerateRequest) -> wire.PrefillResult:
        try:
            resp = await self._client.post(
                f"{url}/internal/prefill",
                content=msgspec.json.encode(request),
                headers={"content-type": "application/json"},
            )
        except httpx.HTTPError as exc:
            raise BackendError(f"prefill instance {url} is unreachable: {exc!r}", 503) from None
        if resp.status_code != 200:
            raise BackendError(_message(resp), 400 if resp.status_code < 500 else 503)
        return wire.prefill_result_decoder.decode(resp.content)

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateEvent, None]:
        prefill: wire.PrefillResult | None = None
        if self._prefill_rr is not None:
            url = next(self._prefill_rr)
            try:
                prefill = await self._prefill(url, request)
            except BackendError as exc:
                if exc.status != 503 or not self.recompute_on_failure:
                    raise
                log.warning("%s; the decode instance computes the prompt instead", exc)
        if prefill is not None:
            done = prefill.finish_reason is not None
            yield GenerateEvent(
                text=prefill.first_text,
                token_ids=[prefill.first_token_id],
                finish_reason=prefill.finish_reason,
                prompt_tokens=len(prefill.prompt_token_ids),
                completion_tokens=1,
                stages={"prefill_ms": prefill.prefill_ms} if done else {},
            )
            if done:
                return
        url = next(self._decode_rr)
        body = msgspec.json.encode(wire.DecodeRequest(request, prefill))
        try:
            async with self._client.stream(
                "POST",
                f"{url}/internal/generate",
                content=body,
                headers={"content-type": "application/json"},
            ) as r:
                if r.status_code != 200:
                    await r.aread()
                    if prefill is None:
                        raise BackendError(_message(r), 400 if r.status_code < 500 else 503)
                    yield GenerateEvent(error=_message(r))
                    return
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    ev = wire.event_decoder.decode(line)
                    yield ev
                    if ev.finish_reason or ev.error:
                        return
            yield GenerateEvent(error=f"decode instance {url} ended the stream early")
        except httpx.HTTPError as exc:
            message = f"decode instance {url} failed: {exc!r}"
            if prefill is None:
                raise BackendError(message, 503) from None
            yield GenerateEvent(error=message)

    async def health(self) -> dict[str, object]:
        states: dict[str, object] = {}
        ok = True
        for url in self.prefill_urls + self.decode_urls:
            try:
                r = await self._client.get(f"{url}/health", timeout=5.0)
                states[url] = r.json()
                ok &= r.status_code == 200
            except httpx.HTTPError as exc:
                states[url] = {"status": "unreachable", "reason": repr(exc)}
                ok = False
        return {"status": "ok" if ok else "degraded", "instances": states}

    async def instance_metrics(self) -> str:
        parts = []
        for url in self.prefill_urls + self.decode_urls:
            try:
                r = await self._client.get(f"{url}/metrics", timeout=5.0)
                if r.status_code == 200:
                    parts.append(r.text)
            except httpx.HTTPError:
                parts.append(f'kvbridge_instance_up{{url="{url}"}} 0\n')
        return "".join(parts)

    async def close(self) -> None:
        await self._client.aclose()


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except Exception:
        return f"HTTP {resp.status_code}: {resp.text[:200]}"
