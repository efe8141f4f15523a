"""Admission control: how many requests an instance holds at once, and the fast refusal
when it is full.

An instance admits at most `limit` requests (`--max-queued-requests`): those its
handlers are serving now (waiting for the engine, prefilling, pulling, decoding,
streaming) plus the *reservations* a proxy made for requests it is about to send
(`reserve`: the proxy reserves a place on the decode instance before it sends the
prompt to a prefill instance, so no prefill is computed that no decode instance can
take). A request over the limit is refused at once, in the server's event loop and
without touching the engine, with 503, an OpenAI-shaped error whose code is
"overloaded", and a `Retry-After` header (`overloaded_response`); the proxy relays it.

Owned by one `Instance`; used only from its server's event loop (no lock). Every place
taken is given back exactly once: a `Ticket` when its request's handler ends (its
stream closed), a reservation when the request it was made for arrives, when the
proxy cancels it, or after `RESERVATION_S`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from kvbridge.errors import KVBridgeError
from kvbridge.serve.http_errors import error_response

#: What a refused client is told to wait before it retries (`Retry-After`, seconds).
RETRY_AFTER_S = 1.0
#: How long a reservation waits for its request (the prefill it waits for is bounded by
#: the prefill instance's own admission, so this is a backstop for a proxy that died).
RESERVATION_S = 60.0
#: The error code of a refusal for lack of room (the proxy tells it from a failure).
OVERLOADED = "overloaded"
#: The flag that sets the limit (named in every refusal).
FLAG = "--max-queued-requests"


class Overloaded(KVBridgeError):
    """A request refused because the instance (or every instance) is full; answered
    503 with `Retry-After: retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def retry_after_header(seconds: float) -> dict[str, str]:
    """The `Retry-After` header (whole seconds, at least 1)."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def overloaded_response(exc: Overloaded) -> JSONResponse:
    response = error_response(503, str(exc), code=OVERLOADED)
    response.headers.update(retry_after_header(exc.retry_after_s))
    return response


def default_max_queued(num_blocks: int, max_num_seqs: int) -> int:
    """The default limit: twice what the engine runs at once (a batch running and one
    waiting behind it), and no more than one request per two KV blocks, at least 1."""
    return max(1, min(2 * max_num_seqs, num_blocks // 2))


@dataclass(eq=False)
class Ticket:
    """One admitted request's place; `release` gives it back (idempotent)."""

    admission: Admission
    request_id: str
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission._num_admitted -= 1


class Admission:
    """The requests one instance holds, at most `limit` (see the module docstring)."""

    def __init__(
        self,
        limit: int,
        what: str,
        retry_after_s: float = RETRY_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if limit < 1:
            raise ValueError(f"{FLAG} {limit} must be at least 1")
        self.limit = limit
        self.what = what  # "prefill instance prefill-1a2b" (for refusals)
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._num_admitted = 0
        self._reserved: dict[str, float] = {}  # request id -> when the reservation lapses
        self.num_rejected = 0

    @property
    def num_held(self) -> int:
        """Requests admitted plus reservations still waiting for theirs."""
        self._expire()
        return self._num_admitted + len(self._reserved)

    def admit(self, request_id: str) -> Ticket:
        """A place for `request_id`: its reservation's if it has one, else a free one;
        Overloaded when there is none."""
        if self._reserved.pop(request_id, None) is None:
            self._check_room()
        self._num_admitted += 1
        return Ticket(self, request_id)

    def reserve(self, request_id: str, ttl_s: float = RESERVATION_S) -> None:
        """Keep a place for `request_id`, which arrives within `ttl_s` (Overloaded when
        there is none). A second reservation of the same id renews the first."""
        if request_id not in self._reserved:
            self._check_room()
        self._reserved[request_id] = self._clock() + ttl_s

    def cancel(self, request_id: str) -> bool:
        """Give back `request_id`'s reservation; False if it has none (any more)."""
        return self._reserved.pop(request_id, None) is not None

    def _check_room(self) -> None:
        held = self.num_held
        if held >= self.limit:
            self.num_rejected += 1
            raise Overloaded(
                f"{self.what} holds {held} requests ({FLAG} {self.limit}); retry after "
                f"{max(1, math.ceil(self.retry_after_s))} s, or start it with a larger "
                f"{FLAG} (or more KV cache) if it can take more",
                self.retry_after_s,
            )

    def _expire(self) -> None:
        now = self._clock()
        for rid in [r for r, until in self._reserved.items() if until <= now]:
            del self._reserved[rid]
