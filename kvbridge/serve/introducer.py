"""The proxy keeps every decode instance introduced to every prefill instance.

A decode worker's first pull from a prefill instance it has not met pays the handshake
(side channel, NIXL metadata, prepared descriptor lists: hundreds of milliseconds). So
the proxy introduces them ahead of requests, whatever the order they come up in:

    every PROBE_S          GET /internal/info of every instance: up, and who it is
                           (its instance id; a prefill instance's side channel)
    per (decode, prefill)  both up and not met under their current ids:
                           POST /internal/connect {endpoints, instance_ids} to the decode
                           instance; its answer names the prefill instances every one of
                           its workers has met ("connected"). Not yet: ask again after
                           RETRY_S, doubling up to MAX_RETRY_S
    met                    asked again every REFRESH_S (a no-op while it holds; a decode
                           instance that forgot the peer after a failed pull meets it
                           again), and at once when either side restarts (a new id) or
                           comes back after it could not be reached

Everything runs in one background task of the proxy's event loop: every call has the
probe timeout, and `close` stops it. An instance reports a prefill instance met
("connected") once every decode worker handshook with it, prepared its descriptor
lists and finished a warm-up READ from each prefill worker it reads from. A request whose
KV is about to be pulled across a pair not met yet (the deployment is starting, an
instance restarted and the last probe has not seen it) waits for that introduction
(`wait_met`, at most `WAIT_MET_S`): the pair is probed and asked about at once and then
every `WAITED_RETRY_S`, so its pull finds the paths warm instead of paying the handshake
and the first READs itself. A pair a request waited for in vain is not waited for again
until either side changes; its requests handshake on their own, as they always could.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import httpx

log = logging.getLogger("kvbridge.serve")

#: How often every instance is asked who it is.
PROBE_S = 1.0
#: The first wait before an introduction not finished yet is asked about again.
RETRY_S = 0.25
#: The longest wait between two tries of one introduction.
MAX_RETRY_S = 8.0
#: How often an introduction that holds is confirmed.
REFRESH_S = 15.0
#: The longest a request waits for its pair's introduction (`Introducer.wait_met`).
WAIT_MET_S = 10.0
#: How often an introduction a request waits for is asked about.
WAITED_RETRY_S = 0.05

#: GET path -> the instance's answer (a JSON object) or the reason it gave none.
Probe = Callable[[str], Awaitable[Mapping[str, object] | str]]
#: (decode url, body) -> the decode instance's answer to /internal/connect.
Call = Callable[[str, Mapping[str, object]], Awaitable[httpx.Response]]


class Introduction(enum.Enum):
    WAITING = "waiting"  # an instance of the pair is not up (or tells no side channel)
    PENDING = "pending"  # introduced; the decode workers have not all met it yet
    CONNECTED = "connected"  # every decode worker has met the prefill instance
    UNSUPPORTED = "unsupported"  # the decode instance has no KV connector (404)


@dataclass
class _Identity:
    instance_id: str
    endpoint: str  # a prefill instance's side channel ("" for a decode instance)


@dataclass
class _Pair:
    state: Introduction = Introduction.WAITING
    reason: str = ""
    ids: tuple[str, str] | None = None  # (decode id, prefill id) it holds for
    next_at: float = 0.0
    backoff: float = RETRY_S
    connected_at: float = 0.0
    waiters: int = 0  # requests waiting for it (`Introducer.wait_met`)
    #: the (decode id, prefill id) a request waited for in vain (`wait_met`)
    waited_out: tuple[str | None, str | None] | None = None


class Introducer:
    """Introduces the prefill instances at `prefill_urls` to the decode instances at
    `decode_urls` and keeps them introduced. Owned by the proxy's backend; `start` and
    `close` from its event loop; `snapshot` and `instance_id` from the same loop."""

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        info: Probe,
        connect: Call,
        *,
        probe_s: float = PROBE_S,
        retry_s: float = RETRY_S,
        max_retry_s: float = MAX_RETRY_S,
        refresh_s: float = REFRESH_S,
    ) -> None:
        self.prefill_urls, self.decode_urls = list(prefill_urls), list(decode_urls)
        self._info, self._connect = info, connect
        self.probe_s, self.retry_s = probe_s, retry_s
        self.max_retry_s, self.refresh_s = max_retry_s, refresh_s
        self._who: dict[str, _Identity | str] = {}  # url -> identity, or why unknown
        self._pairs = {(d, p): _Pair() for d in self.decode_urls for p in self.prefill_urls}
        self._task: asyncio.Task[None] | None = None
        self._next_probe = 0.0
        self._wake = asyncio.Event()  # a request waits: step now
        self._stepped = asyncio.Event()  # set (and replaced) after every step

    def start(self) -> None:
        if self._pairs and self._task is None:
            self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def instance_id(self, url: str) -> str | None:
        """The id `url`'s instance told at the last probe; None if it was not reached."""
        who = self._who.get(url)
        return who.instance_id if isinstance(who, _Identity) else None

    def snapshot(self) -> dict[str, dict[str, str]]:
        """decode url -> prefill url -> the introduction's state (and why, if not met)."""
        out: dict[str, dict[str, str]] = {}
        for (d, p), pair in self._pairs.items():
            state = pair.state.value + (f": {pair.reason}" if pair.reason else "")
            out.setdefault(d, {})[p] = state
        return out

    async def _run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad answer stop introductions for good
                log.exception("introducing instances failed; trying again")
            now = time.monotonic()
            self._stepped.set()
            self._stepped = asyncio.Event()
            due = [self._next_probe] + [
                p.next_at for p in self._pairs.values() if p.state is not Introduction.WAITING
            ]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.02, min(due) - now))
            self._wake.clear()

    async def wait_met(
        self,
        decode_url: str,
        prefill_url: str,
        decode_id: str | None,
        prefill_id: str | None,
        timeout_s: float = WAIT_MET_S,
    ) -> str:
        """Wait (at most `timeout_s`) until the decode instance at `decode_url` has met
        the prefill instance at `prefill_url` under these ids (None: whichever it is
        now); returns at once if it has, if the decode instance has no KV connector, or
        if a request waited for the pair under these ids in vain already. Makes the
        introduction due now. Returns the pair's state as `snapshot` says it."""
        pair = self._pairs.get((decode_url, prefill_url))
        if pair is None or self._task is None:
            return "not introduced by this proxy"
        deadline = time.monotonic() + timeout_s
        pair.waiters += 1
        first = True
        try:
            while not self._met(pair, decode_id, prefill_id):
                now = time.monotonic()
                if pair.waited_out == (decode_id, prefill_id):
                    break
                if now >= deadline:
                    pair.waited_out = (decode_id, prefill_id)
                    log.warning(
                        "decode instance %s has not met prefill instance %s after %.1f s (%s); "
                        "requests do not wait for it until either restarts",
                        decode_url,
                        prefill_url,
                        timeout_s,
                        pair.reason or pair.state.value,
                    )
                    break
                # due now at the first turn, then every WAITED_RETRY_S: a probe while the
                # pair is not seen under these ids (who is it now?), its introduction
                # (asked again after WAITED_RETRY_S while a request waits: `_introduce`)
                due = now if first else now + WAITED_RETRY_S
                sooner = not self._sees(pair, decode_id, prefill_id) and self._next_probe > due
                if sooner:
                    self._next_probe = due
                if first and pair.next_at > due:
                    pair.next_at, sooner = due, True
                if sooner:
                    self._wake.set()
                first = False
                stepped = self._stepped
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stepped.wait(), deadline - now)
        finally:
            pair.waiters -= 1
        return pair.state.value + (f": {pair.reason}" if pair.reason else "")

    @staticmethod
    def _sees(pair: _Pair, decode_id: str | None, prefill_id: str | None) -> bool:
        """The last probe found the pair up under these ids."""
        return pair.ids is not None and (decode_id, prefill_id) in (
            pair.ids,
            (None, pair.ids[1]),
            (pair.ids[0], None),
            (None, None),
        )

    def _met(self, pair: _Pair, decode_id: str | None, prefill_id: str | None) -> bool:
        if pair.state is Introduction.UNSUPPORTED:
            return True
        return pair.state is Introduction.CONNECTED and self._sees(pair, decode_id, prefill_id)

    async def step(self) -> None:
        """One round: probe when due, then make the introductions that are due."""
        now = time.monotonic()
        if now >= self._next_probe:
            self._next_probe = now + self.probe_s
            urls = list(dict.fromkeys(self.prefill_urls + self.decode_urls))
            answers = await asyncio.gather(*(self._info(url) for url in urls))
            for url, answer in zip(urls, answers, strict=True):
                self._who[url] = _identity(answer)
        by_decode: dict[str, list[tuple[str, _Identity]]] = {}
        for (d, p), pair in self._pairs.items():
            dw, pw = self._who.get(d), self._who.get(p)
            if not isinstance(dw, _Identity) or not isinstance(pw, _Identity) or not pw.endpoint:
                missing = [(u, w) for u, w in ((d, dw), (p, pw)) if not isinstance(w, _Identity)]
                pair.reason = "; ".join(f"{u} {w or 'not probed yet'}" for u, w in missing)
                if not missing:
                    pair.reason = f"{p} tells no KV side channel"
                pair.state, pair.ids = Introduction.WAITING, None  # met afresh once back
                continue
            ids = (dw.instance_id, pw.instance_id)
            if pair.ids != ids:  # new, restarted, or back after an outage: introduce now
                pair.state, pair.ids, pair.reason = Introduction.PENDING, ids, ""
                pair.next_at, pair.backoff = now, self.retry_s
            if pair.next_at <= now:
                by_decode.setdefault(d, []).append((p, pw))
        await asyncio.gather(*(self._introduce(d, peers) for d, peers in by_decode.items()))

    async def _introduce(self, decode_url: str, peers: list[tuple[str, _Identity]]) -> None:
        body = {
            "endpoints": [w.endpoint for _, w in peers],
            "instance_ids": [w.instance_id for _, w in peers],
        }
        connected: set[str] = set()
        reason = ""
        try:
            resp = await self._connect(decode_url, body)
            if resp.status_code == 404:
                for p, _ in peers:
                    pair = self._pairs[(decode_url, p)]
                    pair.state, pair.reason = Introduction.UNSUPPORTED, _message(resp)
                    pair.next_at = time.monotonic() + self.refresh_s
                return
            if resp.status_code != 200:
                reason = f"/internal/connect answered {resp.status_code}: {_message(resp)}"
            else:
                connected = {str(e) for e in resp.json().get("connected", [])}
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            reason = f"/internal/connect failed: {exc!r}"
        now = time.monotonic()
        for p, w in peers:
            pair = self._pairs[(decode_url, p)]
            if w.endpoint in connected:
                if pair.state is not Introduction.CONNECTED:
                    log.info("decode instance %s has met prefill instance %s", decode_url, p)
                pair.state, pair.reason = Introduction.CONNECTED, ""
                pair.next_at, pair.backoff = now + self.refresh_s, self.retry_s
                continue
            if pair.state is Introduction.CONNECTED:  # it forgot the peer: meet again soon
                pair.backoff = self.retry_s
            pair.state = Introduction.PENDING
            pair.reason = reason or "the decode workers have not all met it yet"
            if pair.waiters:  # a request waits for it: ask again soon
                pair.next_at = now + min(WAITED_RETRY_S, pair.backoff)
                continue
            pair.next_at = now + pair.backoff
            pair.backoff = min(2 * pair.backoff, self.max_retry_s)


def _identity(answer: Mapping[str, object] | str) -> _Identity | str:
    if isinstance(answer, str):
        return answer
    iid = answer.get("instance_id")
    if not isinstance(iid, str) or not iid:
        return "told no instance id"
    endpoint = answer.get("endpoint")
    return _Identity(iid, endpoint if isinstance(endpoint, str) else "")


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except Exception:
        return resp.text[:200]
