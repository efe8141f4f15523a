"""`kvbridge plan`: the pre-flight check of a prefill/decode pair.

Prints which bytes every decode worker reads from which prefill worker, what each
prefill worker waits for, and (with --verify) proves the plan byte-exact on a
synthetic multi-block request. It also plans the fan-out on the decode hosts
(`--decode-hosts`): decode workers of one host that hold the same bytes read them over
the link once and copy them on the host; that plan is shown apart (link and local
bytes), since the runtime does not execute it yet. `--json` prints exactly one object (a contract: see
`plan_to_json`); `--svg FILE` also draws the plan (see `plan_map`). Exit 0 when the
pair is supported, 2 when it is not (or the config is bad, or --svg cannot be
written), 1 if verification found wrong bytes (a bug).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import numpy as np

from kvbridge.errors import KVBridgeError, LayoutError
from kvbridge.plan.copylist import copy_lists
from kvbridge.plan.geometry import ModelKVSpec, load_model_spec
from kvbridge.plan.layout import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_LAYOUT,
    LAYOUT_HELP,
    InstanceLayout,
    WorkerShard,
)
from kvbridge.plan.model_config import bundled_config_names
from kvbridge.plan.planner import Read, TransferPlan, make_plan
from kvbridge.plan.verifier import VerificationError, VerifyReport, verify_plan


def _int_or_raw(value: str) -> int | str:
    """Keep a non-integer as given so the layout's own check names the field."""
    try:
        return int(value)
    except ValueError:
        return value


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """The --prefill-*/--decode-* layout flags shared by plan, bench and transfer-check."""
    for side, tp in (("prefill", 1), ("decode", 1)):
        g = parser.add_argument_group(f"{side} instance")
        g.add_argument(
            f"--{side}-tp",
            type=_int_or_raw,
            default=tp,
            metavar="N",
            help=f"{side} tensor-parallel size (default {tp})",
        )
        g.add_argument(
            f"--{side}-pp",
            type=_int_or_raw,
            default=1,
            metavar="N",
            help=f"{side} pipeline-parallel size (default 1)",
        )
        g.add_argument(
            f"--{side}-block-size",
            type=_int_or_raw,
            default=DEFAULT_BLOCK_SIZE,
            metavar="N",
            help="tokens per KV block (default %(default)s)",
        )
        g.add_argument(
            f"--{side}-layout", default=DEFAULT_LAYOUT, metavar="LAYOUT", help=LAYOUT_HELP
        )


def layouts_from_args(args: argparse.Namespace) -> tuple[InstanceLayout, InstanceLayout]:
    def side(name: str) -> InstanceLayout:
        try:
            return InstanceLayout(
                tp_size=getattr(args, f"{name}_tp"),
                pp_size=getattr(args, f"{name}_pp"),
                block_size=getattr(args, f"{name}_block_size"),
                cache_layout=getattr(args, f"{name}_layout"),
                dtype=getattr(args, "dtype", None),
            )
        except LayoutError as exc:
            raise LayoutError(f"{name} {exc}") from None

    return side("prefill"), side("decode")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="plan (and verify) the KV transfer between a prefill and a decode layout",
        description="Show which bytes every decode worker reads from which prefill worker. "
        "Exit 0 when the pair is supported, 2 when it is not.",
    )
    p.add_argument(
        "--config",
        required=True,
        metavar="PATH",
        help="HF config.json, .gguf file, directory, or bundled name "
        f"({', '.join(bundled_config_names())})",
    )
    add_layout_arguments(p)
    p.add_argument(
        "--dtype",
        default=None,
        help="KV-cache dtype (default: the config's torch_dtype; float32 for GGUF)",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="run the plan on a synthetic multi-block request and check every byte",
    )
    p.add_argument(
        "--tokens",
        type=_int_or_raw,
        default=None,
        metavar="T",
        help="tokens of the synthetic request (default: 3.5 blocks of the larger size)",
    )
    p.add_argument(
        "--decode-hosts",
        type=_int_or_raw,
        default=1,
        metavar="N",
        help="hosts the decode workers run on, consecutive ranks on each (default 1), "
        "for the fan-out plan: prefill and decode on different hosts, each byte over the "
        "link once per decode host",
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument(
        "--svg",
        default=None,
        metavar="FILE",
        help="also draw the plan (workers, one arrow per read) as SVG; needs matplotlib",
    )
    p.set_defaults(handler=run, extra=None)


def _range(r: tuple[int, int]) -> list[int]:
    return [r[0], r[1]]


def _worker_json(w: WorkerShard) -> dict[str, Any]:
    return {
        "rank": w.rank,
        "tp_rank": w.tp_rank,
        "pp_rank": w.pp_rank,
        "kv_heads": _range(w.kv_heads),
        "layers": _range(w.layers),
    }


def _layout_json(layout: InstanceLayout) -> dict[str, Any]:
    return {
        "tp": layout.tp_size,
        "pp": layout.pp_size,
        "block_size": layout.block_size,
        "layout": layout.cache_layout.name,
    }


def _read_json(r: Read) -> dict[str, Any]:
    return {
        "decode_rank": r.decode_rank,
        "prefill_rank": r.prefill_rank,
        "kv_heads": _range(r.kv_heads),
        "layers": _range(r.layers),
        "bytes_per_token": r.bytes_per_token,
    }


def decode_hosts(world_size: int, num_hosts: int | str) -> list[str]:
    """Host names of the decode ranks spread over `num_hosts` hosts, consecutive ranks on
    each (as evenly as they divide); LayoutError naming --decode-hosts when invalid."""
    if isinstance(num_hosts, str) or not 1 <= num_hosts <= world_size:
        raise LayoutError(
            f"--decode-hosts={num_hosts!r} must be an integer in [1, {world_size}] (the "
            "decode workers); use 1 for one decode host"
        )
    return [f"decode-host{r * num_hosts // world_size}" for r in range(world_size)]


def fan_out_json(fan: TransferPlan, verified: bool | None) -> dict[str, Any]:
    """The fan-out plan's part of the `--json` contract."""
    assert fan.decode_hosts is not None
    return {
        "executed_by_runtime": True,
        "decode_hosts": list(fan.decode_hosts),
        "reads": [_read_json(r) for r in fan.reads],
        "local_copies": [
            {
                "decode_rank": c.decode_rank,
                "source_rank": c.source_rank,
                "kv_heads": _range(c.kv_heads),
                "layers": _range(c.layers),
                "bytes_per_token": c.bytes_per_token,
            }
            for c in fan.local_copies
        ],
        "expected_notifications": list(fan.expected_notifications),
        "link_bytes_per_token": fan.link_bytes_per_token,
        "local_bytes_per_token": fan.local_bytes_per_token,
        "verified": verified,
    }


def plan_to_json(
    plan: TransferPlan,
    verified: bool | None,
    fan: TransferPlan | None = None,
    fan_verified: bool | None = None,
) -> dict[str, Any]:
    """The `--json` contract (field names are stable; more may be added). `reads` and
    `expected_notifications` are the plan without a fan-out (every decode worker reads
    its own bytes: prefill and decode on one host, or `--kv-fan-out off`);
    `link_bytes_per_token` and `local_bytes_per_token` are what crosses the link and
    what is copied on the decode hosts with prefill and decode on different hosts, as
    the runtime does by default (`fan_out`: each byte over the link once per decode
    host; `link_bytes_per_token_without_fan_out` without it)."""
    m = plan.model
    return {
        "supported": True,
        "error": None,
        "model": {
            "num_layers": m.num_layers,
            "num_kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim,
            "attention": m.attention.value,
            "dtype": m.dtype,
        },
        "prefill": _layout_json(plan.prefill),
        "decode": _layout_json(plan.decode),
        "workers": {
            "prefill": [_worker_json(w) for w in plan.prefill_workers],
            "decode": [_worker_json(w) for w in plan.decode_workers],
        },
        "reads": [_read_json(r) for r in plan.reads],
        "expected_notifications": list(plan.expected_notifications),
        "verified": verified,
        "distinct_bytes_per_token": m.bytes_per_token,
        "link_bytes_per_token": (fan or plan).link_bytes_per_token,
        "local_bytes_per_token": (fan or plan).local_bytes_per_token,
        "link_bytes_per_token_without_fan_out": plan.link_bytes_per_token,
        "fan_out": None if fan is None else fan_out_json(fan, fan_verified),
    }


def _error_json(error: str, args: argparse.Namespace, model: ModelKVSpec | None) -> dict[str, Any]:
    def side(name: str) -> dict[str, Any]:
        return {
            "tp": getattr(args, f"{name}_tp"),
            "pp": getattr(args, f"{name}_pp"),
            "block_size": getattr(args, f"{name}_block_size"),
            "layout": str(getattr(args, f"{name}_layout")),
        }

    return {
        "supported": False,
        "error": error,
        "model": None
        if model is None
        else {
            "num_layers": model.num_layers,
            "num_kv_heads": model.num_kv_heads,
            "head_dim": model.head_dim,
            "attention": model.attention.value,
            "dtype": model.dtype,
        },
        "prefill": side("prefill"),
        "decode": side("decode"),
        "workers": {"prefill": [], "decode": []},
        "reads": [],
        "expected_notifications": [],
        "verified": None,
        "distinct_bytes_per_token": None,
        "link_bytes_per_token": None,
        "local_bytes_per_token": None,
        "link_bytes_per_token_without_fan_out": None,
        "fan_out": None,
    }


def default_tokens(plan: TransferPlan) -> int:
    block = max(plan.prefill.block_size, plan.decode.block_size)
    return 3 * block + block // 2 + 1


def descriptor_counts(
    plan: TransferPlan, num_tokens: int, seed: int = 0
) -> dict[int, tuple[int, int]]:
    """(unmerged, merged) descriptors per decode rank for a request with shuffled blocks,
    read as the runtime reads it: to `read_end`, its last block whole."""
    rng = np.random.default_rng(seed)
    out = {}
    p_ids = rng.permutation(4 * (-(-num_tokens // plan.prefill.block_size)))
    d_ids = rng.permutation(4 * (-(-num_tokens // plan.decode.block_size)))
    for d in plan.decode_workers:
        lists = copy_lists(plan, d.rank, p_ids, d_ids, plan.read_end(num_tokens))
        out[d.rank] = (sum(c.num_unmerged for c in lists), sum(c.num_descriptors for c in lists))
    return out


def run(args: argparse.Namespace) -> int:
    model: ModelKVSpec | None = None
    try:
        model = load_model_spec(args.config, dtype=args.dtype)
        prefill, decode = layouts_from_args(args)
        plan = make_plan(model, prefill, decode)
        hosts = decode_hosts(len(plan.decode_workers), args.decode_hosts)
        fan = make_plan(model, prefill, decode, decode_hosts=hosts)
    except KVBridgeError as exc:
        if args.json:
            print(json.dumps(_error_json(str(exc), args, model)))
        print(f"kvbridge plan: not supported: {exc}", file=sys.stderr)
        return 2

    tokens = args.tokens if args.tokens is not None else default_tokens(plan)
    if isinstance(tokens, str) or tokens <= 0:
        print(
            f"kvbridge plan: error: --tokens={tokens!r} must be a positive integer", file=sys.stderr
        )
        return 2
    report: VerifyReport | None = None
    fan_report: VerifyReport | None = None
    verified: bool | None = None
    fan_verified: bool | None = None
    failure = None
    if args.verify:
        try:
            report = verify_plan(plan, tokens)
            verified = True
        except VerificationError as exc:
            verified, failure = False, str(exc)
        try:
            fan_report = verify_plan(fan, tokens)
            fan_verified = True
        except VerificationError as exc:
            fan_verified, failure = False, f"fan-out plan: {exc}"
    num_arrows: int | None = None
    if args.svg is not None:
        # drawn before anything is printed: without matplotlib (ConfigError, exit 2) or
        # with an unwritable FILE, stdout stays empty
        from kvbridge.cli.plan_map import draw_plan

        try:
            num_arrows = draw_plan(plan, args.svg)
        except OSError as exc:
            print(
                f"kvbridge plan: error: cannot write --svg {args.svg}: {exc.strerror or exc}",
                file=sys.stderr,
            )
            return 2

    if args.json:
        print(json.dumps(plan_to_json(plan, verified, fan, fan_verified)))
    else:
        from kvbridge.cli.plan_report import print_fan_out, print_plan

        # runs per block of a whole-block request: what the layout pair costs per block
        whole = 4 * math.lcm(plan.prefill.block_size, plan.decode.block_size)
        print_plan(plan, descriptor_counts(plan, whole), whole, report)
        print_fan_out(plan, fan, tokens, fan_report)
    if num_arrows is not None:
        # stdout holds exactly one JSON object with --json
        print(
            f"map written to {args.svg} ({num_arrows} reads)",
            file=sys.stderr if args.json else sys.stdout,
        )
    if failure:
        print(f"kvbridge plan: VERIFICATION FAILED: {failure}", file=sys.stderr)
        return 1
    return 0
