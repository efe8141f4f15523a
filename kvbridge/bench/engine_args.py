"""The flags of every command that starts a reference engine, and the `EngineConfig`
they make: `kvbridge generate` (kvbridge.cli) and `kvbridge bench engine` both add them.

argparse stays at this level (the CLI and the benchmarks): what goes to the engine is
the typed `EngineConfig`, never the parsed namespace. `layout_arg` is the argparse type
of every cache-layout flag (`kvbridge serve`'s too).
"""

from __future__ import annotations

import argparse
from typing import Any

from kvbridge.engine.config import EngineConfig
from kvbridge.errors import LayoutError
from kvbridge.plan.layout import DEFAULT_BLOCK_SIZE, DEFAULT_LAYOUT, LAYOUT_HELP, CacheLayout
from kvbridge.settings import DEFAULT_MODEL


def layout_arg(value: str) -> str:
    """argparse `type` for a cache layout flag: the layout's name, or exit 2 naming the
    value and the accepted names."""
    try:
        return CacheLayout.parse(value).name
    except LayoutError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by every command that starts an engine."""
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="a .gguf file, an HF directory, or a known name (default %(default)s)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument(
        "--cache-layout",
        "--layout",
        type=layout_arg,
        default=DEFAULT_LAYOUT,
        metavar="LAYOUT",
        help=LAYOUT_HELP,
    )
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV-cache blocks per worker (default: sized by --kv-cache-mb)",
    )
    p.add_argument("--kv-cache-mb", type=int, default=EngineConfig.kv_cache_mb)
    p.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="turn automatic prefix caching off (every prompt is computed whole)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per worker (default: OMP_NUM_THREADS if set, else 2 at tp 1 and 1 per worker otherwise)",
    )


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The `EngineConfig` of the flags `add_engine_arguments` added (`overrides` win)."""
    kwargs: dict[str, Any] = dict(
        tp_size=args.tp,
        block_size=args.block_size,
        cache_layout=args.cache_layout,
        num_blocks=args.num_blocks,
        kv_cache_mb=args.kv_cache_mb,
        num_threads=args.threads,
        enable_prefix_caching=args.prefix_caching,
    )
    kwargs.update(overrides)
    return EngineConfig(**kwargs)
