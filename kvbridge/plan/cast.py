"""A KV dtype converted in flight: which pairs convert, and the cast of element runs.

A decode instance whose cache keeps another dtype than the prefill instance's reads the
prefill's bytes as they are into a staging buffer of its own (the decode cache's layout
and blocks, in the prefill's dtype: `staging_layout`), then casts each run it read into
its cache. The cast is elementwise and rounds to nearest, ties to even, as torch's
`Tensor.to` does on the CPU, so a converted cache holds exactly the bytes a cache of the
decode's dtype holds when the engine writes the same values into it:

    float32  -> bfloat16   the upper 16 bits, rounded on the lower 16 (NaN stays NaN)
    float32  -> float16    numpy's conversion (round to nearest even, subnormals, inf)
    bfloat16 -> float32    exact (16 zero bits appended); float16 -> float32 exact
    bfloat16 <-> float16   through float32: exact, then one rounding

fp8 (float8_e4m3fn, float8_e5m2) is not converted: numpy has no such type, and the
engines that keep an fp8 cache scale it (vLLM's per-layer k/v scales), which a plain
cast would not. Pure numpy; runs are the copy lists' destination runs (byte offsets in
the staging), which name the same elements in the cache (half-open [offset, offset + n)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.errors import IncompatibleError
from kvbridge.plan.geometry import DTYPE_SIZES, normalize_dtype
from kvbridge.plan.layout import InstanceLayout

#: the dtypes a cache may be converted from and to (any pair of two different ones)
CASTABLE = ("float32", "bfloat16", "float16")
#: up to this many runs (once adjacent ones are joined) a cast goes run by run over
#: slices; more (short runs: per-layer layouts) go through one element index per region
SLICED_RUNS = 4096


@dataclass(frozen=True)
class Cast:
    """A conversion between the prefill instance's cache dtype (`src`, what is read)
    and the decode instance's (`dst`, what its cache keeps); canonical names."""

    src: str
    dst: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "src", normalize_dtype(self.src))
        object.__setattr__(self, "dst", normalize_dtype(self.dst))
        check_castable(self.src, self.dst)

    @property
    def src_itemsize(self) -> int:
        return DTYPE_SIZES[self.src]

    @property
    def dst_itemsize(self) -> int:
        return DTYPE_SIZES[self.dst]

    def __call__(self, src: np.ndarray) -> np.ndarray:
        """The elements of `src` (raw bytes, uint8, a whole number of `src` elements) in
        the destination dtype, as raw bytes (uint8)."""
        return _from_f32(_to_f32(src, self.src), self.dst).view(np.uint8)


def check_castable(src: str, dst: str) -> None:
    """Raise IncompatibleError if a `src` cache cannot be converted into a `dst` one."""
    if src != dst and (src not in CASTABLE or dst not in CASTABLE):
        raise IncompatibleError(
            f"prefill KV dtype={src} but decode KV dtype={dst}; kvbridge converts the KV "
            f"between {', '.join(CASTABLE)} only (fp8 caches are scaled by their engine): "
            f"give both instances the same cache dtype or two of {', '.join(CASTABLE)}"
        )


def staging_layout(decode: InstanceLayout, src_dtype: str) -> InstanceLayout:
    """The layout a converting decode worker reads into: its cache's, in `src_dtype`."""
    return InstanceLayout(
        tp_size=decode.tp_size,
        pp_size=decode.pp_size,
        block_size=decode.block_size,
        cache_layout=decode.cache_layout,
        dtype=src_dtype,
        pp_layers=decode.pp_layers,
    )


def cast_runs(
    cast: Cast,
    staging: Sequence[np.ndarray],
    cache: Sequence[np.ndarray],
    regions: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
) -> int:
    """Cast the runs `(regions[i], offsets[i], lengths[i])` (bytes in the staging's
    regions, whole elements) from `staging` into the same elements of `cache` (one
    writable uint8 array per region on each side); returns the bytes written."""
    si, di = cast.src_itemsize, cast.dst_itemsize
    if len(lengths) and ((offsets % si).any() or (lengths % si).any()):
        raise IncompatibleError(
            f"a run to cast from {cast.src} is not whole {si}-byte elements; the staging "
            "and the copy lists disagree on the element size"
        )
    from kvbridge.plan.copylist import merge_runs  # (copylist imports the planner, which us)

    # sorted by (region, offset), each run joined to the one it continues
    regions, offsets, _, _, lengths = merge_runs(regions, offsets, regions, offsets, lengths)
    if len(lengths) <= SLICED_RUNS:  # few long runs: cast each slice, no index arrays
        for r, o, n in zip(regions.tolist(), offsets.tolist(), lengths.tolist(), strict=True):
            cache[r][o // si * di : (o + n) // si * di] = cast(staging[r][o : o + n])
        return int(lengths.sum()) // si * di
    written = 0
    for r in np.unique(regions).tolist():
        sel = regions == r
        elems = run_indices(offsets[sel] // si, lengths[sel] // si)
        src = staging[r].view(_UINT[si])[elems]
        out = cast(src.view(np.uint8)).view(_UINT[di])
        cache[r].view(_UINT[di])[elems] = out
        written += out.nbytes
    return written


def run_indices(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for every run (vectorized)."""
    total = int(counts.sum())
    first = np.repeat(starts - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    return first + np.arange(total, dtype=np.int64)


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _to_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return raw.view(np.float32)
    if dtype == "float16":
        return raw.view(np.float16).astype(np.float32)
    assert dtype == "bfloat16", dtype
    bits = raw.view(np.uint16).astype(np.uint32)
    bits <<= 16
    return bits.view(np.float32)


def _from_f32(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return x
    if dtype == "float16":
        with np.errstate(over="ignore"):  # beyond float16's range: inf, as torch gives
            return x.astype(np.float16)
    assert dtype == "bfloat16", dtype
    bits = x.view(np.uint32)
    # round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, keep the top
    r = bits >> 16
    r &= 1
    r += 0x7FFF
    r += bits
    r >>= 16
    rounded = r.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # a quiet NaN of the same sign (rounding could carry into inf)
        rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return rounded
