"""Admission control on its own: places, reservations, refusals and their words."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbridge.serve.admission import (
    Admission,
    Overloaded,
    default_max_queued,
    overloaded_response,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_full_instance_refuses_naming_the_flag_and_the_count():
    a = Admission(2, "decode instance d-1")
    tickets = [a.admit("r1"), a.admit("r2")]
    with pytest.raises(Overloaded) as exc:
        a.admit("r3")
    assert str(exc.value).startswith(
        "decode instance d-1 holds 2 requests (--max-queued-requests 2); retry after 1 s"
    )
    assert a.num_rejected == 1
    tickets[0].release()
    tickets[0].release()  # idempotent: the place is given back once
    assert a.num_held == 1
    a.admit("r3")
    assert a.num_held == 2


def test_reservation_holds_a_place_for_its_request_only():
    clock = Clock()
    a = Admission(2, "decode instance d", clock=clock)
    a.reserve("r1")
    a.admit("other")
    with pytest.raises(Overloaded):
        a.admit("r2")  # r1's place is kept for r1
    ticket = a.admit("r1")  # takes its reservation, not a new place
    assert a.num_held == 2
    ticket.release()
    a.reserve("r4")
    assert a.cancel("r4") and not a.cancel("r4")
    a.reserve("r5", ttl_s=10)
    clock.now = 10.0  # a reservation nobody claimed lapses
    assert a.num_held == 1
    a.reserve("r6")


def test_refusal_is_an_openai_shaped_503_with_retry_after():
    response = overloaded_response(Overloaded("full; retry after 2 s", 1.5))
    assert response.status_code == 503 and response.headers["retry-after"] == "2"
    assert b'"code":"overloaded"' in response.body and b'"type":"server_error"' in response.body


@given(st.integers(1, 100_000), st.integers(1, 1024))
def test_default_limit_fits_the_cache_and_the_engine(num_blocks, max_num_seqs):
    limit = default_max_queued(num_blocks, max_num_seqs)
    assert 1 <= limit <= 2 * max_num_seqs
    assert limit <= max(1, num_blocks // 2)
