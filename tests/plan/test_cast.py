"""A KV dtype converted in flight: the cast rounds as torch does, a converting plan
reads into the decode side's staging (byte-exact, verified) and the cast of its copy
lists' runs fills exactly the cells read; pairs that do not convert are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import IncompatibleError
from kvbridge.plan import cast as cast_module
from kvbridge.plan.cast import CASTABLE, Cast, cast_runs
from kvbridge.plan.copylist import copy_lists
from kvbridge.plan.layout import InstanceLayout, cache_shape, num_regions
from kvbridge.plan.planner import make_plan
from kvbridge.plan.verifier import apply_copy_lists, region_bytes, verify_plan
from tests.plan.test_planner import synthetic

PAIRS = [(s, d) for s in CASTABLE for d in CASTABLE if s != d]


def raw(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes (uint8), whatever its dtype."""
    ints = {4: torch.int32, 2: torch.int16}[t.element_size()]
    return t.contiguous().view(ints).numpy().view(np.uint8)


@settings(max_examples=30, deadline=None)
@given(
    pair=st.sampled_from(PAIRS),
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([1e-42, 1e-8, 1.0, 3e4, 1e38]),  # subnormal .. near overflow
)
def test_the_cast_gives_torch_bytes(pair: tuple[str, str], seed: int, scale: float) -> None:
    """Every pair's cast of any values (subnormals, ties, overflow to inf, signed zero,
    inf) gives the bytes torch's `Tensor.to` gives from the same source bytes."""
    src, dst = pair
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(4096, generator=g) * scale
    values[:4] = torch.tensor([0.0, -0.0, float("inf"), -float("inf")])
    source = values.to(getattr(torch, src))
    want = raw(source.to(getattr(torch, dst)))
    assert np.array_equal(Cast(src, dst)(raw(source)), want)


def test_pairs_that_do_not_convert_are_refused_naming_both_and_what_works() -> None:
    model = synthetic(2, 4, 2, head_dim=8, dtype="float32")
    fp8 = InstanceLayout(1, dtype="float8_e4m3fn")
    with pytest.raises(
        IncompatibleError,
        match=r"prefill KV dtype=float32 but decode KV dtype=float8_e4m3fn; .* "
        r"two of float32, bfloat16, float16",
    ):
        make_plan(model, InstanceLayout(1), fp8)
    assert make_plan(model, InstanceLayout(1), InstanceLayout(2)).cast is None


@pytest.mark.parametrize("sliced", [True, False], ids=["run-by-run", "indexed"])
@pytest.mark.parametrize("src, dst", PAIRS)
def test_a_converting_plan_reads_into_the_staging_and_casts_exactly_the_cells_read(
    src: str, dst: str, sliced: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill tp 1 (BHLNC, block 16) -> decode tp 2 (LBHNC, block 8) of another dtype,
    a partial pull of tokens [5, 37): the plan reads the prefill's bytes into a staging
    of the decode layout in the prefill's dtype (verified byte-exact; on one host it
    does not fan out), and casting its copy lists' destination runs writes torch's cast
    of exactly the cells read into the decode cache, nothing else: run by run (few
    runs) or through element indices (many)."""
    if not sliced:
        monkeypatch.setattr(cast_module, "SLICED_RUNS", 0)
    model = synthetic(3, 4, 2, head_dim=8, dtype=src)
    prefill = InstanceLayout(1, block_size=16, cache_layout="BHLNC")
    decode = InstanceLayout(2, block_size=8, cache_layout="LBHNC", dtype=dst)
    plan = make_plan(model, prefill, decode, decode_hosts=["h", "h"])
    assert plan.cast == Cast(src, dst) and plan.decode.dtype == src and not plan.local_copies
    verify_plan(plan, num_tokens=37, start_token=5)
    rng = np.random.default_rng(0)
    p = plan.prefill_workers[0]
    p_cache = torch.from_numpy(rng.standard_normal(cache_shape(model, prefill, p, 4)))
    p_cache = p_cache.to(getattr(torch, src))
    p_bytes = region_bytes(raw(p_cache), num_regions(model, prefill, p))
    dst_model = model.with_dtype(dst)
    for d in plan.decode_workers:
        shape = cache_shape(model, plan.decode, d, 8)
        n = num_regions(model, plan.decode, d)
        staging = np.zeros(int(np.prod(shape)) * plan.cast.src_itemsize, np.uint8)
        cache = np.zeros(int(np.prod(shape)) * plan.cast.dst_itemsize, np.uint8)
        assert cache_shape(dst_model, decode, d, 8) == shape
        lists = copy_lists(plan, d.rank, [2, 0, 3], [6, 1, 4, 7, 2], 37, 5)
        apply_copy_lists(p_bytes, region_bytes(staging, n), lists)
        runs = [
            np.concatenate([getattr(cl, f) for cl in lists])
            for f in ("dst_regions", "dst_offsets", "lengths")
        ]
        written = cast_runs(
            plan.cast, list(region_bytes(staging, n)), list(region_bytes(cache, n)), *runs
        )
        assert (
            written
            == sum(cl.nbytes for cl in lists) // plan.cast.src_itemsize * plan.cast.dst_itemsize
        )
        read = torch.from_numpy(staging.view({4: np.int32, 2: np.int16}[plan.cast.src_itemsize]))
        read = read.view(getattr(torch, src))
        want = raw(read.to(getattr(torch, dst)))  # zeros stay zeros: cells not read
        assert np.array_equal(cache, want) and np.count_nonzero(cache) > 0
