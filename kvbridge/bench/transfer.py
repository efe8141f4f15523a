"""`kvbridge bench transfer`: the plan's transfer against two baselines, same run.

Realistic geometry (32 layers, 8 KV heads, head_dim 128, bf16; one 2048-token
request, block size 16; prefill tp 2 -> decode tp 4). For the chosen layout pair
(default BHLNC on both sides) and, beside it, LBHNC (HND, per layer) on both sides,
measures as medians:
  plan: every decode worker pulls its part through the runtime (handshakes done
        in a warm-up request, so this is the steady state);
  (a)   the same bytes per decode worker as ONE single-descriptor NIXL READ between
        the same processes, all decode workers at once (alternating with the plan's);
  (b)   one in-process memcpy (numpy) of the same total bytes, into touched memory.
Also prints the descriptors posted per request before and after merging, and the
kernel's floor under the transport (kvbridge.bench.cma_floor): the plan's runs and
the same bytes contiguous, read with bare `process_vm_readv` calls, which is what UCX
does between processes on one host, and the same bytes read from shared memory (what a
KV export process's memory costs). Where a pull's time goes is printed per pair
(`PullPhases` of the decode worker that ended each request last): pulls the integrity
check samples (by request id) are timed apart from the others, with what they cost a
request on average at the sampling rate. `--json` prints exactly one object instead.

With `--hosts` the prefill and decode workers run on two test hosts (network namespaces
on a bridge, `kvbridge.harness.hosts`; needs root), so UCX moves the bytes over TCP as
between machines, and raw TCP between the hosts (one stream, and one per decode worker
reading over the link) moving the bytes that must cross is printed instead of the
kernel's floor, with the bytes the prefill host's cable carried per request against the
distinct KV. With `--decode-tp` above `--kv-heads` several decode workers hold each
head: the decode workers then fan out (`--kv-fan-out`, auto: across hosts), one reading
each head over the link and the others copying it on the decode host.
"""

from __future__ import annotations

import argparse
import json
import secrets
import socket
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge.bench import cma_floor
from kvbridge.errors import ConfigError
from kvbridge.plan.cast import CASTABLE, check_castable
from kvbridge.plan.geometry import AttentionKind, ModelKVSpec, normalize_dtype
from kvbridge.plan.layout import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_LAYOUT,
    LAYOUT_HELP,
    CacheLayout,
    InstanceLayout,
)
from kvbridge.plan.planner import TransferPlan, make_plan
from kvbridge.transfer.config import FanOut, TransferConfig
from kvbridge.transfer.errors import TransferError
from kvbridge.transfer.integrity import SAMPLE_EVERY, Integrity

if TYPE_CHECKING:  # the worker harness needs msgspec and NIXL: imported when run
    from kvbridge.harness.cluster import Cluster
    from kvbridge.harness.commands import Finished, Span
    from kvbridge.harness.hosts import TestHost


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=2048, help="request length (default 2048)")
    parser.add_argument("--repeat", type=int, default=5, help="timed repetitions (default 5)")
    parser.add_argument("--prefill-tp", type=int, default=2, help="default 2")
    parser.add_argument("--decode-tp", type=int, default=4, help="default 4")
    parser.add_argument(
        "--kv-heads",
        type=int,
        default=8,
        help="KV heads of the model (default 8; a decode tp above it replicates them)",
    )
    parser.add_argument(
        "--kv-fan-out",
        choices=[m.value for m in FanOut],
        default=TransferConfig.fan_out.value,
        help="decode workers holding the same heads read them once per host, the others "
        "copying on the host: across hosts (auto; default), always (on), never (off)",
    )
    parser.add_argument(
        "--layout",
        default=None,
        metavar="LAYOUT",
        help=f"cache layout of both sides (default {DEFAULT_LAYOUT}); {LAYOUT_HELP}",
    )
    for side in ("prefill", "decode"):
        parser.add_argument(
            f"--{side}-layout",
            default=None,
            metavar="LAYOUT",
            help=f"{side} cache layout (default: --layout)",
        )
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help="block size of both sides (default %(default)s)",
    )
    parser.add_argument(
        "--decode-kv-dtype",
        default=None,
        metavar="DTYPE",
        help="the decode cache's dtype when it differs from the model's (bfloat16): the "
        f"decode workers cast what they read (one of {', '.join(CASTABLE)}); the same "
        "pair in the model's dtype is measured beside it",
    )
    parser.add_argument(
        "--no-compare",
        dest="compare",
        action="store_false",
        help="skip the LBHNC -> LBHNC row measured beside the chosen pair",
    )
    parser.add_argument(
        "--no-floor",
        dest="floor",
        action="store_false",
        help="skip the kernel floor (bare process_vm_readv of the same runs)",
    )
    parser.add_argument(
        "--no-auth",
        dest="auth",
        action="store_false",
        help="run without a shared token (no CURVE, no session-signed notifications), to "
        "see what authentication costs",
    )
    parser.add_argument(
        "--hosts",
        action="store_true",
        help="run the prefill and decode workers on two test hosts (network namespaces on "
        "a bridge; needs root): the transfer crosses a link over TCP",
    )
    parser.add_argument(
        "--link-rate",
        default=None,
        metavar="RATE",
        help="with --hosts: limit what the prefill host sends to RATE (tc's units, e.g. "
        "2gbit), so the link, not the two hosts' shared cores, is the bottleneck, as "
        "between machines",
    )
    parser.add_argument(
        "--kv-integrity",
        choices=[m.value for m in Integrity],
        default=TransferConfig.integrity.value,
        help="check each pull's digest (on), never (off) or one request in "
        f"{SAMPLE_EVERY} (sample; default %(default)s), to see what the check costs",
    )
    parser.add_argument(
        "--kv-export",
        choices=["inline", "process", "both"],
        default="inline",
        help="where the decode workers read the prefill KV from: the prefill worker's own "
        "agent (inline, default), an export process mapping only the KV (process, "
        "kvbridge serve's default with a token), or both, measured in the same run",
    )
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object")
    parser.add_argument(
        "--backend-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="UCX backend parameter for every agent (repeatable), e.g. "
        "ucx_error_handling_mode=none (with UCX_TLS=posix in the environment)",
    )


#: issue #43: the plan at this fraction of one single-descriptor READ, or better
TARGET_RATIO = 0.95


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


@dataclass(frozen=True)
class Row:
    """One layout pair's figures (the JSON fields of `kvbridge bench transfer --json`)."""

    prefill_layout: str
    decode_layout: str
    block_size: int
    #: the decode cache's dtype where it differs from the prefill's (a cast per pull)
    decode_kv_dtype: str | None
    plan_ms: float
    single_read_ms: float
    memcpy_ms: float
    ratio: float  # (a) / plan: 1.0 is as fast as one single-descriptor READ
    descriptors: int
    descriptors_unmerged: int
    prepared_indices: int
    run_bytes: int  # mean bytes per descriptor
    first_ms: float  # the first request, handshakes included
    auth: bool  # a shared token: encrypted handshakes, session-signed notifications
    hosts: bool = False  # prefill and decode workers on two test hosts (TCP)
    #: --hosts: the same bytes as one single-descriptor WRITE per decode worker
    single_write_ms: float | None = None
    #: where the prefill KV was read from: "inline" (the worker's agent) or "process"
    kv_export: str = "inline"
    #: --hosts: what the prefill host's cable carried per plan request (median)
    cable_bytes: int | None = None
    #: timed requests whose pull was checked (`--kv-integrity`; sample: by request id);
    #: plan_ms is the median of the others, checked_ms of these (None: none was)
    num_checked: int = 0
    checked_ms: float | None = None
    #: where a pull's time went (`PullPhases`, ms): median per phase of the decode
    #: worker that finished each request last, unchecked pulls and checked ones
    phases_ms: dict[str, float] | None = None
    checked_phases_ms: dict[str, float] | None = None
    #: unchecked timed pulls: (producer workers a fence word confirmed, producer
    #: workers read from), summed over decode workers (`fence.py`; the rest waited
    #: for the ReadAck)
    fenced: tuple[int, int] = (0, 0)

    @property
    def name(self) -> str:
        cast = f" (cast to {self.decode_kv_dtype})" if self.decode_kv_dtype else ""
        return f"{self.prefill_layout} -> {self.decode_layout}{cast}"


def run_transfer_bench(args: argparse.Namespace) -> int:
    if args.tokens < 1:
        raise ConfigError(f"--tokens={args.tokens} must be a positive number of tokens")
    burst = _burst(args.link_rate) if args.link_rate else None  # a bad rate: refused now
    if args.hosts:
        from kvbridge.harness.hosts import HostNetwork, missing

        if missing():
            raise ConfigError(f"--hosts: {missing()}; run as root, or without --hosts")
        if not args.auth:
            raise ConfigError(
                "--hosts with --no-auth: workers on other hosts need the shared token; "
                "drop --no-auth"
            )
        with HostNetwork() as net:
            hosts = (net.add("kvbh-prefill"), net.add("kvbh-decode"))
            if burst is not None:
                hosts[0].slow(args.link_rate, burst=burst, latency="1s")
            return _run(args, hosts)
    if args.link_rate:
        raise ConfigError(f"--link-rate={args.link_rate} needs --hosts (a link to limit)")
    return _run(args, None)


def _burst(rate: str) -> str:
    """A token bucket of 10 ms at `rate` (tc's units), at least tc's 32kbit: a small
    bucket cannot reach a high rate at the kernel's timer granularity."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            try:
                bits = float(rate.removesuffix(unit)) * scale
            except ValueError:
                break
            return f"{max(int(bits / 8 / 100), 4096)}b"
    raise ConfigError(f"--link-rate={rate!r} is not a rate; use e.g. 500mbit or 2gbit")


def _run(args: argparse.Namespace, hosts: tuple[TestHost, TestHost] | None) -> int:
    figures = _measure(args, hosts)
    if args.json:
        print(json.dumps(_json(args, figures)))
    else:
        _print_figures(args, figures)
    return 0


@dataclass(frozen=True)
class _Figures:
    """What one `kvbridge bench transfer` run measured, for the table or the JSON."""

    rows: list[Row]
    modes: list[str]  # kv_export modes measured (two: rows alternate inline, process)
    total: int  # bytes per request into the decode workers
    link_total: int  # bytes per request read from the prefill
    local_total: int  # bytes per request copied on the decode host (a fan-out)
    distinct: int  # the request's distinct KV bytes
    fans_out: bool
    t_mem: float  # (b): seconds
    floor: cma_floor.CmaFloor | None
    streams: int  # decode workers reading over the link
    tcp_s: float | None  # --hosts: (c) one stream, (d) `streams` at once: seconds
    tcp_multi_s: float | None
    link_ratio: float | None
    link_bytes: int  # --hosts: what the prefill host's link carried in all
    export_cost: list[tuple[str, float]]  # pair -> kv_export process / inline
    hosts: bool


def _measure(args: argparse.Namespace, hosts: tuple[TestHost, TestHost] | None) -> _Figures:
    if not 1 <= args.kv_heads <= 32 or 32 % args.kv_heads:
        raise ConfigError(f"--kv-heads={args.kv_heads} must divide the 32 query heads")
    model = ModelKVSpec(32, 32, args.kv_heads, 128, "bfloat16", AttentionKind.GQA, "32-layer GQA")
    both = args.layout or DEFAULT_LAYOUT
    cast = None
    if args.decode_kv_dtype is not None:
        cast = normalize_dtype(args.decode_kv_dtype, field="--decode-kv-dtype")
        check_castable(model.dtype, cast)
        cast = None if cast == model.dtype else cast
    main = (
        CacheLayout.parse(args.prefill_layout or both).name,
        CacheLayout.parse(args.decode_layout or both).name,
        cast,
    )
    pairs = [main]
    if cast is not None:  # the same pair without the cast, beside it
        pairs.append((main[0], main[1], None))
    elif args.compare and main[:2] != ("LBHNC", "LBHNC"):
        pairs.append(("LBHNC", "LBHNC", None))
    repeat = max(1, args.repeat)
    params = dict(kv.split("=", 1) for kv in args.backend_param)
    say = (lambda *a: None) if args.json else print
    # the same bytes whatever the layouts: (b) once, into touched memory
    plan = make_plan(
        model, _layout(args, args.prefill_tp, main[0]), _layout(args, args.decode_tp, main[1])
    )
    total = plan.bytes_per_token * args.tokens
    # what must cross from the prefill: with a fan-out each head once per decode host
    # (decided as the decode workers decide it, from where the prefill workers listen)
    prefill_at = f"tcp://{hosts[0].address if hosts else '127.0.0.1'}:0"
    fans_out = TransferConfig(fan_out=FanOut(args.kv_fan_out)).fans_out_from(prefill_at)
    link_plan = (
        make_plan(
            plan.model, plan.prefill, plan.decode, decode_hosts=["d"] * len(plan.decode_workers)
        )
        if fans_out
        else plan
    )
    link_total = link_plan.link_bytes_per_token * args.tokens
    distinct = plan.model.bytes_per_token * args.tokens
    say(
        f"{model.describe()}; {args.tokens}-token request, prefill tp{args.prefill_tp} -> "
        f"decode tp{args.decode_tp}, block {args.block_size}; {total / 2**20:.0f} MiB per "
        f"request into the decode workers, {link_total / 2**20:.0f} MiB of them read from "
        f"the prefill ({link_total / distinct:.2f}x the distinct KV; fan-out "
        f"{'on' if fans_out else 'off'}); median of {repeat}"
        + (f"; the prefill host sends at most {args.link_rate}" if args.link_rate else "")
    )
    src_buf = np.ones(total, dtype=np.uint8)
    dst_buf = np.zeros(total, dtype=np.uint8)
    mem_s = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst_buf, src_buf)
        mem_s.append(time.perf_counter() - t0)
    del src_buf, dst_buf
    t_mem = statistics.median(mem_s)
    sent = hosts[0].bytes_sent() if hosts else 0
    modes = ["inline", "process"] if args.kv_export == "both" else [args.kv_export]
    rows = [
        _measure_pair(args, model, pair, repeat, params, t_mem, hosts, mode, fans_out)
        for pair in pairs
        for mode in modes
    ]
    # what exporting the KV from a process of its own costs, pair by pair
    export_cost = (
        [(a.name, b.plan_ms / a.plan_ms) for a, b in zip(rows[::2], rows[1::2], strict=True)]
        if len(modes) == 2
        else []
    )
    # each pair moves (repeat + 1) requests through the plan and repeat single READs
    link_bytes = hosts[0].bytes_sent() - sent if hosts else 0

    floor = (
        cma_floor.measure(rows[0].run_bytes, rows[0].descriptors, repeat)
        if args.floor and hosts is None
        else None
    )
    tcp_s = tcp_multi_s = None
    # the plan's connections over the link: one per decode worker reading from the prefill
    streams = len({r.decode_rank for r in link_plan.reads})
    if hosts is not None:  # raw TCP moving what must cross: the plan's link bytes
        tcp_s = statistics.median(_tcp_seconds(*hosts, link_total) for _ in range(repeat))
        tcp_multi_s = statistics.median(
            _tcp_seconds(*hosts, link_total, streams) for _ in range(repeat)
        )
    # the link's best raw figure against the plan: 1.0 moves the KV as fast as TCP can
    link_ratio = min(tcp_s, tcp_multi_s) * 1e3 / rows[0].plan_ms if tcp_s and tcp_multi_s else None
    return _Figures(
        rows=rows,
        modes=modes,
        total=total,
        link_total=link_total,
        local_total=link_plan.local_bytes_per_token * args.tokens,
        distinct=distinct,
        fans_out=fans_out,
        t_mem=t_mem,
        floor=floor,
        streams=streams,
        tcp_s=tcp_s,
        tcp_multi_s=tcp_multi_s,
        link_ratio=link_ratio,
        link_bytes=link_bytes,
        export_cost=export_cost,
        hosts=bool(hosts),
    )


def _json(args: argparse.Namespace, f: _Figures) -> dict[str, Any]:
    """The `--json` object: the first row's fields, then every row and the run's figures."""
    floor, tcp_s, tcp_multi_s = f.floor, f.tcp_s, f.tcp_multi_s
    out: dict[str, Any] = asdict(f.rows[0])
    out["rows"] = [asdict(r) for r in f.rows]
    out["floor_ratio"] = floor.ratio if floor else None
    out["shared_floor_ratio"] = floor.shared_ratio if floor else None
    out["shmem_huge_pages"] = cma_floor.shmem_huge_pages()
    out["tcp_ms"] = tcp_s * 1e3 if tcp_s else None
    out["tcp_multi_ms"] = tcp_multi_s * 1e3 if tcp_multi_s else None
    out["tcp_streams"] = f.streams if f.hosts else None
    out["link_ratio"] = f.link_ratio
    out["link_bytes"] = f.link_bytes if f.hosts else None
    out["distinct_bytes_per_request"] = f.distinct
    out["link_bytes_per_request"] = f.link_total
    out["local_bytes_per_request"] = f.local_total
    out["fan_out"] = f.fans_out
    out["link_rate"] = args.link_rate
    out["export_cost"] = f.export_cost[0][1] if f.export_cost else None
    return out


def _print_figures(args: argparse.Namespace, f: _Figures) -> None:
    """The table: each pair against (a) and (b), then the link's and the floor's figures."""
    rows, total, t_mem = f.rows, f.total, f.t_mem
    link_total, distinct, streams = f.link_total, f.distinct, f.streams
    tcp_s, tcp_multi_s, link_ratio, link_bytes = f.tcp_s, f.tcp_multi_s, f.link_ratio, f.link_bytes
    print(f"{'':44} {'ms':>8} {'GB/s':>7} {'vs (a)':>7} {'vs (b)':>7} {'descriptors':>12}")
    for r in rows:
        t_raw, t_plan = r.single_read_ms, r.plan_ms
        label = f"plan, {r.name}"
        label += f" ({r.kv_export})" if len(f.modes) == 2 else ""
        print(
            f"{label:44} {t_plan:8.1f} "
            f"{_gbps(total, t_plan / 1e3):7.2f} {t_raw / t_plan:7.2f} {t_mem * 1e3 / t_plan:7.2f} "
            f"{r.descriptors:12d}"
        )
        print(
            f"{'  (a) one single-descriptor READ':44} {t_raw:8.1f} "
            f"{_gbps(total, t_raw / 1e3):7.2f} {1:7.2f} {t_mem * 1e3 / t_raw:7.2f}"
        )
        if r.single_write_ms is not None:
            t_w = r.single_write_ms
            print(
                f"{'  (e) the same as one WRITE each (push)':44} {t_w:8.1f} "
                f"{_gbps(total, t_w / 1e3):7.2f} {t_raw / t_w:7.2f} {t_mem * 1e3 / t_w:7.2f}"
            )
    print(f"{'(b) in-process memcpy':44} {t_mem * 1e3:8.1f} {_gbps(total, t_mem):7.2f}")
    if tcp_s is not None and tcp_multi_s is not None and link_ratio is not None:
        print(f"{'(c) raw TCP, one stream between the hosts':44} {tcp_s * 1e3:8.1f} "
              f"{_gbps(link_total, tcp_s):7.2f}")  # fmt: skip
        print(f"{f'(d) raw TCP, {streams} streams at once':44} {tcp_multi_s * 1e3:8.1f} "
              f"{_gbps(link_total, tcp_multi_s):7.2f}")  # fmt: skip
        print(f"  ((c), (d) send the {link_total / 2**20:.0f} MiB that must cross; GB/s "
              f"columns above count the {total / 2**20:.0f} MiB the decode workers get)")  # fmt: skip
        print(
            f"link ratio (best of (c), (d)) / plan = {link_ratio:.2f}; target >= 0.9: "
            f"{'met' if link_ratio >= 0.9 else 'NOT met'}"
        )
        for r in rows:
            cable = r.cable_bytes or 0
            print(f"{r.name}: the prefill host's cable carried "
                  f"{cable / 2**20:.1f} MiB per request: {cable / distinct:.2f}x the "
                  f"{distinct / 2**20:.0f} MiB of distinct KV (TCP and UCX headers "
                  f"included)")  # fmt: skip
        print(f"the prefill host's link carried {link_bytes / 2**20:.0f} MiB in all, "
              "baselines included")  # fmt: skip
    for r in rows:
        print(
            f"{r.name}: first request (handshakes) "
            f"{r.first_ms:.1f} ms; {r.descriptors_unmerged} descriptors "
            f"before merging, {r.descriptors} after ({r.prepared_indices} prepared-list "
            f"indices; NIXL joins consecutive ones), {r.run_bytes} B per descriptor; "
            f"plan / (a) = {r.ratio:.2f}"
        )
    for r in rows:
        _print_phases(args, r, len(f.modes) == 2)
    cast, same = rows[0], rows[-1]
    if cast.decode_kv_dtype is not None and cast.phases_ms and same.phases_ms:
        print(f"the cast to {cast.decode_kv_dtype}: {cast.phases_ms['cast']:.1f} ms per pull "
              f"(median); the pull {cast.plan_ms:.1f} ms vs {same.plan_ms:.1f} ms without it: "
              f"{cast.plan_ms / same.plan_ms:.2f}x")  # fmt: skip
    for pair_name, cost in f.export_cost:
        print(f"{pair_name}: the KV read from an export process takes {cost:.2f}x the plan "
              "from the prefill worker's own agent (kv_export process / inline)")  # fmt: skip
    if len(f.modes) == 2:
        a, b = rows[0], rows[1]
        print(f"  one single-descriptor READ (a) from the export's shared memory takes "
              f"{b.single_read_ms / a.single_read_ms:.2f}x (a) from the worker's own "
              "memory: the cost is in reading shared memory (kernel floor below)")  # fmt: skip
    r = rows[0]
    print(
        f"target plan / (a) >= {TARGET_RATIO} for {r.prefill_layout} -> {r.decode_layout}: "
        f"{'met' if r.ratio >= TARGET_RATIO else 'NOT met'} ({r.ratio:.2f})"
    )
    if args.floor and not f.hosts:
        _print_floor(f.floor, r.run_bytes, r.descriptors)


def _print_phases(args: argparse.Namespace, r: Row, label_mode: bool) -> None:
    """Where a pull's time went (`PullPhases`), unchecked and checked, and what the
    integrity check costs a request on average at the sampling rate."""
    name = r.name + (f" ({r.kv_export})" if label_mode else "")

    def parts(ph: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:.1f}" for k, v in ph.items() if k == "post" or v >= 0.05)

    if r.phases_ms is not None:
        print(f"{name}: where a pull's time goes (ms; the decode worker that ended last, "
              f"median): {parts(r.phases_ms)}; confirmed by the producers' fence words: "
              f"{r.fenced[0]} of {r.fenced[1]} reads (the rest by ReadAck)")  # fmt: skip
    if r.checked_ms is None or r.checked_phases_ms is None:
        return
    print(f"  {r.num_checked} of the timed pulls were checked (--kv-integrity "
          f"{args.kv_integrity}): {r.checked_ms:.1f} ms, {parts(r.checked_phases_ms)}: "
          "SHA-256 of every byte on both sides (confirm holds the prefill's digest)")  # fmt: skip
    if args.kv_integrity == Integrity.SAMPLE.value:
        mean = ((SAMPLE_EVERY - 1) * r.plan_ms + r.checked_ms) / SAMPLE_EVERY
        print(f"  one request in {SAMPLE_EVERY} checked: {mean:.1f} ms per request on "
              f"average, (a) / that = {r.single_read_ms / mean:.2f}")  # fmt: skip


def _layout(
    args: argparse.Namespace, tp: int, name: str, dtype: str | None = None
) -> InstanceLayout:
    return InstanceLayout(
        tp_size=tp, block_size=args.block_size, cache_layout=CacheLayout.parse(name), dtype=dtype
    )


def _measure_pair(
    args: argparse.Namespace,
    model: ModelKVSpec,
    pair: tuple[str, str, str | None],
    repeat: int,
    params: dict[str, str],
    t_mem: float,
    hosts: tuple[TestHost, TestHost] | None,
    kv_export: str = "inline",
    fans_out: bool = False,
) -> Row:
    """Start one prefill and one decode instance of worker processes in these layouts
    (the prefill KV read as `kv_export` says) and time the plan's transfer and (a),
    alternating, in the same processes. With `fans_out` (the decode workers fan out),
    (a) is one READ per decode worker that reads from the prefill, of what it reads."""
    from kvbridge.harness.check import make_workload
    from kvbridge.harness.cluster import Cluster

    prefill, decode = (
        _layout(args, args.prefill_tp, pair[0]),
        _layout(args, args.decode_tp, pair[1], pair[2]),
    )
    hosts_of = ["decode-host"] * decode.world_size if fans_out else None
    plan = make_plan(model, prefill, decode, decode_hosts=hosts_of)
    tokens = args.tokens
    # one request's shuffled blocks, exposed and pulled again under a new id each time
    work = make_workload(prefill, decode, 1, tokens, seed=1)
    per_decode = [
        sum(r.bytes_per_token for r in plan.reads_for(d.rank)) * tokens for d in plan.decode_workers
    ]
    readers = {r.decode_rank: r.prefill_rank for r in plan.reads}
    per_prefill = max(per_decode) * max(len(plan.readers_of(p.rank)) for p in plan.prefill_workers)
    token = secrets.token_hex(32).encode() if args.auth else None
    on_prefill, on_decode = (h.worker_options() for h in hosts) if hosts else ({}, {})
    with Cluster() as c:
        pre = c.start(
            "prefill",
            model,
            prefill,
            work.prefill_blocks,
            "bench-prefill",
            pattern=False,
            salt=1,
            scratch_bytes=per_prefill,
            backend_params=params,
            lease_s=600,
            token=token,
            integrity=args.kv_integrity,
            kv_export=kv_export,
            **on_prefill,
        )
        dec = c.start(
            "decode",
            model,
            decode,
            work.decode_blocks,
            "bench-decode",
            pattern=False,
            salt=2,
            scratch_bytes=max(per_decode),
            backend_params=params,
            transfer_timeout_s=120,
            token=token,
            integrity=args.kv_integrity,
            fan_out=args.kv_fan_out,
            **on_decode,
        )
        raw_s, write_s, descs, first_s = [], [], (0, 0, 0), 0.0
        plan_s: list[float] = []  # unchecked pulls
        checked_s: list[float] = []  # checked pulls (integrity)
        phases: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        cable: list[int] = []
        fenced = [0, 0]
        sources = sum(
            len({r.prefill_rank for r in plan.reads_for(d.rank)}) for d in plan.decode_workers
        )
        for i in range(repeat + 1):
            sent = hosts[0].bytes_sent() if hosts else 0
            seconds, descs, last, by_fence = _one_request(
                c,
                pre.endpoint,
                pre.workers,
                dec.workers,
                f"req-{i}",
                work.prefill[0],
                work.decode[0],
            )
            if not i:
                first_s = seconds
                continue  # warm-up: handshakes
            (checked_s if last.checked else plan_s).append(seconds)
            if not last.checked:
                fenced[0] += by_fence
                fenced[1] += sources
            phases[last.checked].append(last.phases)
            cable.append(hosts[0].bytes_sent() - sent if hosts else 0)
            raw_s.append(_raw(c, plan, pre.workers, dec.workers, per_decode, readers, False))
            if hosts is not None and kv_export == "inline":  # an export maps it read-only
                write_s.append(_raw(c, plan, pre.workers, dec.workers, per_decode, readers, True))
    t_plan, t_raw = statistics.median(plan_s or checked_s), statistics.median(raw_s)
    unmerged, merged, indices = descs
    return Row(
        prefill_layout=prefill.cache_layout.name,
        decode_layout=decode.cache_layout.name,
        block_size=args.block_size,
        decode_kv_dtype=pair[2],
        plan_ms=t_plan * 1e3,
        single_read_ms=t_raw * 1e3,
        memcpy_ms=t_mem * 1e3,
        ratio=t_raw / t_plan,
        descriptors=merged,
        descriptors_unmerged=unmerged,
        prepared_indices=indices,
        run_bytes=sum(per_decode) // max(merged, 1),
        first_ms=first_s * 1e3,
        auth=args.auth,
        hosts=hosts is not None,
        single_write_ms=statistics.median(write_s) * 1e3 if write_s else None,
        kv_export=kv_export,
        cable_bytes=int(statistics.median(cable)) if hosts else None,
        num_checked=len(checked_s),
        checked_ms=statistics.median(checked_s) * 1e3 if checked_s else None,
        phases_ms=_median_phases(phases[False]),
        checked_phases_ms=_median_phases(phases[True]),
        fenced=(fenced[0], fenced[1]),
    )


def _median_phases(phases: list[dict[str, float]]) -> dict[str, float] | None:
    """The median of each phase (`PullPhases`' fields, seconds) in ms; None for none."""
    if not phases:
        return None
    return {k.removesuffix("_s"): statistics.median(p[k] for p in phases) * 1e3 for k in phases[0]}


def _raw(
    c: Cluster,
    plan: TransferPlan,
    prefill: list,
    decode: list,
    per_decode: list[int],
    readers: dict[int, int],
    write: bool,
) -> float:
    """Seconds for baseline (a), every decode worker's bytes as one single-descriptor
    READ from its prefill worker's scratch buffer, all at once; with `write`, the same
    bytes as one WRITE into it (the push direction's baseline)."""
    from kvbridge.harness.commands import RawDone, RawRead

    decode = [w for w in decode if w.rank in readers]  # (a fan-out's copiers read nothing)
    t0 = time.perf_counter()
    for w in decode:
        src = prefill[readers[w.rank]]
        # each reader of a prefill worker gets its own slice of the scratch buffer
        slot = plan.readers_of(src.rank).index(w.rank)
        addr = src.scratch_addr + slot * max(per_decode)
        w.send(RawRead(src.agent_name, addr, per_decode[w.rank], write))
    for w in decode:
        done: RawDone = c.expect(w, RawDone, 120)
        if done.state != "DONE":
            op = "WRITE" if write else "READ"
            raise TransferError(f"baseline {op} on decode rank {w.rank}: {done.state}")
    return time.perf_counter() - t0


def _tcp_seconds(src: TestHost, dst: TestHost, nbytes: int, streams: int = 1) -> float:
    """Seconds to send `nbytes` from host `src` to host `dst` over `streams` TCP
    connections at once, an equal share each (both ends in this process, each thread
    inside its host; the kernel copies, the threads wait in send and receive calls)."""
    shares = [nbytes // streams + (i < nbytes % streams) for i in range(streams)]
    received: list[int] = []
    with dst.inside():
        server = socket.create_server((dst.address, 0), backlog=streams)
    server.settimeout(60)
    port = server.getsockname()[1]

    def sink() -> None:
        conn, _ = server.accept()
        with conn:
            buf, total = bytearray(1 << 20), 0
            while n := conn.recv_into(buf):
                total += n
        received.append(total)

    chunk = memoryview(bytes(4 << 20))

    def send(client: socket.socket, share: int) -> None:
        with client:
            for start in range(0, share, len(chunk)):
                client.sendall(chunk[: min(len(chunk), share - start)])
            client.shutdown(socket.SHUT_WR)

    sinks = [threading.Thread(target=sink, daemon=True) for _ in shares]
    for t in sinks:
        t.start()
    try:
        with src.inside():
            clients = [socket.create_connection((dst.address, port), timeout=60) for _ in shares]
        senders = [
            threading.Thread(target=send, args=(c, share), daemon=True)
            for c, share in zip(clients, shares, strict=True)
        ]
        t0 = time.perf_counter()
        for t in senders:
            t.start()
        for t in senders + sinks:
            t.join(120)
        seconds = time.perf_counter() - t0
    finally:
        server.close()
    if sorted(received) != sorted(shares):
        raise TransferError(
            f"raw TCP from {src.name} to {dst.name} over {streams} streams: received "
            f"{received} bytes of {shares}"
        )
    return seconds


def _print_floor(floor: cma_floor.CmaFloor | None, run_bytes: int, num_runs: int) -> None:
    if floor is None:
        print("kernel floor: process_vm_readv is unavailable here (not Linux, or refused)")
        return
    total = run_bytes * num_runs
    print(
        "kernel floor under UCX's same-host transport (bare process_vm_readv, one process, "
        "no library):"
    )
    for name, t in (
        (f"{num_runs} runs of {run_bytes} B, {cma_floor.IOV_MAX} per call", floor.scattered_s),
        ("the same bytes, contiguous", floor.contiguous_s),
    ):
        print(f"  {name:44} {t * 1e3:8.1f} ms {_gbps(total, t):7.2f} GB/s")
    print(
        f"  runs / contiguous = {floor.ratio:.2f}: the most a CMA transfer of these runs can "
        "reach against one contiguous read here (UCX makes one call per descriptor)"
    )
    if floor.shared_s is not None and floor.shared_ratio is not None:
        name = "the same bytes, contiguous, from shared memory"
        print(
            f"  {name:44} {floor.shared_s * 1e3:8.1f} ms {_gbps(total, floor.shared_s):7.2f} GB/s"
        )
        print(
            f"  shared / contiguous = {floor.shared_ratio:.2f}: what reading a KV export "
            "process's memory (a memfd) costs in the kernel; the host gives shared memory "
            f"huge pages: {cma_floor.shmem_huge_pages() or 'unknown'} ({cma_floor.SHMEM_ENABLED})"
        )


def _one_request(
    c: Cluster, endpoint: str, prefill: list, decode: list, rid: str, p: Span, d: Span
) -> tuple[float, tuple[int, int, int], Finished, int]:
    """Expose, then pull one request: seconds from the Pulls sent to every decode
    worker's outcome, descriptor counts, the report of the worker whose pull took
    longest (its phases are where the request's time went), and how many producer
    workers' fence words confirmed the pulls."""
    from kvbridge.harness.commands import Expose, Finished, Pull, Released

    for w in prefill:
        w.send(Expose(rid, p.block_ids, p.num_tokens))
    t0 = time.perf_counter()
    for w in decode:
        w.send(Pull(rid, endpoint, p.block_ids, d.block_ids, d.num_tokens))
    results = [c.expect(w, Finished, 120) for w in decode]
    seconds = time.perf_counter() - t0
    for f in results:
        if f.state != "done":
            raise TransferError(f"request {rid} on decode rank {f.rank} failed: {f.reason}")
    c.wait_until(lambda: len(c.events) >= 0, 0)  # collect releases that already arrived
    c.take(Released)
    last = max(results, key=lambda f: sum(f.phases.values()))
    return (
        seconds,
        (
            sum(f.num_unmerged for f in results),
            sum(f.num_descriptors for f in results),
            sum(f.num_indices for f in results),
        ),
        last,
        sum(f.fenced for f in results),
    )
