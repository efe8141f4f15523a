"""Entry point of the `kvbridge` console script.

Each subcommand lives in its own module exposing ``register(subparsers)``; heavy
imports (torch, NIXL, msgspec, FastAPI) happen inside the handlers, so the base install
(numpy, rich) runs `kvbridge plan` and every command's `--help`, and a command whose
extra is missing says which one to install.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvbridge.errors import KVBridgeError

#: Which extra installs a third-party module (for a command that declares none).
EXTRA_OF_MODULE = {
    "torch": "engine",
    "gguf": "engine",
    "tokenizers": "engine",
    "safetensors": "engine",
    "jinja2": "engine",
    "nixl_cu12": "transfer",
    "zmq": "transfer",
    "msgspec": "transfer",
    "fastapi": "serve",
    "uvicorn": "serve",
    "httpx": "serve",
    "matplotlib": "map",
}

#: Modules that register subcommands, in help order. Each sets `extra` (the extra its
#: handler needs, None for the base install) next to its handler.
SUBCOMMAND_MODULES = [
    "kvbridge.cli.plan_cmd",
    "kvbridge.cli.serve_cmd",
    "kvbridge.cli.bench_cmd",
    "kvbridge.cli.transfer_cmd",
    "kvbridge.cli.generate_cmd",
    "kvbridge.cli.credential_cmd",
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
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if not missing or missing == "kvbridge":
            raise
        extra = getattr(args, "extra", None) or EXTRA_OF_MODULE.get(missing, "all")
        print(
            f"kvbridge {args.command}: error: this command needs the '{extra}' extra "
            f"(module {missing!r} is not installed): pip install 'kvbridge[{extra}]'",
            file=sys.stderr,
        )
        return 2
    except KVBridgeError as exc:
        print(f"kvbridge {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvbridge {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
