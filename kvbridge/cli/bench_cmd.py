"""`kvbridge bench ...`: benchmarks that print figures (never tests).

Each benchmark lives in `kvbridge.bench` and exposes ``add_arguments(parser)`` and a
runner; this module only wires them under one command.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

from kvbridge.bench import plan as plan_bench
from kvbridge.cli.serve_cmd import DEFAULT_TP
from kvbridge.plan.layout import DEFAULT_BLOCK_SIZE
from kvbridge.serve.config import InstanceConfig


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
    plan_bench.add_arguments(bp)
    bp.set_defaults(handler=plan_bench.run_plan_bench, extra=None)

    for name, module, runner, extra, help_ in (
        (
            "transfer",
            "kvbridge.bench.transfer",
            "run_transfer_bench",
            "transfer",
            "the plan's NIXL transfer vs one single-descriptor READ and a memcpy",
        ),
        (
            "first-pull",
            "kvbridge.bench.first_pull",
            "run_first_pull_bench",
            "serve",
            "the first pull across test hosts against later ones, per start order",
        ),
        (
            "comm",
            "kvbridge.bench.comm",
            "run_comm_bench",
            "engine",
            "all-reduce latency: shared memory vs gloo",
        ),
        (
            "engine",
            "kvbridge.bench.engine",
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
    bs.add_argument("--model", default=InstanceConfig.model)
    bs.add_argument("--prefill-tp", type=int, default=DEFAULT_TP["prefill"])
    bs.add_argument("--decode-tp", type=int, default=DEFAULT_TP["decode"])
    bs.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    bs.add_argument("--prompt-words", type=int, default=100, help="words per prompt")
    bs.add_argument("--max-tokens", type=int, default=32)
    bs.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="batches per concurrency level (default: enough for 8 requests, at least 2, "
        "so each level's medians, the pull at concurrency 1 among them, are of 8 or more)",
    )
    bs.add_argument(
        "--kv-cache-mb",
        type=int,
        default=InstanceConfig.kv_cache_mb,
        help="KV cache per worker (MiB; default %(default)s: room for 8 concurrent requests "
        "of 100 words, or every conversation of --multi-turn)",
    )
    bs.add_argument(
        "--no-cpu-priority",
        dest="cpu_priority",
        action="store_false",
        help="start the instances with kvbridge serve --no-cpu-priority (every thread at "
        "the same priority) instead of the default",
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
    mt.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    bs.set_defaults(handler=_lazy("kvbridge.bench.serve", "run_serve_bench"), extra="serve")
    from kvbridge.bench import vllm as vllm_bench  # (its heavy imports are in its runner)

    bv = bench.add_parser(
        "vllm",
        help="KVBridgeConnector vs vLLM's NixlConnector vs colocated vLLM (run in .venv-vllm)",
        description=(vllm_bench.__doc__ or "").strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    vllm_bench.add_arguments(bv)
    bv.set_defaults(handler=vllm_bench.run, extra="vllm")
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1])


def _lazy(module: str, func: str) -> Callable[[argparse.Namespace], int]:
    """A handler that imports its (heavy) benchmark module only when run."""

    def handler(args: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(module), func)(args))

    return handler
