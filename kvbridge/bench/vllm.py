"""`kvbridge bench vllm`: KVBridgeConnector next to vLLM's NixlConnector and colocated
vLLM, in one run (run it in vLLM's environment: `make bench-vllm`).

For each TP pair (default SmolLM2-135M prefill tp 1 -> decode tp 1 and tp 1 -> tp 3,
block 32) the bench starts, one after the other: a decode instance alone (colocated
vLLM: no connector), then per connector a prefill and a decode instance with that
connector and kvbridge's proxy in front (`--engine vllm`, vLLM's two-step P/D
request). One request warms each up (a connector's handshakes, a first forward's
compiles); then at each `--concurrency` the same `--requests` prompts, new to every
cache, are streamed that many at a time. Printed per pair, concurrency and connector:

- transfer ms: the median span from the request reaching the decode's scheduler to its
  last KV byte in place (its last TP worker's report), the same span for both
  connectors, timed by the same hooks on vLLM's connector API
  (`kvbridge/bench/vllm_hooks/`, `vllm_trace.py`); and each connector's own figure
  from the decode's /metrics (KVBridgeConnector: `vllm:kvbridge_pull_time_seconds`, a
  worker's pull from its order to its last byte; NixlConnector:
  `vllm:nixl_xfer_time_seconds`, one READ from post to completion), with the count of
  those per request and, for NixlConnector, its descriptors per READ;
- median TTFT and TPOT and their ratios to colocated vLLM at the same concurrency;
- idle CPU per worker: each instance's processes over `--idle-s` seconds with no
  request, % of a core per TP worker (`bench serve`'s figure), the busier instance's
  (a progress thread that spins shows here);
- where a pull's time goes (`--steps`): order, pull, report, take (`vllm_trace.py`)
  and the connector's calls per step on the decode (what a step pays for it: TPOT);
- whether the disaggregated tokens equal colocated ones, and where a setup failed (the
  reason from the response or the instance's log).

`--json` prints the rows as one JSON list instead (fields `pair`, `concurrency`,
`connector`: kvbridge, nixl or colocated, `transfer_ms`, `ttft_ms`, `tpot_ms`,
`ttft_ratio`, `tpot_ratio`, and the rest of the table).

NixlConnector on a CPU host needs three things said here: the `nixl` package (vLLM
imports `nixl`, not the `nixl-cu12` wheel kvbridge uses; `pip install --no-deps
nixl==1.5.1`), a lease that outlives a loaded host's steps (`kv_lease_duration`, as
long as KVBridgeConnector's `lease_s`), and a progress thread that does not spin: NIXL's
Python API starts it with no delay between polls, so each NIXL agent takes a core from
vLLM's workers. `--nixl-pthr-delay-us` (default 1000) sets that delay through
`kvbridge/bench/vllm_hooks/sitecustomize.py`, on the NixlConnector instances only; 0
runs NixlConnector exactly as it ships.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import resource
import secrets
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbridge.bench.vllm_report import (
    Connector,
    Phase,
    Row,
    Setup,
    print_rows,
    pull_lines,
    rows_json,
    rows_of,
)
from kvbridge.bench.vllm_trace import read_traces
from kvbridge.settings import DEFAULT_MODEL
from kvbridge.transfer.netdev import free_port
from kvbridge.vllm.launch import (
    KV_ROLES,
    LOADED_HOST_SETTINGS,
    SMALL_HOST_ARGS,
    kv_transfer_config,
    new_credential_file,
    remove_credential_file,
    start,
    stop,
    vllm_command,
    vllm_env,
    wait_healthy,
)

if TYPE_CHECKING:
    from kvbridge.bench.client import Streamed

HOOKS_DIR = Path(__file__).resolve().parent / "vllm_hooks"


OWN_SERIES = {
    Connector.KVBRIDGE: ("kvbridge_pull_time_seconds", ""),
    Connector.NIXL: ("nixl_xfer_time_seconds", "nixl_num_descriptors"),
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
        default=[Connector.KVBRIDGE.value, Connector.NIXL.value],
        choices=[Connector.KVBRIDGE.value, Connector.NIXL.value],
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--block-size", type=int, default=32, help="both instances (default 32)")
    p.add_argument(
        "--requests",
        type=int,
        default=8,
        help="measured requests per concurrency (at least one round of that many)",
    )
    p.add_argument("--prompt-words", type=int, default=200, help="words per prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--idle-s", type=float, default=5.0, help="idle CPU window (seconds)")
    p.add_argument(
        "--nixl-pthr-delay-us",
        type=int,
        default=1000,
        help="NixlConnector only: microseconds between its NIXL progress thread's polls "
        "(default 1000; 0: as vLLM ships it, spinning)",
    )
    p.add_argument("--steps", action="store_true", help="also print where a pull's time goes")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    p.add_argument("--log-dir", default=".cache/bench-vllm")


def _kv_config(connector: Connector, side: str, credential_file: str) -> str | None:
    """The --kv-transfer-config of one side (KVBridgeConnector: each side enrolled for
    its own role, `credential_file`)."""
    if connector is Connector.KVBRIDGE:
        settings = {**LOADED_HOST_SETTINGS, "credential_file": credential_file}
        return kv_transfer_config(KV_ROLES[side], settings)
    if connector is Connector.COLOCATED:
        return None
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
    connector: Connector,
    tp: int,
    core: int,
    workers: int,
    trace_dir: Path | None,
    args: argparse.Namespace,
) -> dict[str, str]:
    env = vllm_env(tp, core, workers)
    env["PYTHONPATH"] = ":".join(p for p in (str(HOOKS_DIR), env.get("PYTHONPATH")) if p)
    if trace_dir is not None:
        env["KVBRIDGE_BENCH_TRACE"] = str(trace_dir)
    if connector is Connector.KVBRIDGE:
        env["KVBRIDGE_TRANSFER_TOKEN"] = args.token
    if connector is not Connector.NIXL:
        return env
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
    env["UCX_RCACHE_MAX_UNRELEASED"] = "1024"  # vLLM sets it unless nixl was imported first
    if args.nixl_pthr_delay_us > 0:
        env["KVBRIDGE_NIXL_PTHR_DELAY_US"] = str(args.nixl_pthr_delay_us)
    return env


def num_requests(requests: int, concurrency: int) -> int:
    """`requests` rounded up to whole rounds of `concurrency` (one round at least)."""
    return max(1, math.ceil(requests / concurrency)) * concurrency


def _prompts(args: argparse.Namespace, concurrency: int) -> list[str]:
    """One concurrency's prompts, the same in every setup; each starts with its own
    words, so no block of one is in a prefix cache from another."""
    from kvbridge.bench.client import WORDS

    body = " ".join(WORDS[j % len(WORDS)] for j in range(args.prompt_words))
    n = num_requests(args.requests, concurrency)
    return [f"c{concurrency} request {i}: {body} Summary:" for i in range(n)]


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


def _stream_all(url: str, prompts: list[str], concurrency: int, body: dict[str, Any]) -> Phase:
    from kvbridge.bench.client import stream_completion

    since = time.time()
    streams: list[Streamed] = []
    with ThreadPoolExecutor(concurrency) as pool:
        for i in range(0, len(prompts), concurrency):
            batch = prompts[i : i + concurrency]
            streams += pool.map(lambda p: stream_completion(url, {**body, "prompt": p}), batch)
    return Phase(streams, since, time.time())


def _run_setup(
    connector: Connector, prefill_tp: int, decode_tp: int, args: argparse.Namespace
) -> Setup:
    """Start the setup's instances (and the proxy), warm it up, stream every
    concurrency's prompts, measure its idle CPU, stop it."""
    import shutil

    import httpx

    from kvbridge.bench.client import stream_completion
    from kvbridge.serve.config import Engine, ProxyConfig
    from kvbridge.serve.http_server import ServerThread
    from kvbridge.serve.metrics import metric_value
    from kvbridge.serve.proxy_main import proxy_app

    res = Setup(connector)
    alone = connector is Connector.COLOCATED
    name = f"{connector.value}-tp{prefill_tp}-tp{decode_tp}"
    logs = Path(args.log_dir)
    trace_dir = logs / f"{name}-trace"
    shutil.rmtree(trace_dir, ignore_errors=True)
    trace_dir.mkdir(parents=True)
    sides = (
        [("decode", decode_tp, 1)]
        if alone
        else [("prefill", prefill_tp, 0), ("decode", decode_tp, 1)]
    )
    workers = sum(tp for _, tp, _ in sides)
    seqs = ("--max-num-seqs", str(max(4, *args.concurrency)))
    procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    urls: list[str] = []
    keys: list[str] = []
    server: ServerThread | None = None
    try:
        for side, tp, core in sides:
            port = free_port()
            if connector is Connector.KVBRIDGE:
                keys.append(new_credential_file(args.root, KV_ROLES[side], f"{name}-{side}"))
            cmd = vllm_command(
                args.model_dir,
                port,
                tp,
                args.block_size,
                _kv_config(connector, side, keys[-1] if keys else ""),
                *SMALL_HOST_ARGS,
                *seqs,
            )
            log = logs / f"{name}-{side}.log"
            traced = trace_dir if side == "decode" else None
            env = _env(connector, tp, core, workers, traced, args)
            procs.append((side, start(cmd, env, open(log, "wb")), log))  # noqa: SIM115
            urls.append(f"http://127.0.0.1:{port}")
        for (side, proc, log), url in zip(procs, urls, strict=True):
            try:
                wait_healthy(url, proc, 900)
            except (RuntimeError, TimeoutError) as exc:
                res.failure = f"{side} instance did not start ({exc}): {_last_error(log)}"
                return res
        decode_url = urls[-1]
        if alone:
            url = decode_url
        else:
            proxy = ProxyConfig(str(args.model_dir), (urls[0],), (urls[1],), engine=Engine.VLLM)
            server = ServerThread(proxy_app(proxy)).start()
            url = server.url
        body = {"max_tokens": args.max_tokens, "temperature": 0}
        own, descs = OWN_SERIES.get(connector, ("", ""))

        def figure(text: str, series: str) -> float:
            return metric_value(text, series, prefix="vllm:") if series else 0.0

        try:
            stream_completion(url, {**body, "prompt": "warm-up: " + _prompts(args, 1)[0]})
            for c in args.concurrency:
                before = httpx.get(decode_url + "/metrics", timeout=30).text
                phase = _stream_all(url, _prompts(args, c), c, body)
                after = httpx.get(decode_url + "/metrics", timeout=30).text
                phase.own_count = figure(after, own + "_count") - figure(before, own + "_count")
                phase.own_sum_s = figure(after, own + "_sum") - figure(before, own + "_sum")
                phase.descriptors = figure(after, descs + "_sum") - figure(before, descs + "_sum")
                res.phases[c] = phase
        except (RuntimeError, httpx.HTTPError) as exc:  # the setup failed: say why
            res.failure = f"{exc}; decode log: {_last_error(procs[-1][2])}"
            return res
        from kvbridge.bench.serve import idle_cpu  # httpx: the serve extra

        tps = [tp for _, tp, _ in sides]
        pcts = idle_cpu([proc.pid for _, proc, _ in procs], tps, args.idle_s)
        res.idle_cpu = {side: round(pct, 2) for (side, _, _), pct in zip(sides, pcts, strict=True)}
        return res
    finally:
        if server is not None:
            server.stop()
        for _, proc, _ in reversed(procs):
            stop(proc)
        for key in keys:
            remove_credential_file(key)
        res.trace = read_traces(trace_dir)
        if connector is Connector.KVBRIDGE and procs:
            res.pulls = pull_lines(procs[-1][2].read_text(errors="replace"))


def run(args: argparse.Namespace) -> int:
    """Start every (pair, setup) in turn, print the table; 1 if a kvbridge setup
    failed or differed (NixlConnector's failures are recorded, not errors of this run)."""
    import importlib.util

    from kvbridge.connector import RootKey
    from kvbridge.vllm.models import DEFAULT_DIR, make

    if importlib.util.find_spec("vllm") is None:
        print("vLLM is not installed here: run `make bench-vllm` (it builds .venv-vllm)")
        return 2
    connectors = [Connector(c) for c in args.connectors]
    if Connector.NIXL in connectors and importlib.util.find_spec("nixl") is None:
        print("NixlConnector imports `nixl`: pip install --no-deps nixl==1.5.1")
        return 2
    if any(c < 1 for c in args.concurrency):
        print(f"--concurrency {args.concurrency}: give counts of 1 or more, e.g. 1 4 8")
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
    args.root = RootKey.generate()  # the run's deployment root: it stays in this process
    # vLLM with NixlConnector opens a descriptor per UCX endpoint and mapping: "Too many
    # open files" at the default soft limit; the children inherit the hard limit
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    say = sys.stderr if args.json else sys.stdout
    print(
        f"{args.model}, block {args.block_size}, {args.requests} requests of "
        f"{args.prompt_words} words per concurrency {args.concurrency}, {args.max_tokens} "
        f"tokens each; open files {soft} -> {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}; "
        f"NixlConnector's progress thread delay {args.nixl_pthr_delay_us} us",
        file=say,
        flush=True,
    )
    rows: list[Row] = []
    for p, d in pairs:
        setups = []
        for c in [Connector.COLOCATED, *connectors]:
            print(f"{c.value}: prefill tp {p} -> decode tp {d} ...", file=say, flush=True)
            t0 = time.monotonic()
            setups.append(_run_setup(c, p, d, args))
            print(f"  done in {time.monotonic() - t0:.0f} s", file=say, flush=True)
        rows += rows_of(f"{p}->{d}", setups[0], setups[1:])
    if args.json:
        print(rows_json(rows))
    else:
        print_rows(rows, args.steps)
    bad = [
        r
        for r in rows
        if r.connector == Connector.KVBRIDGE.value and (r.failure or r.token_exact is False)
    ]
    return 1 if bad else 0
