"""examples/embed_minimal.py, the runnable companion of docs/embedding.md: two toy
engines host the connector contract (a `KVConnectorScheduler` in each driver, a
`KVConnectorWorker` in each worker process), hand a request's KV over and check every
byte; and its checker, which must catch what a wrong transfer would leave behind."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "embed_minimal.py"


def load_example() -> types.ModuleType:
    """The example as a module (nothing starts: its processes start under __main__)."""
    spec = importlib.util.spec_from_file_location("embed_minimal", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the structs' annotations here
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_example_moves_the_kv_and_prints_verified() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "verified", proc.stdout
    assert any(line.startswith("decode: 4 workers pulled 46080 B") for line in lines)
    assert "decode: RUNNING from the prefill's first token 7" in lines
    # the prefill's blocks came back because every reader said it pulled (not a lease)
    assert any(
        line.startswith("prefill: 2 workers released the blocks after")
        and line.endswith(": completed")
        for line in lines
    ), proc.stdout


def test_example_writes_the_request_where_its_layout_puts_it() -> None:
    ex = load_example()
    layout, rank, block_ids, n = ex.DECODE, 1, [5, 2], 45
    shard = layout.workers(ex.MODEL)[rank]
    cache = np.zeros(ex.cache_shape(ex.MODEL, layout, shard, 8), dtype=ex.MODEL.dtype)
    ex.write_request(cache, layout, rank, block_ids, n)
    values = ex.kv_values(shard, n)  # [layer, K/V, head, token, channel]
    assert values.min() > 0
    bits = cache.view(np.uint16)  # LBNHC: [layer][K/V][block][token][head][channel]
    assert layout.cache_layout.order == "LKBNHC"
    assert (bits[3, 1, 2, 44 - 32, 0, :] == values[3, 1, 0, 44, :]).all()  # last token
    assert (bits[0, 0, 5, 7, 0, :] == values[0, 0, 0, 7, :]).all()
    assert np.count_nonzero(bits) == values.size  # nothing outside the request's slots
    assert ex.check_cache(cache, layout, rank, block_ids, n) == ""


def test_example_check_names_the_first_wrong_element() -> None:
    ex = load_example()
    layout, rank, block_ids, n = ex.DECODE, 2, [6, 1], 45
    shard = layout.workers(ex.MODEL)[rank]
    cache = np.zeros(ex.cache_shape(ex.MODEL, layout, shard, 8), dtype=ex.MODEL.dtype)
    ex.write_request(cache, layout, rank, block_ids, n)
    bits = cache.view(np.uint16)
    bits[2, 1, 1, 12, 0, 3] ^= 1  # token 32 + 12 = 44 of layer 2, V
    assert ex.check_cache(cache, layout, rank, block_ids, n) == (
        "decode worker 2: 1 wrong element(s), the first at layer 2 V head 2 block 1 slot 12 "
        "channel 3"
    )
    bits[2, 1, 1, 12, 0, 3] ^= 1
    bits[0, 0, 3, 0, 0, 0] = 7  # a block the request does not own
    assert "1 wrong element(s), the first at layer 0 K head 2 block 3 slot 0" in ex.check_cache(
        cache, layout, rank, block_ids, n
    )
    # a request landed in the wrong blocks is caught too
    assert "wrong element(s)" in ex.check_cache(cache, layout, rank, block_ids[::-1], n)
