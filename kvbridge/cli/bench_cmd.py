"""`kvbridge bench ...`: benchmarks that print figures (never tests).

Each benchmark lives with its layer and exposes ``add_arguments(parser)`` and a
runner; this module only wires them under one command.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections.abc import Callable

import numpy as np

from kvbridge.plan.copylist import copy_lists
from kvbridge.plan.geometry import AttentionKind, ModelKVSpec
from kvbridge.plan.layout import CacheLayout, InstanceLayout
from kvbridge.plan.planner import make_plan
from kvbridge.plan.verifier import count_contiguous_runs


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks that print figures")
    bench = p.add_subparsers(dest="bench", metavar="BENCH")
    bp = bench.add_parser(
        "plan",
        help="time plan + copy lists for a large request",
        description="Plan + copy lists for an 80-layer model (8 KV heads, head_dim 128, bf16), "
        "prefill tp 8 -> decode tp 16, block size 16, for the BHLNC, LBHNC (HND) and LBNHC "
        "(NHD) cache layouts.",
    )
    bp.add_argument("--tokens", type=int, default=32768, help="request length (default 32768)")
    bp.add_argument("--repeat", type=int, default=5, help="timed repetitions (default 5)")
    bp.set_defaults(handler=run_plan_bench, extra=None)

    for name, module, runner, extra, help_ in (
        (
            "transfer",
            "kvbridge.harness.transfer_bench",
            "run_transfer_bench",
            "transfer",
            "the plan's NIXL transfer vs one single-descriptor READ and a memcpy",
        ),
        (
            "comm",
            "kvbridge.cli.bench_comm",
            "run_comm_bench",
            "engine",
            "all-reduce latency: shared memory vs gloo",
        ),
        (
            "engine",
            "kvbridge.cli.bench_engine",
            "run",
            "engine",
            "TTFT and decode tokens/s at tp 1, 3, 9 next to transformers",
        ),
    ):
        mod = importlib.import_module(module)
        sp = bench.add_parser(name, help=help_, description=(mod.__doc__ or "").strip())
        mod.add_arguments(sp)
        sp.set_defaults(handler=getattr(mod, runner), extra=extra)

    bs = bench.add_parser(
        "serve",
        help="TTFT/TPOT disaggregated vs colocated through the proxy",
        description="Starts a prefill and a decode instance; measures TTFT and TPOT of "
        "streamed greedy completions disaggregated (prefill -> decode) and colocated on the "
        "decode instance, at each concurrency, in the same run.",
    )
    bs.add_argument("--model", default="smollm2-135m")
    bs.add_argument("--prefill-tp", type=int, default=3)
    bs.add_argument("--decode-tp", type=int, default=9)
    bs.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    bs.add_argument("--prompt-words", type=int, default=100, help="words per prompt")
    bs.add_argument("--max-tokens", type=int, default=32)
    bs.add_argument("--rounds", type=int, default=2, help="batches per concurrency level")
    bs.add_argument(
        "--kv-cache-mb",
        type=int,
        default=256,
        help="KV cache per worker (MiB; default 256: room for 8 concurrent requests of "
        "100 words, or every conversation of --multi-turn)",
    )
    bs.add_argument(
        "--idle-s",
        type=float,
        default=5.0,
        help="seconds over which each instance's idle CPU is measured (default 5)",
    )
    mt = bs.add_argument_group("multi-turn chat (--multi-turn)")
    mt.add_argument(
        "--multi-turn",
        action="store_true",
        help="chat conversations with prefix caching on and off, in the same run: per turn "
        "TTFT, prompt/cached/computed tokens and KV bytes pulled",
    )
    mt.add_argument("--conversations", type=int, default=4, help="conversations (default 4)")
    mt.add_argument("--turns", type=int, default=5, help="turns per conversation (default 5)")
    mt.add_argument("--turn-words", type=int, default=40, help="words per user turn")
    mt.add_argument("--block-size", type=int, default=16)
    bs.set_defaults(handler=_lazy("kvbridge.serve.bench", "run_serve_bench"), extra="serve")
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1])


def _lazy(module: str, func: str) -> Callable[[argparse.Namespace], int]:
    """A handler that imports its (heavy) benchmark module only when run."""

    def handler(args: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(module), func)(args))

    return handler


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
    return 0 if ok else 1
