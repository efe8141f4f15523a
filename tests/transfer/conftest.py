"""Fixtures the transfer runtime tests share: a fake clock and prefill worker 0 of
instance "P" over a fake transport, with the releases it reported."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbridge.transfer.producer import KVProducer, Release

from .fakes import Clock
from .runtime import make_producer


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def producer(clock: Clock) -> Iterator[tuple[KVProducer, list[Release]]]:
    released: list[Release] = []
    p = make_producer(clock, "prefill0", "P", on_release=released.append)
    yield p, released
    p.close()
