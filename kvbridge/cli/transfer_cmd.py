"""`kvbridge transfer-check`: move real KV bytes between real worker processes and verify.

Starts the prefill and decode workers on this machine (one NIXL agent each), runs
`--requests` concurrent requests of `--tokens` tokens through the transfer runtime,
checks every decode worker byte for byte and every block released on both sides.
`--json` prints exactly one object. Exit 0 only if everything verified, 1 if not,
2 for a bad or unsupported configuration. The worker processes are gone when it
exits, also on Ctrl-C or error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from kvbridge.cli.plan_cmd import add_layout_arguments, layouts_from_args
from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.plan.geometry import AttentionKind, ModelKVSpec, load_model_spec


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "transfer-check",
        help="run real KV transfers between local worker processes and verify every byte",
        description="Start prefill and decode worker processes (one NIXL agent each), pull "
        "N concurrent requests through the transfer runtime, verify every byte and every "
        "release. Exit 0 only if everything verified.",
    )
    model = p.add_argument_group("model (a config, or a synthetic geometry)")
    model.add_argument("--config", metavar="PATH", help="HF config.json, .gguf or bundled name")
    model.add_argument("--num-layers", type=int, default=4, metavar="L", help="default 4")
    model.add_argument("--num-kv-heads", type=int, default=8, metavar="H", help="default 8")
    model.add_argument("--head-dim", type=int, default=64, metavar="D", help="default 64")
    model.add_argument(
        "--num-heads",
        type=int,
        default=None,
        metavar="Q",
        help="query heads (default: the smallest multiple of H both tp sizes divide)",
    )
    model.add_argument("--mla", action="store_true", help="an MLA cache (one latent of D)")
    model.add_argument("--dtype", default=None, help="KV dtype (default: config's, or bfloat16)")
    add_layout_arguments(p)
    p.add_argument("--requests", type=int, default=4, metavar="N", help="default 4")
    p.add_argument("--tokens", type=int, default=100, metavar="T", help="default 100")
    p.add_argument("--seed", type=int, default=0, help="block-id shuffle seed (default 0)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="default 60")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.set_defaults(handler=run, extra="transfer")


def model_from_args(args: argparse.Namespace) -> ModelKVSpec:
    if args.config:
        return load_model_spec(args.config, dtype=args.dtype)
    h = 1 if args.mla else args.num_kv_heads
    q = args.num_heads or math.lcm(max(h, 1), args.prefill_tp, args.decode_tp)
    if args.mla:
        kind = AttentionKind.MLA
    else:
        kind = AttentionKind.MHA if q == h else (AttentionKind.MQA if h == 1 else AttentionKind.GQA)
    return ModelKVSpec(
        num_layers=args.num_layers,
        num_attention_heads=q,
        num_kv_heads=h,
        head_dim=args.head_dim,
        dtype=args.dtype or "bfloat16",
        attention=kind,
        name="synthetic" if not args.mla else "synthetic-mla",
    )


def run(args: argparse.Namespace) -> int:
    from kvbridge.harness.check import run_check

    try:
        if args.requests < 1 or args.tokens < 1:
            raise ConfigError(
                f"--requests={args.requests} --tokens={args.tokens}; both must be >= 1"
            )
        # layouts first: they refuse a non-integer tp before the geometry uses it
        prefill, decode = layouts_from_args(args)
        model = model_from_args(args)
        report = run_check(
            model,
            prefill,
            decode,
            num_requests=args.requests,
            num_tokens=args.tokens,
            seed=args.seed,
            timeout_s=args.timeout,
        )
    except KVBridgeError as exc:
        if args.json:
            print(json.dumps(_error_json(str(exc), args)))
            return 2
        raise
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        _print(report, model)
    return 0 if report.verified else 1


def _error_json(error: str, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "verified": False,
        "requests": args.requests,
        "bytes": 0,
        "seconds": 0.0,
        "gbps": 0.0,
        "descriptors": 0,
        "failures": [error],
    }


def _print(report: Any, model: ModelKVSpec) -> None:
    print(f"model: {model.describe()}")
    print(f"prefill {report.prefill} -> decode {report.decode}")
    print(
        f"{report.requests} concurrent requests x {report.tokens} tokens: "
        f"{report.bytes} bytes in {report.seconds * 1e3:.1f} ms ({report.gbps:.2f} GB/s, "
        f"handshakes included)"
    )
    print(
        f"descriptors: {report.descriptors} posted after merging "
        f"({report.descriptors_unmerged} before)"
    )
    if report.verified:
        print("verified: every decode worker byte-exact; every block released on both sides")
    else:
        print(f"NOT verified: {len(report.failures)} failures", file=sys.stderr)
        for f in report.failures:
            print(f"  - {f}", file=sys.stderr)
