"""Instances shared by the end-to-end serving tests: started once for tests/serve (and
stopped before the next package runs), since
loading two dozen tp workers on two cores is the slow part."""

from __future__ import annotations

import pytest

from kvbridge.serve.launcher import Deployment
from tests.serve.helpers import instance_args


@pytest.fixture(scope="package")
def instances():
    """Prefill and decode instances at tp 1, 3 and 9 (block 16, BHLNC), plus a tp-1 decode
    instance with block size 32 and LBNHC (NHD); keys ("prefill", tp), ("decode", tp),
    "decode32"."""
    dep = Deployment()
    try:
        urls: dict[object, str] = {}
        for role in ("prefill", "decode"):
            for tp in (1, 3, 9):
                urls[(role, tp)] = dep.start_instance(f"{role}{tp}", instance_args(role, tp)).url
        urls["decode32"] = dep.start_instance(
            "decode32", instance_args("decode", 1, 32, "LBNHC")
        ).url
        dep.wait_healthy(900, say=None)
        yield urls
    finally:
        dep.stop()
