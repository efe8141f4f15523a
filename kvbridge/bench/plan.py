"""`kvbridge bench plan`: plan + copy lists for a large request (numpy only, base install).

An 80-layer model (8 KV heads, head_dim 128, bf16), prefill tp 8 -> decode tp 16, block
size 16, for the BHLNC, LBHNC (HND) and LBNHC (NHD) cache layouts; checks that merged
descriptors equal the contiguous runs. Then what a KV dtype converted in flight costs a
decode worker per pull (`plan.cast`): the cast of its copy lists' runs of a
`CAST_TOKENS`-token request (or `--tokens`, if shorter) from its staging into its cache,
against a memcpy of the same bytes in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvbridge.plan.cast import cast_runs
from kvbridge.plan.copylist import copy_lists
from kvbridge.plan.geometry import AttentionKind, ModelKVSpec
from kvbridge.plan.layout import CacheLayout, InstanceLayout, cache_shape, num_regions
from kvbridge.plan.planner import make_plan
from kvbridge.plan.verifier import count_contiguous_runs, region_bytes

#: the longest request the cast is timed on (one decode worker's share of it is cast;
#: `--tokens` if shorter)
CAST_TOKENS = 2048
#: the (prefill, decode) cache dtypes the cast is timed between
CAST_PAIRS = (("bfloat16", "float16"), ("bfloat16", "float32"), ("float32", "bfloat16"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=32768, help="request length (default 32768)")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions (default 5)")


def _time_plan(
    model: ModelKVSpec,
    prefill: InstanceLayout,
    decode: InstanceLayout,
    tokens: int,
    p_ids: np.ndarray,
    d_ids: np.ndarray,
    repeat: int,
) -> tuple[float, int, int, int]:
    """Median seconds for plan + every decode worker's copy lists, and the counts."""
    times = []
    lists = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = make_plan(model, prefill, decode)
        lists = [
            cl for d in plan.decode_workers for cl in copy_lists(plan, d.rank, p_ids, d_ids, tokens)
        ]
        times.append(time.perf_counter() - t0)
    unmerged = sum(cl.num_unmerged for cl in lists)
    merged = sum(cl.num_descriptors for cl in lists)
    runs = sum(count_contiguous_runs(cl, model.head_bytes) for cl in lists)
    return statistics.median(times), unmerged, merged, runs


def run_plan_bench(args: argparse.Namespace) -> int:
    model = ModelKVSpec(
        num_layers=80,
        num_attention_heads=64,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        attention=AttentionKind.GQA,
        name="80-layer GQA",
    )
    tokens = args.tokens
    rng = np.random.default_rng(0)
    print(
        f"{model.describe()}; {tokens}-token request, prefill tp 8 -> decode tp 16, "
        f"block size 16; median of {args.repeat}"
    )
    print(
        f"{'layout':7} {'block ids':11} {'ms':>8} {'descriptors':>12} {'merged':>10} "
        f"{'contiguous runs':>16}"
    )
    need = -(-tokens // 16)
    id_sets = {
        "contiguous": (np.arange(need), np.arange(need)),
        "shuffled": (rng.permutation(2 * need)[:need], rng.permutation(2 * need)[:need]),
    }
    ok = True
    for layout in ("BHLNC", "LBHNC", "LBNHC"):
        prefill = InstanceLayout(8, block_size=16, cache_layout=CacheLayout.parse(layout))
        decode = InstanceLayout(16, block_size=16, cache_layout=CacheLayout.parse(layout))
        for name, (p_ids, d_ids) in id_sets.items():
            sec, unmerged, merged, runs = _time_plan(
                model, prefill, decode, tokens, p_ids, d_ids, args.repeat
            )
            ok &= merged == runs
            print(
                f"{layout:7} {name:11} {sec * 1e3:8.2f} {unmerged:12d} {merged:10d} "
                f"{runs:16d}{'' if merged == runs else '  MISMATCH'}"
            )
    # A harder pairing: several heads per worker and mixed layouts (no shared contiguity).
    prefill = InstanceLayout(2, block_size=16, cache_layout=CacheLayout.NHD)
    decode = InstanceLayout(4, block_size=32, cache_layout=CacheLayout.HND)
    p_ids, d_ids = rng.permutation(need), rng.permutation(-(-tokens // 32))
    sec, unmerged, merged, runs = _time_plan(
        model, prefill, decode, tokens, p_ids, d_ids, args.repeat
    )
    ok &= merged == runs
    print(
        f"extra: tp 2 NHD block 16 -> tp 4 HND block 32, shuffled: {sec * 1e3:.2f} ms, "
        f"{unmerged} descriptors, {merged} merged, {runs} contiguous runs"
    )
    print("merged == contiguous runs: " + ("yes" if ok else "NO"))
    _time_casts(model, min(tokens, CAST_TOKENS), args.repeat)
    return 0 if ok else 1


def _time_casts(model: ModelKVSpec, tokens: int, repeat: int) -> None:
    """The cast of decode worker 0's share of a `tokens`-token pull, prefill tp 8 ->
    decode tp 16 of another cache dtype, against a memcpy of the bytes it reads."""
    need = -(-tokens // 16)
    ids = np.random.default_rng(1).permutation(2 * need)[:need]
    print(
        f"the cast of decode worker 0's share of a {tokens}-token pull into a cache of "
        f"another dtype, against a memcpy of the same bytes (median of {repeat}):"
    )
    normals: dict[int, np.ndarray] = {}  # the staged values by size (drawn once: seed 2)
    for layout in ("BHLNC", "LBHNC"):
        for src, dst in CAST_PAIRS:
            model = model.with_dtype(src)
            prefill = InstanceLayout(8, block_size=16, cache_layout=CacheLayout.parse(layout))
            decode = InstanceLayout(
                16, block_size=16, cache_layout=CacheLayout.parse(layout), dtype=dst
            )
            plan = make_plan(model, prefill, decode)
            assert plan.cast is not None
            d = plan.decode_workers[0]
            lists = copy_lists(plan, 0, ids, ids, tokens)
            runs = [
                np.concatenate([getattr(cl, f) for cl in lists])
                for f in ("dst_regions", "dst_offsets", "lengths")
            ]
            n = num_regions(model, plan.decode, d)
            elems = int(np.prod(cache_shape(model, plan.decode, d, 2 * need)))
            if elems not in normals:
                normals[elems] = np.random.default_rng(2).standard_normal(elems, dtype=np.float32)
            values = normals[elems]
            staging = values.view(np.uint8)
            if src == "bfloat16":  # the upper halves of the float32 normals
                staging = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
            cache = np.zeros(elems * plan.cast.dst_itemsize, np.uint8)
            nbytes = int(runs[2].sum())
            copy_src, copy_dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
            cast_s, copy_s = [], []
            for _ in range(repeat):
                t0 = time.perf_counter()
                cast_runs(
                    plan.cast, list(region_bytes(staging, n)), list(region_bytes(cache, n)), *runs
                )
                cast_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                np.copyto(copy_dst, copy_src)
                copy_s.append(time.perf_counter() - t0)
            c, m = statistics.median(cast_s), statistics.median(copy_s)
            print(
                f"  {layout} {src} -> {dst}: {nbytes / 2**20:.0f} MiB in {len(runs[2])} "
                f"runs: cast {c * 1e3:.1f} ms, memcpy {m * 1e3:.1f} ms ({c / m:.1f}x)"
            )
