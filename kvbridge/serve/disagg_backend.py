"""The proxy's backend for disaggregated serving: prefill on one instance, decode on another.

    proxy ──GenerateRequest──▶ prefill instance   (prompt KV + first token, blocks exposed)
          ◀──PrefillResult───  (first token streamed to the client at once)
          ──DecodeRequest───▶ decode instance    (pulls the KV over NIXL, decodes)
          ◀──NDJSON events───

Routing is prefix-aware: the proxy asks the instances up (`/internal/lookup`) how much of
the prompt each one's prefix cache holds and picks, per role, the one holding the most
(so a conversation's later turns land where its earlier turns are), the least loaded
among equals, else round-robin (`InstancePool`). The prefill instance then exposes only
the KV the chosen decode instance lacks; a decode instance holding every full block of
the prompt computes the rest itself and nothing is pulled. One that fails a request
before serving it (unreachable, or a 5xx: its engine failed) is marked down with the reason and the request goes to the next one; it is tried again
after `down_s`, or as soon as a /health probe finds it up. With no prefill instance up,
the decode instance computes the whole request itself (colocated) when
`recompute_on_failure` is set, so the answer is still correct; with no decode instance
up the request is refused with 503 naming each instance's reason.

Backpressure: before a prompt goes to a prefill instance, a decode instance reserves a
place for the request (`/internal/reserve`), so no prefill is computed that no decode
instance can take. An instance that is full answers 503 "overloaded" with Retry-After
at once; it is not down, only full: the request goes to the next instance of that role,
and when every one is full the client gets that 503 and Retry-After (never a recompute
elsewhere, which would only move the load). Whatever the request leaves behind when it
ends early (the client went away, an instance refused it) is given back at once in
the background: the decode reservation, and the prefill's exposed KV
(`/internal/cancel`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import httpx
import msgspec

from kvbridge.serve import wire
from kvbridge.serve.admission import OVERLOADED, RETRY_AFTER_S
from kvbridge.serve.backend import (
    Backend,
    BackendError,
    GenerateEvent,
    GenerateRequest,
    RequestStages,
)
from kvbridge.serve.http_auth import SignedRequests
from kvbridge.serve.introducer import Introducer

log = logging.getLogger("kvbridge.serve")

#: How long an instance that failed a request is skipped before it is tried again.
DOWN_S = 5.0
#: The marker `_generate` yields when the decode instance took the request (never sent).
TAKEN = GenerateEvent()
#: Timeout of a /health or /metrics probe of one instance.
PROBE_TIMEOUT_S = 5.0


@dataclass
class _Member:
    url: str
    down_until: float = 0.0
    reason: str = ""


class InstancePool:
    """The instances of one role. Owned by one backend; used from the proxy's event loop."""

    def __init__(self, role: str, urls: Sequence[str], down_s: float = DOWN_S) -> None:
        self.role = role
        self.members = [_Member(url) for url in urls]
        self.down_s = down_s
        self._next = 0

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.members]

    def candidates(self) -> list[str]:
        """The instances up now, each once, starting with the next one in turn."""
        if not self.members:
            return []
        start = self._next
        self._next = (self._next + 1) % len(self.members)
        now = time.monotonic()
        order = self.members[start:] + self.members[:start]
        return [m.url for m in order if m.down_until <= now]

    def mark_down(self, url: str, reason: str) -> None:
        for m in self.members:
            if m.url == url:
                m.down_until = time.monotonic() + self.down_s
                m.reason = reason
                log.warning(
                    "%s instance %s is down for %.0f s: %s", self.role, url, self.down_s, reason
                )

    def mark_up(self, url: str) -> None:
        for m in self.members:
            if m.url == url:
                m.down_until, m.reason = 0.0, ""

    def unavailable(self) -> str:
        """Why no instance of this role can serve now."""
        now = time.monotonic()
        reasons = [f"{m.url}: {m.reason}" for m in self.members if m.down_until > now]
        return f"no {self.role} instance is up ({'; '.join(reasons) or 'none configured'})"


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
        down_s: float = DOWN_S,
        token: bytes | None = None,
        verify: ssl.SSLContext | None = None,
    ) -> None:
        if not decode_urls:
            raise BackendError("at least one decode instance is needed", 500)
        self.prefill = InstancePool("prefill", prefill_urls, down_s)
        self.decode = InstancePool("decode", decode_urls, down_s)
        self.model_name = model_name
        self.recompute_on_failure = recompute_on_failure
        # every read waits at most timeout_s (a decode stream: between two tokens); with
        # a shared token every call is signed (the instances require it). Connections
        # are not capped: the instances bound what they hold (admission.py), and a capped
        # pool would queue the reservations and cancels that keep them bounded behind
        # the streams it serves. Idle connections are closed here before the instances'
        # servers close them (uvicorn: after 5 s): otherwise a close crossing a request,
        # or one lost while a link was down, fails the next request on a dead pooled
        # connection
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            auth=SignedRequests(token) if token is not None else None,
            verify=verify or _token_tls(token),
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0
            ),
        )
        self._instance_ids: dict[str, str] = {}  # decode url -> its instance id
        self.introducer = Introducer(
            self.prefill.urls,
            self.decode.urls,
            self._info,
            lambda url, body: self._call(url, "/internal/connect", body),
        )
        self._background: set[asyncio.Future[None]] = set()

    async def _post(
        self, url: str, path: str, body: bytes, timeout: float | None = None
    ) -> httpx.Response:
        """POST a JSON body to an instance (signed when the deployment has a token);
        `timeout` None: the client's (a read may take as long as a prefill)."""
        headers = {"content-type": "application/json"}
        if timeout is None:
            return await self._client.post(f"{url}{path}", content=body, headers=headers)
        return await self._client.post(
            f"{url}{path}", content=body, headers=headers, timeout=timeout
        )

    async def _prefill(self, url: str, request: GenerateRequest) -> wire.PrefillResult:
        try:
            resp = await self._post(url, "/internal/prefill", msgspec.json.encode(request))
        except httpx.HTTPError as exc:
            raise BackendError(f"prefill instance {url} is unreachable: {exc!r}", 503) from None
        if resp.status_code != 200:
            status = resp.status_code if resp.status_code < 500 else 503
            message = f"prefill instance {url}: {_message(resp)}"
            raise BackendError(message, status, retry_after_s=_retry_after(resp))
        try:
            return wire.prefill_result_decoder.decode(resp.content)
        except msgspec.DecodeError as exc:
            raise BackendError(
                f"prefill instance {url} sent a malformed result: {exc}", 503
            ) from None

    async def _prefill_any(self, request: GenerateRequest) -> tuple[str, wire.PrefillResult] | None:
        """(url, result) from the first prefill instance up that serves it; None when none
        could and the decode instance is to compute the prompt."""
        errors, full = [], []
        candidates, _ = await self._rank(self.prefill.candidates(), msgspec.json.encode(request))
        for url in candidates:
            try:
                return url, await self._prefill(url, request)
            except BackendError as exc:
                if exc.status < 500:
                    raise  # the request itself was refused
                if exc.retry_after_s is not None:  # full, not down
                    full.append(exc)
                    continue
                self.prefill.mark_down(url, str(exc))
                errors.append(str(exc))
        if full:  # refuse, rather than move the load onto the decode instance
            raise _all_full(full)
        message = "; ".join(errors) or self.prefill.unavailable()
        if not self.recompute_on_failure:
            raise BackendError(message, 503)
        log.warning("%s; the decode instance computes the prompt instead", message)
        return None

    async def start(self) -> None:
        """Keep every prefill instance introduced to every decode instance, in the
        background, whatever the order they come up in (`Introducer`), so a first
        request pays no handshake."""
        self.introducer.start()

    async def _info(self, url: str) -> Mapping[str, object] | str:
        """An instance's /internal/info, or why it gave none."""
        try:
            resp = await self._client.get(f"{url}/internal/info", timeout=PROBE_TIMEOUT_S)
            resp.raise_for_status()
            answer = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            return f"unreachable: {exc!r}"
        return answer if isinstance(answer, dict) else f"answered {answer!r}"

    async def _instance_id(self, url: str) -> str | None:
        """A decode instance's id (it names the reader of a pull capability): as the
        introducer's last probe found it (a restarted instance has a new one), else
        asked once and cached."""
        probed = self.introducer.instance_id(url)
        if probed is not None:
            return probed
        if url not in self._instance_ids:
            try:
                resp = await self._client.get(f"{url}/internal/info", timeout=PROBE_TIMEOUT_S)
                resp.raise_for_status()
                self._instance_ids[url] = str(resp.json()["instance_id"])
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                log.warning("decode instance %s did not tell its id: %r", url, exc)
                return None
        return self._instance_ids[url]

    async def _lookup(self, url: str, body: bytes) -> wire.Lookup | None:
        """An instance's prefix-cache hit and load for a prompt; None if it did not say
        (the request itself then tells whether the instance is up)."""
        try:
            resp = await self._post(url, "/internal/lookup", body, PROBE_TIMEOUT_S)
            if resp.status_code == 200:
                return wire.lookup_decoder.decode(resp.content)
            if resp.status_code in (400, 413):  # the request itself is refused: say so now
                raise BackendError(_message(resp), resp.status_code)
        except (httpx.HTTPError, msgspec.DecodeError) as exc:
            log.warning("prefix lookup on %s failed: %r", url, exc)
        return None

    async def _rank(
        self, urls: list[str], body: bytes, always: bool = False
    ) -> tuple[list[str], dict[str, wire.Lookup]]:
        """`urls` (in turn order) reordered: the longest cached prefix first, then the
        least loaded; and the lookups that were answered. Asks nobody when there is no
        choice unless `always`."""
        if not urls or (len(urls) == 1 and not always):
            return urls, {}
        answers = await asyncio.gather(*(self._lookup(url, body) for url in urls))

        def key(i: int) -> tuple[int, int, int]:
            a = answers[i]  # one that did not answer: no hit, load unknown (its turn)
            return (-a.cached_tokens, a.num_requests, i) if a else (0, 0, i)

        order = sorted(range(len(urls)), key=key)
        found = {url: a for url, a in zip(urls, answers, strict=True) if a is not None}
        return [urls[i] for i in order], found

    async def _reserve(self, request_id: str, urls: list[str]) -> list[str]:
        """`urls` from the first decode instance that reserved a place for `request_id`
        on; BackendError (503, with Retry-After when they are full) when none did."""
        errors, full = [], []
        for i, url in enumerate(urls):
            body = {"request_id": request_id}
            try:
                try:
                    resp = await self._call(url, "/internal/reserve", body)
                except (httpx.ReadError, httpx.RemoteProtocolError):
                    # a kept-alive connection the instance had closed: once more on a
                    # fresh one (a reservation of the same id only renews it)
                    resp = await self._call(url, "/internal/reserve", body)
            except httpx.HTTPError as exc:
                message = f"decode instance {url} is unreachable: {exc!r}"
                self.decode.mark_down(url, message)
                errors.append(message)
                continue
            if resp.status_code in (200, 404):  # 404: it takes no reservations; go ahead
                return urls[i:] + urls[:i]
            message = f"decode instance {url}: {_message(resp)}"
            retry_after = _retry_after(resp)
            if retry_after is not None:
                full.append(BackendError(message, 503, retry_after_s=retry_after))
                continue
            if resp.status_code >= 500:
                self.decode.mark_down(url, message)
            errors.append(message)
        if full:
            raise _all_full(full)
        raise BackendError("no decode instance could serve the request: " + "; ".join(errors), 503)

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateEvent, None]:
        decode_urls = self.decode.candidates()
        if not decode_urls:
            raise BackendError(self.decode.unavailable(), 503)
        rid = request.request_id
        # the decode instance holding most of the prompt first; its hit decides what the
        # prefill instance exposes
        body = msgspec.json.encode(request)
        decode_urls, hits = await self._rank(decode_urls, body, always=bool(self.prefill.members))
        decode_urls = await self._reserve(rid, decode_urls)
        hit = hits.get(decode_urls[0])
        # the reservation is given back unless the decode instance took the request, and
        # the prefill's exposed KV is "open" until the decode instance it was issued to
        # takes it: if that instance refuses it or cannot be reached, or the client gives
        # up first, both are released at once (not at a lease)
        reserved, prefill, prefill_url, reader = True, None, "", None
        try:
            # a decode instance holding every full block of the prompt computes the rest
            # itself: nothing to prefill elsewhere, nothing to pull
            whole = hit is not None and hit.holds_prompt
            if self.prefill.members and not whole:  # the KV goes to the reserved instance
                reader = await self._instance_id(decode_urls[0])
                start = hit.kv_start_token if hit is not None else 0
                served = await self._prefill_any(
                    msgspec.structs.replace(request, kv_reader=reader, kv_start_token=start)
                )
                if served is not None:
                    prefill_url, prefill = served
            met = None
            if prefill is not None and prefill.kv is not None:
                met = functools.partial(
                    self.introducer.wait_met,
                    decode_urls[0],
                    prefill_url,
                    reader,
                    prefill.instance_id or None,
                )
            async for ev in self._generate(request, prefill, decode_urls, met):
                if ev is TAKEN:
                    reserved = False
                    continue
                if whole and ev.finish_reason and ev.stages.kv_bytes is None:
                    ev.stages.kv_bytes = 0  # say so: the decode instance had it all
                yield ev
        finally:
            exposed = (
                prefill is not None and prefill.kv is not None and prefill.finish_reason is None
            )
            if reserved and exposed and prefill is not None:
                self._cancel_soon(prefill_url, rid, "no decode instance took it")
            if reserved:
                self._cancel_soon(decode_urls[0], rid, "the request ended before it came")

    async def _generate(
        self,
        request: GenerateRequest,
        prefill: wire.PrefillResult | None,
        decode_urls: list[str],
        met: Callable[[], Awaitable[str]] | None = None,
    ) -> AsyncGenerator[GenerateEvent, None]:
        """The events of `generate`; yields `TAKEN` (never to the client) once the decode
        instance holding the capability accepted the request, or once that is unknown.
        `met`, awaited after the prefill's first token is out and before the decode
        instance is asked, waits for the pair's introduction (`Introducer.wait_met`)."""
        if prefill is not None:
            done = prefill.finish_reason is not None
            yield GenerateEvent(
                text=prefill.first_text,
                token_ids=[prefill.first_token_id],
                finish_reason=prefill.finish_reason,
                prompt_tokens=len(prefill.prompt_token_ids),
                completion_tokens=1,
                stages=RequestStages(prefill_ms=prefill.prefill_ms if done else None),
                cached_tokens=prefill.cached_tokens if done else 0,
                route={"prefill_instance": prefill.instance_id} if done else {},
            )
            if done:
                return
        if met is not None:
            await met()  # its pull finds the prefill workers met and their paths warm
        body = msgspec.json.encode(wire.DecodeRequest(request, prefill))
        errors = []
        for i, url in enumerate(decode_urls):
            if i == 1 and prefill is not None and prefill.kv is not None:
                # the capability names the first instance: another one computes the prompt
                body = msgspec.json.encode(
                    wire.DecodeRequest(request, msgspec.structs.replace(prefill, kv=None))
                )
            began = False  # whether this instance's stream yielded an event
            try:
                async with self._client.stream(
                    "POST",
                    f"{url}/internal/generate",
                    content=body,
                    headers={"content-type": "application/json"},
                ) as r:
                    if r.status_code != 200:
                        await r.aread()
                        message = f"decode instance {url}: {_message(r)}"
                        if _retry_after(r) is not None:  # full (its reservation lapsed)
                            errors.append(message)
                            continue
                        if r.status_code >= 500:  # it cannot serve: try the next one
                            self.decode.mark_down(url, message)
                            errors.append(message)
                            continue
                        if prefill is None:
                            raise BackendError(message, r.status_code)
                        yield GenerateEvent(error=message, error_status=r.status_code)
                        return
                    if i == 0:
                        yield TAKEN
                    async for line in r.aiter_lines():
                        if not line:
                            continue
                        try:
                            ev = wire.event_decoder.decode(line)
                        except msgspec.DecodeError as exc:
                            ev = GenerateEvent(error=f"decode instance {url} sent {exc}")
                        began = True
                        yield ev
                        if ev.error and ev.error_status == 503:
                            self.decode.mark_down(url, ev.error)
                        if ev.finish_reason or ev.error:
                            return
                message = f"decode instance {url} ended the stream early"
                self.decode.mark_down(url, message)
                yield GenerateEvent(error=message, error_status=503)
                return
            except httpx.HTTPError as exc:
                if i == 0 and not isinstance(exc, httpx.ConnectError):
                    yield TAKEN  # it may have started pulling: never release under a read
                message = f"decode instance {url} failed: {exc!r}"
                self.decode.mark_down(url, message)
                if began:
                    yield GenerateEvent(error=message, error_status=503)
                    return
                errors.append(message)
        message = "no decode instance could serve the request: " + "; ".join(errors)
        if prefill is None:
            raise BackendError(message, 503)
        yield GenerateEvent(error=message, error_status=503)

    def _cancel_soon(self, url: str, request_id: str, reason: str) -> None:
        """Ask an instance to give back what it holds for `request_id` now (a prefill
        instance its exposed KV, a decode instance its reservation), in the background."""

        async def cancel() -> None:
            try:
                await self._call(
                    url, "/internal/cancel", {"request_id": request_id, "reason": reason}
                )
            except httpx.HTTPError as exc:
                log.warning("cancelling %s on %s failed: %r", request_id, url, exc)

        task = asyncio.ensure_future(cancel())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _call(self, url: str, path: str, body: Mapping[str, object]) -> httpx.Response:
        """POST a small JSON control message to an instance (probe timeout)."""
        return await self._post(url, path, msgspec.json.encode(body), PROBE_TIMEOUT_S)

    async def _probe(self, url: str, path: str) -> httpx.Response | str:
        try:
            return await self._client.get(f"{url}{path}", timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return repr(exc)

    async def health(self) -> dict[str, object]:
        pools = [(self.prefill, url) for url in self.prefill.urls]
        pools += [(self.decode, url) for url in self.decode.urls]
        answers = await asyncio.gather(*(self._probe(url, "/health") for _, url in pools))
        states: dict[str, object] = {}
        up = {"prefill": 0, "decode": 0}
        for (pool, url), answer in zip(pools, answers, strict=True):
            if isinstance(answer, str):
                states[url] = {"status": "unreachable", "reason": answer}
                pool.mark_down(url, f"unreachable: {answer}")
                continue
            try:
                states[url] = answer.json()
            except ValueError:
                states[url] = {"status": f"HTTP {answer.status_code}", "reason": answer.text[:200]}
            if answer.status_code == 200:
                pool.mark_up(url)
                up[pool.role] += 1
            else:
                pool.mark_down(url, f"/health answered {answer.status_code}: {answer.text[:200]}")
        everything = up["prefill"] + up["decode"] == len(pools)
        prefill_ok = up["prefill"] > 0 or not self.prefill.members or self.recompute_on_failure
        if everything:
            status = "ok"
        elif up["decode"] and prefill_ok:
            status = "degraded"
        else:
            status = "unavailable"
        return {"status": status, "instances": states, "introductions": self.introducer.snapshot()}

    async def instance_metrics(self) -> dict[str, str | None]:
        urls = self.prefill.urls + self.decode.urls
        answers = await asyncio.gather(*(self._probe(url, "/metrics") for url in urls))
        return {
            url: a.text if not isinstance(a, str) and a.status_code == 200 else None
            for url, a in zip(urls, answers, strict=True)
        }

    async def close(self) -> None:
        await self.introducer.close()
        await self._client.aclose()


def _token_tls(token: bytes | None) -> ssl.SSLContext:
    # imported here: the proxy in front of vLLM (`--engine vllm`, vLLM's environment)
    # never needs the instances' TLS, nor the `cryptography` it is made with
    from kvbridge.serve.tls import client_context

    return client_context(token)


def _retry_after(resp: httpx.Response) -> float | None:
    """The Retry-After of an instance's "overloaded" refusal; None for any other answer."""
    if resp.status_code != 503:
        return None
    try:
        if resp.json()["error"]["code"] != OVERLOADED:
            return None
        return float(resp.headers.get("retry-after", RETRY_AFTER_S))
    except (ValueError, KeyError, TypeError):
        return None


def _all_full(refusals: list[BackendError]) -> BackendError:
    """The refusal when every instance of a role is full: 503, the soonest Retry-After."""
    retry_after = min(e.retry_after_s or RETRY_AFTER_S for e in refusals)
    return BackendError("; ".join(str(e) for e in refusals), 503, retry_after_s=retry_after)


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except Exception:
        return f"HTTP {resp.status_code}: {resp.text[:200]}"
