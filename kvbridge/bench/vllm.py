"""`kvbridge bench vllm`: KVBridgeConnector next to vLLM's NixlConnector and colocated
vLLM, in one run (run it in vLLM's environment: `make bench-vllm`).

For each TP pair (default SmolLM2-135M prefill tp 1 -> decode tp 1 and tp 1 -> tp 3,
block 32) and each connector, a prefill and a decode vLLM instance are started with
that connector and kvbridge's proxy in front (`--engine vllm`, vLLM's two-step P/D
request). One request warms the pair up (its transfer includes the connector's
handshakes); then the same `--requests` prompts, new to every cache, are streamed one
at a time through the proxy (disaggregated) and sent to the decode instance alone with
a cache salt (colocated vLLM at the decode's settings, same instance, same prompts).
Printed per connector and pair:

- the transfer per request from the connector's own metrics on the decode instance's
  /metrics (KVBridgeConnector: `vllm:kvbridge_pull_time_seconds`, a decode worker's
  pull from the order to its last byte; NixlConnector: `vllm:nixl_xfer_time_seconds`,
  NIXL's own time of a READ from post to completion), with the number of transfers;
- median TTFT and TPOT disaggregated and colocated, and their ratio;
- whether the disaggregated tokens equal colocated ones, and where a pair failed (the
  reason from the response or the instance's log).

NixlConnector on a CPU host needs three things said here: the `nixl` package (vLLM
imports `nixl`, not the `nixl-cu12` wheel kvbridge uses; `pip install --no-deps
nixl==1.5.1`), a lease that outlives a loaded host's steps (`kv_lease_duration`, as
long as KVBridgeConnector's `lease_s`), and a progress thread that does not spin: NIXL's
Python API starts it with no delay between polls, so each NIXL agent takes a core from
vLLM's workers. `--nixl-pthr-delay-us` (default 1000) sets that delay through
`kvbridge/bench/nixl_pace/sitecustomize.py`, on the NixlConnector instances only; 0
runs NixlConnector exactly as it ships.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import resource
import secrets
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from kvbridge.settings import DEFAULT_MODEL
from kvbridge.transfer.netdev import free_port
from kvbridge.vllm.launch import (
    LOADED_HOST_SETTINGS,
    SMALL_HOST_ARGS,
    kv_transfer_config,
    start,
    stop,
    vllm_command,
    vllm_env,
    wait_healthy,
)

PACE_DIR = Path(__file__).resolve().parent / "nixl_pace"


class Connector(Enum):
    KVBRIDGE = "kvbridge"
    NIXL = "nixl"


#: each connector's transfer-time histogram on vLLM's /metrics (after "vllm:")
TRANSFER_SERIES = {
    Connector.KVBRIDGE: "kvbridge_pull_time_seconds",
    Connector.NIXL: "nixl_xfer_time_seconds",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="a folder of `kvbridge.vllm.models`")
    p.add_argument(
        "--pairs",
        nargs="+",
        default=["1:1", "1:3"],
        metavar="P:D",
        help="prefill tp:decode tp pairs (default 1:1 1:3, where both connectors plan)",
    )
    p.add_argument(
        "--connectors",
        nargs="+",
        default=[c.value for c in Connector],
        choices=[c.value for c in Connector],
    )
    p.add_argument("--block-size", type=int, default=32, help="both instances (default 32)")
    p.add_argument("--requests", type=int, default=5, help="measured requests per pair")
    p.add_argument("--prompt-words", type=int, default=200, help="words per prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--nixl-pthr-delay-us",
        type=int,
        default=1000,
        help="NixlConnector only: microseconds between its NIXL progress thread's polls "
        "(default 1000; 0: as vLLM ships it, spinning)",
    )
    p.add_argument("--log-dir", default=".cache/bench-vllm")


@dataclass
class PairResult:
    connector: Connector
    prefill_tp: int
    decode_tp: int
    failure: str = ""
    first_ttft_s: float = float("nan")
    ttft_s: float = float("nan")
    tpot_s: float = float("nan")
    coloc_ttft_s: float = float("nan")
    coloc_tpot_s: float = float("nan")
    transfer_ms: float = float("nan")
    transfers_per_request: float = float("nan")
    token_exact: bool = False
    mismatches: list[str] = field(default_factory=list)


def _kv_config(connector: Connector) -> str:
    if connector is Connector.KVBRIDGE:
        return kv_transfer_config(extra=LOADED_HOST_SETTINGS)
    return json.dumps(
        {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu",
            "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": {"kv_lease_duration": LOADED_HOST_SETTINGS["lease_s"]},
        }
    )


def _env(
    connector: Connector, tp: int, core: int, workers: int, args: argparse.Namespace
) -> dict[str, str]:
    env = vllm_env(tp, core, workers)
    if connector is Connector.KVBRIDGE:
        env["KVBRIDGE_TRANSFER_TOKEN"] = args.token
        return env
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
    env["UCX_RCACHE_MAX_UNRELEASED"] = "1024"  # vLLM sets it unless nixl was imported first
    if args.nixl_pthr_delay_us > 0:
        env["KVBRIDGE_NIXL_PTHR_DELAY_US"] = str(args.nixl_pthr_delay_us)
        env["PYTHONPATH"] = ":".join(p for p in (str(PACE_DIR), env.get("PYTHONPATH")) if p)
    return env


def _prompts(args: argparse.Namespace, tag: str) -> list[str]:
    """The warm-up prompt and the measured ones: each starts with its own words, so no
    block of one is in a prefix cache from another."""
    from kvbridge.bench.client import WORDS

    body = " ".join(WORDS[j % len(WORDS)] for j in range(args.prompt_words))
    return [f"{tag} request {i}: {body} Summary:" for i in range(args.requests + 1)]


#: vLLM's log prefix: "(Worker pid=1) ERROR 12-04 16:40:00 [base_worker.py:1318] "
_VLLM_PREFIX = re.compile(r"^\([^)]*\) [A-Z]+ \S+ \S+ \[[^\]]*\] ?")


def last_error(text: str) -> str:
    """Why an instance failed, from its log: the exception that ended its last traceback
    (with the source line it was raised at, for a bare `AssertionError`), else the last
    line that says error, else the last line."""
    lines = [_VLLM_PREFIX.sub("", line).rstrip() for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    if starts:
        for i in range(starts[-1] + 1, len(lines)):
            line = lines[i]
            if line and not line[0].isspace():  # the first unindented line ends it
                above = [x.strip() for x in lines[starts[-1] + 1 : i]]
                code = [x for x in above if x and not set(x) <= set("^~ ")]
                source = code[-1] if code else ""
                if ":" not in line and source and not source.startswith("File "):
                    line = f"{line} at `{source}`"
                return line[-300:]
    for line in reversed(lines):
        if "Error" in line or "ERROR" in line or "error" in line:
            return line.strip()[-300:]
    return lines[-1].strip()[-300:] if lines else "(empty log)"


def _last_error(log: Path) -> str:
    return last_error(log.read_text(errors="replace"))


def _run_pair(
    connector: Connector, prefill_tp: int, decode_tp: int, args: argparse.Namespace
) -> PairResult:
    import httpx

    from kvbridge.bench.client import stream_completion
    from kvbridge.serve.config import Engine, ProxyConfig
    from kvbridge.serve.http_server import ServerThread
    from kvbridge.serve.metrics import metric_value
    from kvbridge.serve.proxy_main import proxy_app

    res = PairResult(connector, prefill_tp, decode_tp)
    name = f"{connector.value}-tp{prefill_tp}-tp{decode_tp}"
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    urls: list[str] = []
    server: ServerThread | None = None
    try:
        for side, tp, core in (("prefill", prefill_tp, 0), ("decode", decode_tp, 1)):
            port = free_port()
            cmd = vllm_command(
                args.model_dir, port, tp, args.block_size, _kv_config(connector), *SMALL_HOST_ARGS
            )
            log = logs / f"{name}-{side}.log"
            env = _env(connector, tp, core, prefill_tp + decode_tp, args)
            procs.append((side, start(cmd, env, open(log, "wb")), log))  # noqa: SIM115
            urls.append(f"http://127.0.0.1:{port}")
        for (side, proc, log), url in zip(procs, urls, strict=True):
            try:
                wait_healthy(url, proc, 900)
            except (RuntimeError, TimeoutError) as exc:
                res.failure = f"{side} instance did not start ({exc}): {_last_error(log)}"
                return res
        proxy = ProxyConfig(str(args.model_dir), (urls[0],), (urls[1],), engine=Engine.VLLM)
        server = ServerThread(proxy_app(proxy)).start()
        prompts = _prompts(args, name)
        body = {"max_tokens": args.max_tokens, "temperature": 0}
        series = TRANSFER_SERIES[connector]
        try:
            res.first_ttft_s = stream_completion(server.url, {**body, "prompt": prompts[0]}).ttft_s
            before = httpx.get(urls[1] + "/metrics", timeout=30).text
            disagg = [stream_completion(server.url, {**body, "prompt": p}) for p in prompts[1:]]
            after = httpx.get(urls[1] + "/metrics", timeout=30).text
        except (RuntimeError, httpx.HTTPError) as exc:  # the pair failed: say why
            res.failure = f"{exc}; decode log: {_last_error(procs[1][2])}"
            return res
        coloc = [
            stream_completion(urls[1], {**body, "prompt": p, "cache_salt": f"coloc-{i}"})
            for i, p in enumerate(prompts[1:])
        ]

        def delta(suffix: str) -> float:
            return metric_value(after, series + suffix, prefix="vllm:") - metric_value(
                before, series + suffix, prefix="vllm:"
            )

        count = delta("_count")
        res.transfer_ms = delta("_sum") / count * 1e3 if count else float("nan")
        res.transfers_per_request = count / len(disagg)
        if not count:
            res.failure = "no transfer in the connector's metrics: the decode computed the KV"
        res.ttft_s = statistics.median(s.ttft_s for s in disagg)
        res.tpot_s = statistics.median(s.tpot_s for s in disagg)
        res.coloc_ttft_s = statistics.median(s.ttft_s for s in coloc)
        res.coloc_tpot_s = statistics.median(s.tpot_s for s in coloc)
        res.mismatches = [
            f"{d.text!r} != colocated {c.text!r}"
            for d, c in zip(disagg, coloc, strict=True)
            if d.text != c.text
        ]
        res.token_exact = not res.mismatches
        return res
    finally:
        if server is not None:
            server.stop()
        for _, proc, _ in reversed(procs):
            stop(proc)


def _ms(s: float) -> str:
    return f"{s * 1e3:9.0f}"


def print_results(results: list[PairResult]) -> None:
    print(
        f"{'connector':>10} {'pair':>9} {'xfer ms':>8} {'xfers/req':>9} {'1st TTFT':>9} "
        f"{'TTFT ms':>9} {'TPOT ms':>9} {'coloc TTFT':>10} {'coloc TPOT':>10} "
        f"{'TTFT/col':>8} {'tokens':>9}"
    )
    for r in results:
        pair = f"{r.prefill_tp}->{r.decode_tp}"
        if r.failure and r.ttft_s != r.ttft_s:  # nothing measured
            print(f"{r.connector.value:>10} {pair:>9} FAILED: {r.failure}")
            continue
        print(
            f"{r.connector.value:>10} {pair:>9} {r.transfer_ms:8.1f} "
            f"{r.transfers_per_request:9.1f} {_ms(r.first_ttft_s)} {_ms(r.ttft_s)} "
            f"{r.tpot_s * 1e3:9.1f} {r.coloc_ttft_s * 1e3:10.0f} {r.coloc_tpot_s * 1e3:10.1f} "
            f"{r.ttft_s / r.coloc_ttft_s:8.2f} {'exact' if r.token_exact else 'DIFFER':>9}"
        )
        if r.failure:
            print(f"{'':>21}note: {r.failure}")
        for m in r.mismatches:
            print(f"{'':>21}tokens differ: {m}")


def run(args: argparse.Namespace) -> int:
    """Start every (pair, connector) in turn, print the table; 1 if a kvbridge pair
    failed or differed (NixlConnector's failures are recorded, not errors of this run)."""
    import importlib.util

    from kvbridge.vllm.models import DEFAULT_DIR, make

    if importlib.util.find_spec("vllm") is None:
        print("vLLM is not installed here: run `make bench-vllm` (it builds .venv-vllm)")
        return 2
    connectors = [Connector(c) for c in args.connectors]
    if Connector.NIXL in connectors and importlib.util.find_spec("nixl") is None:
        print("NixlConnector imports `nixl`: pip install --no-deps nixl==1.5.1")
        return 2
    pairs = []
    for text in args.pairs:
        p, _, d = text.partition(":")
        if not (p.isdigit() and d.isdigit()):
            print(f"--pairs {text!r}: give prefill tp:decode tp, e.g. 1:3")
            return 2
        pairs.append((int(p), int(d)))
    args.model_dir = make(args.model, DEFAULT_DIR)
    args.token = secrets.token_hex(32)
    # vLLM with NixlConnector opens a descriptor per UCX endpoint and mapping: "Too many
    # open files" at the default soft limit; the children inherit the hard limit
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print(
        f"{args.model}, block {args.block_size}, {args.requests} requests of "
        f"{args.prompt_words} words, {args.max_tokens} tokens each; open files {soft} -> "
        f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]}; NixlConnector's progress thread "
        f"delay {args.nixl_pthr_delay_us} us",
        flush=True,
    )
    results = []
    for p, d in pairs:
        for c in connectors:
            print(f"{c.value}: prefill tp {p} -> decode tp {d} ...", flush=True)
            t0 = time.monotonic()
            results.append(_run_pair(c, p, d, args))
            print(f"  done in {time.monotonic() - t0:.0f} s", flush=True)
    print_results(results)
    bad = [
        r for r in results if r.connector is Connector.KVBRIDGE and (r.failure or not r.token_exact)
    ]
    return 1 if bad else 0
