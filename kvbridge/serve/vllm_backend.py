"""The proxy's backend over vLLM instances: vLLM's two-step P/D request.

vLLM disaggregates through a KV connector (KVBridgeConnector, or any connector speaking
vLLM's `kv_transfer_params`): a proxy sends each request to a prefill instance with
`kv_transfer_params` {"do_remote_decode": true} and one output token, then to a decode
instance with the `kv_transfer_params` the prefill returned; the decode instance pulls
the prompt's KV and generates every output token (its first one is the prefill's, token
for token). `VLLMBackend` makes those two calls for the proxy (`proxy.make_app`), so a
vLLM deployment gets kvbridge's OpenAI front: validated requests and OpenAI-shaped
errors, API keys, prefix-cache isolation (`cache_salt`, vLLM's own parameter), body
limits, streaming, metrics (TTFT and TPOT from the token ids vLLM streams back, each
instance's own /metrics appended).

Requests go to the instances in turn (round-robin over each role's URLs). A prefill
instance that fails or cannot be reached before it answered is skipped for the next
one; with none left, the decode instance computes the prompt itself when
`recompute_on_failure` (the proxy's `--kv-load-failure recompute`), else the client
gets the 503 naming each cause. What a failed pull does is vLLM's
`kv_load_failure_policy`, set on the decode instance.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import httpx

from kvbridge.connector.metadata import RemoteDecode, encode_transfer_params
from kvbridge.serve.backend import (
    Backend,
    BackendError,
    GenerateEvent,
    GenerateRequest,
    RequestStages,
)
from kvbridge.serve.metrics import with_label

#: Longest a prefill call or the wait for the decode's next chunk may take (seconds).
READ_TIMEOUT_S = 300.0
#: Connecting to an instance (seconds).
CONNECT_TIMEOUT_S = 5.0


def vllm_body(request: GenerateRequest, model: str) -> dict[str, Any]:
    """The OpenAI body vLLM takes for `request` (its own extensions: `ignore_eos`,
    `top_k`, `cache_salt`, `return_token_ids`)."""
    s = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "return_token_ids": True,
    }
    if request.messages is not None:
        body["messages"] = request.messages
    elif request.prompt_token_ids is not None:
        body["prompt"] = request.prompt_token_ids
    else:
        body["prompt"] = request.prompt
    if s.top_k:
        body["top_k"] = s.top_k
    if s.seed is not None:
        body["seed"] = s.seed
    if s.stop:
        body["stop"] = list(s.stop)
    if s.ignore_eos:
        body["ignore_eos"] = True
    if request.cache_salt is not None:
        body["cache_salt"] = request.cache_salt
    return body


def _error_message(r: httpx.Response) -> str:
    """The message of vLLM's (OpenAI-shaped) error body, else the body's start."""
    try:
        err = r.json().get("error", {})
        message = err.get("message") if isinstance(err, dict) else None
    except (ValueError, AttributeError):
        message = None
    return str(message or r.text[:500] or f"HTTP {r.status_code}")


class VLLMBackend(Backend):
    """Owned by the proxy process (`proxy_main.proxy_app` with `Engine.VLLM`); called
    from its event loop for many requests at once. Each request costs one prefill call
    (`max_tokens` 1, not streamed) and one streamed decode call; a client that goes away
    closes the decode stream, which aborts the request in vLLM. Clients name the model
    as vLLM serves it (the decode instances' /v1/models; `model_name` until one
    answered). The prefill's KV waits for the decode instance under the connector's
    lease: a decode call that fails leaves it pinned until then (vLLM has no cancel)."""

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        model_name: str,
        *,
        recompute_on_failure: bool = True,
    ) -> None:
        if not decode_urls:
            raise BackendError("a vLLM deployment needs at least one decode instance URL")
        self.model_name = model_name
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in decode_urls]
        self.recompute_on_failure = recompute_on_failure
        self._prefills = itertools.cycle(range(len(self.prefill_urls) or 1))
        self._decodes = itertools.cycle(range(len(self.decode_urls)))
        self._served: dict[str, str] = {}  # instance URL -> the model name vLLM serves
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        )

    async def start(self) -> None:
        """Learn the name the decode instances serve the model under, if one answers
        now (else at the first request)."""
        for url in self.decode_urls:
            try:
                await self._served_model(url)
                return
            except BackendError:
                continue

    async def close(self) -> None:
        await self._client.aclose()

    async def _probe_all(self, path: str) -> dict[str, httpx.Response | str]:
        """GET `path` of every instance at once: its response, or why it gave none."""

        async def probe(url: str) -> httpx.Response | str:
            try:
                return await self._client.get(url + path, timeout=5)
            except httpx.HTTPError as exc:
                return f"unreachable: {exc!r}"

        urls = (*self.prefill_urls, *self.decode_urls)
        return dict(zip(urls, await asyncio.gather(*map(probe, urls)), strict=True))

    async def health(self) -> dict[str, object]:
        up = {
            url: r
            if isinstance(r, str)
            else "up"
            if r.status_code == 200
            else f"HTTP {r.status_code}"
            for url, r in (await self._probe_all("/health")).items()
        }
        decodes_up = any(up[u] == "up" for u in self.decode_urls)
        # without a prefill instance up, requests are served only if the decode computes
        prefills_ok = self.recompute_on_failure or any(up[u] == "up" for u in self.prefill_urls)
        if all(v == "up" for v in up.values()):
            status = "ok"
        else:
            status = "degraded" if decodes_up and prefills_ok else "unavailable"
        return {"status": status, "instances": up}

    async def instance_metrics(self) -> dict[str, str | None]:
        return {
            url: None
            if isinstance(r, str) or r.status_code != 200
            else with_label(r.text, "instance", url)
            for url, r in (await self._probe_all("/metrics")).items()
        }

    async def _served_model(self, url: str) -> str:
        """The name `url` serves its model under (its /v1/models), asked once."""
        if url not in self._served:
            try:
                r = await self._client.get(url + "/v1/models", timeout=30)
                r.raise_for_status()
                self._served[url] = str(r.json()["data"][0]["id"])
                if url in self.decode_urls:  # clients name the model as vLLM serves it
                    self.model_name = self._served[url]
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                raise BackendError(
                    f"vLLM instance {url} did not say which model it serves "
                    f"(GET /v1/models): {exc!r}",
                    503,
                ) from None
        return self._served[url]

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateEvent, None]:
        path = "/v1/chat/completions" if request.messages is not None else "/v1/completions"
        decode = self.decode_urls[next(self._decodes)]
        started = time.perf_counter()
        params, prefill, causes = await self._prefill(request, path)
        prefill_ms = (time.perf_counter() - started) * 1e3 if params is not None else None
        if params is None and not self.recompute_on_failure:
            raise BackendError(
                "no prefill instance served the request: "
                + ("; ".join(causes) or "no prefill instance URL is configured (--prefill)"),
                503,
            )
        body = vllm_body(request, await self._served_model(decode))
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        if params is not None:
            body["kv_transfer_params"] = params
        route = {"decode_instance": decode}
        if prefill is not None:
            route["prefill_instance"] = prefill
        decode_started = time.perf_counter()
        req = self._client.build_request("POST", decode + path, json=body)
        try:
            resp = await self._client.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise BackendError(f"decode instance {decode} did not answer: {exc!r}", 503) from None
        try:
            if resp.status_code != 200:
                await resp.aread()
                status = resp.status_code if resp.status_code < 500 else 503
                raise BackendError(
                    f"decode instance {decode} answered {resp.status_code}: {_error_message(resp)}",
                    status,
                )
            finish: str | None = None
            usage: dict[str, Any] = {}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    yield GenerateEvent(error=f"decode instance {decode}: {chunk['error']}")
                    return
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    text = choice.get("text")
                    if text is None:
                        text = (choice.get("delta") or {}).get("content") or ""
                    ids = [int(t) for t in choice.get("token_ids") or ()]
                    finish = choice.get("finish_reason") or finish
                    if text or ids:
                        yield GenerateEvent(text=text, token_ids=ids)
        except httpx.HTTPError as exc:
            yield GenerateEvent(error=f"decode instance {decode} stopped answering: {exc!r}")
            return
        finally:
            await resp.aclose()
        if finish is None:
            yield GenerateEvent(error=f"decode instance {decode} ended its stream unfinished")
            return
        details = usage.get("prompt_tokens_details") or {}
        yield GenerateEvent(
            finish_reason=finish,
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
            cached_tokens=int(details.get("cached_tokens") or 0),
            stages=RequestStages(
                prefill_ms=prefill_ms,
                decode_ms=(time.perf_counter() - decode_started) * 1e3,
            ),
            route=route,
        )

    async def _prefill(
        self, request: GenerateRequest, path: str
    ) -> tuple[dict[str, Any] | None, str | None, list[str]]:
        """vLLM's first step on the next prefill instance that serves it: (the
        kv_transfer_params it returned, its URL, []); (None, None, each cause) when none
        did. A 4xx is the client's request, answered as it is."""
        causes: list[str] = []
        for _ in self.prefill_urls:
            url = self.prefill_urls[next(self._prefills)]
            kv = encode_transfer_params(RemoteDecode())
            try:
                body = vllm_body(request, await self._served_model(url))
                body |= {"max_tokens": 1, "stream": False, "kv_transfer_params": kv}
                r = await self._client.post(url + path, json=body)
            except BackendError as exc:
                causes.append(str(exc))
                continue
            except httpx.HTTPError as exc:
                causes.append(f"prefill instance {url} did not answer: {exc!r}")
                continue
            if 400 <= r.status_code < 500:
                raise BackendError(_error_message(r), r.status_code)
            if r.status_code != 200:
                causes.append(
                    f"prefill instance {url} answered {r.status_code}: {_error_message(r)}"
                )
                continue
            params = r.json().get("kv_transfer_params")
            if not params:
                causes.append(
                    f"prefill instance {url} returned no kv_transfer_params: is it started "
                    "with --kv-transfer-config naming a KV connector (KVBridgeConnector)?"
                )
                continue
            return dict(params), url, []
        return None, None, causes
