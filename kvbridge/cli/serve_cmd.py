"""`kvbridge serve` and `kvbridge demo`: disaggregated serving behind an OpenAI API.

kvbridge serve                       proxy :8300 + prefill (tp 3) + decode (tp 9)
kvbridge serve --role prefill --tp 3 --port 8301
kvbridge serve --role decode  --tp 9 --port 8302
kvbridge serve --role proxy --prefill http://h1:8301 --decode http://h2:8302
"""

from __future__ import annotations

import argparse
import sys
import uuid

from kvbridge.cli.plan_cmd import layout_arg
from kvbridge.errors import ConfigError
from kvbridge.plan.layout import DEFAULT_LAYOUT, LAYOUT_HELP


def add_instance_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="a .gguf file, an HF directory, or smollm2-135m (default)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address the HTTP server binds (default 127.0.0.1)"
    )
    p.add_argument(
        "--kv-host",
        default=None,
        help="address of the KV side channel (default: --host); other hosts "
        "reach the prefill workers there",
    )
    p.add_argument(
        "--kv-port",
        type=int,
        default=0,
        help="first side-channel port (worker r uses port+r; default: any free)",
    )
    p.add_argument(
        "--kv-load-failure",
        choices=["recompute", "fail"],
        default="recompute",
        help="when a KV pull fails: recompute the prompt on the decode instance "
        "(default) or answer an error",
    )
    p.add_argument(
        "--lease-s",
        type=float,
        default=120.0,
        help="prefill blocks are freed after this long if no decode pulls them",
    )
    p.add_argument(
        "--transfer-timeout-s",
        type=float,
        default=30.0,
        help="a KV pull not finished after this long fails",
    )
    p.add_argument(
        "--handshake-timeout-s",
        type=float,
        default=15.0,
        help="a first contact with a prefill instance not answered after this long fails",
    )
    p.add_argument(
        "--kv-token-file",
        default=None,
        help="shared secret authenticating side-channel peers (or set KVBRIDGE_TRANSFER_TOKEN)",
    )
    p.add_argument("--kv-cache-mb", type=int, default=256, help="KV cache per worker (MiB)")
    p.add_argument(
        "--start-timeout-s",
        type=float,
        default=900.0,
        help="give up if the instances are not ready after this long",
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model disaggregated (prefill -> decode) behind an OpenAI API",
        description="Start the OpenAI-compatible proxy with a prefill and a decode instance "
        "(or one role alone). Ctrl-C stops everything.",
    )
    p.add_argument("--role", choices=["all", "prefill", "decode", "proxy"], default="all")
    p.add_argument("--port", type=int, default=8300, help="HTTP port (default 8300; 0: any)")
    p.add_argument("--port-file", default=None, help=argparse.SUPPRESS)  # launcher-internal
    for side, tp in (("prefill", 3), ("decode", 9)):
        p.add_argument(f"--{side}-tp", type=int, default=tp, help=f"{side} tp (default {tp})")
        p.add_argument(f"--{side}-pp", type=int, default=1, help=f"{side} pp (1 only for now)")
        p.add_argument(f"--{side}-block-size", type=int, default=16)
        p.add_argument(
            f"--{side}-layout",
            type=layout_arg,
            default=DEFAULT_LAYOUT,
            metavar="LAYOUT",
            help=f"{side} cache layout (default {DEFAULT_LAYOUT}; see --layout)",
        )
    p.add_argument("--tp", type=int, default=None, help="tp of a single prefill/decode role")
    p.add_argument("--block-size", type=int, default=16, help="block size of a single role")
    p.add_argument(
        "--layout",
        "--cache-layout",
        type=layout_arg,
        default=DEFAULT_LAYOUT,
        metavar="LAYOUT",
        help=f"{LAYOUT_HELP} (of a single role)",
    )
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="prefill instance URL (role proxy; repeat for round-robin)",
    )
    p.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL",
        help="decode instance URL (role proxy; repeat for round-robin)",
    )
    add_instance_arguments(p)
    p.set_defaults(handler=run_serve)

    d = sub.add_parser(
        "demo",
        help="start the default serve, ask it one question, check the answer, exit",
        description="Starts prefill tp 3 -> decode tp 9, sends the prompt through the "
        "OpenAI API, prints the completion and the stages, and checks the text equals "
        "the same request generated colocated.",
    )
    d.add_argument("prompt", nargs="?", default="The capital of France is")
    d.add_argument("--max-tokens", type=int, default=10)
    for side, tp in (("prefill", 3), ("decode", 9)):
        d.add_argument(f"--{side}-tp", type=int, default=tp)
        d.add_argument(f"--{side}-pp", type=int, default=1)
        d.add_argument(f"--{side}-block-size", type=int, default=16)
        d.add_argument(
            f"--{side}-layout", type=layout_arg, default=DEFAULT_LAYOUT, metavar="LAYOUT"
        )
    d.add_argument("--port", type=int, default=8300)
    add_instance_arguments(d)
    d.set_defaults(handler=run_demo)


def _check_pp(args: argparse.Namespace) -> None:
    for side in ("prefill", "decode"):
        pp = getattr(args, f"{side}_pp", 1)
        if pp != 1:
            raise ConfigError(
                f"--{side}-pp={pp}: the reference engine runs pp_size=1 only; "
                f"the planner and transfer runtime handle pp; use --{side}-pp 1 here"
            )


def instance_args(args: argparse.Namespace, side: str) -> list[str]:
    """The command line of one child instance of a full deployment."""
    out = [
        "--role",
        side,
        "--model",
        args.model,
        "--tp",
        str(getattr(args, f"{side}_tp")),
        "--block-size",
        str(getattr(args, f"{side}_block_size")),
        "--layout",
        getattr(args, f"{side}_layout"),
        "--kv-load-failure",
        args.kv_load_failure,
        "--lease-s",
        str(args.lease_s),
        "--transfer-timeout-s",
        str(args.transfer_timeout_s),
        "--handshake-timeout-s",
        str(args.handshake_timeout_s),
        "--kv-cache-mb",
        str(args.kv_cache_mb),
        "--kv-port",
        str(args.kv_port),
    ]
    if args.kv_host:
        out += ["--kv-host", args.kv_host]
    if args.kv_token_file:
        out += ["--kv-token-file", args.kv_token_file]
    return out


def run_serve(args: argparse.Namespace) -> int:
    if args.role in ("prefill", "decode"):
        from kvbridge.serve.instance_main import run_instance

        return run_instance(args)
    from kvbridge.serve.proxy_main import run_proxy

    if args.role == "proxy":
        if not args.decode:
            raise ConfigError(
                "--role proxy needs at least one --decode URL "
                "(and --prefill URLs for disaggregation)"
            )
        return run_proxy(args, args.prefill, args.decode)
    _check_pp(args)
    from kvbridge.serve.launcher import Deployment

    dep = Deployment()
    try:
        prefill = dep.start_instance("prefill", instance_args(args, "prefill"), args.host)
        decode = dep.start_instance("decode", instance_args(args, "decode"), args.host)
        print(
            f"loading {args.model}: prefill tp {args.prefill_tp}, decode tp {args.decode_tp} ...",
            file=sys.stderr,
        )
        dep.wait_healthy(args.start_timeout_s, say=lambda s: print(s, file=sys.stderr))
        return run_proxy(args, [prefill.url], [decode.url])
    finally:
        dep.stop()


def run_demo(args: argparse.Namespace) -> int:
    _check_pp(args)
    from kvbridge.serve.demo import demo

    return demo(args, instance_args(args, "prefill"), instance_args(args, "decode"))


def new_instance_id(role: str) -> str:
    return f"{role}-{uuid.uuid4().hex[:8]}"
