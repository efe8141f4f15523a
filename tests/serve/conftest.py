"""Instances shared by the end-to-end serving tests: started once for tests/serve (and
stopped before the next package runs), since
loading two dozen tp workers on two cores is the slow part."""

from __future__ import annotations

import pytest

from kvbridge.serve.launcher import Deployment
from tests.serve.helpers import small_instance


@pytest.fixture(scope="package")
def instances():
    """Prefill and decode instances at tp 1, 3 and 9 (block 16, BHLNC), plus tp-1 prefill
    and decode instances with block size 32 and LBNHC (NHD), and a tp-1 decode instance
    without prefix caching whose colocated answers are the reference; keys ("prefill",
    tp), ("decode", tp), "prefill32", "decode32", "reference". The tp-9 decode instance
    fans out (`--kv-fan-out on`: its three workers holding a KV head read it once, one
    over the "link", the other two copying from it), as across hosts by default."""
    dep = Deployment()
    try:
        urls: dict[object, str] = {}
        for role in ("prefill", "decode"):
            for tp in (1, 3, 9):
                fan = {"kv_fan_out": "on"} if (role, tp) == ("decode", 9) else {}
                config = small_instance(role, tp, **fan)
                urls[(role, tp)] = dep.start_instance(f"{role}{tp}", config).url
        for role in ("prefill", "decode"):
            urls[f"{role}32"] = dep.start_instance(
                f"{role}32", small_instance(role, 1, 32, "LBNHC")
            ).url
        urls["reference"] = dep.start_instance(
            "reference", small_instance("decode", 1, enable_prefix_caching=False)
        ).url
        dep.wait_healthy(900, say=None)
        yield urls
    finally:
        dep.stop()
