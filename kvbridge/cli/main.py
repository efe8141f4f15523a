"""Entry point of the `kvbridge` console script.

Each subcommand lives in its own module exposing ``register(subparsers)``; heavy
imports (torch, NIXL) happen inside the handlers so `kvbridge plan` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvbridge.errors import KVBridgeError

#: Modules that register subcommands, in help order.
SUBCOMMAND_MODULES = [
    "kvbridge.cli.plan_cmd",
    "kvbridge.cli.serve_cmd",
    "kvbridge.cli.bench_cmd",
    "kvbridge.cli.transfer_cmd",
    "kvbridge.cli.generate_cmd",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbridge",
        description="Move paged KV caches between prefill and decode instances of any layout.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except KVBridgeError as exc:
        print(f"kvbridge {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvbridge {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
