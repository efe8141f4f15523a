"""`kvbridge bench serve`: disaggregated vs colocated, measured in the same run.

One prefill instance (tp A) and one decode instance (tp B) are started once. The
disaggregated path is proxy -> prefill -> KV over NIXL -> decode; the colocated
baseline sends the same requests to the decode instance alone (the prompt computed
there, at tp B). Client-side TTFT (first streamed token) and TPOT (mean gap between
the following tokens) are reported at each concurrency, with ratios.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import time

import httpx

from kvbridge.serve.config import InstanceConfig, Role
from kvbridge.serve.disagg_backend import DisaggBackend
from kvbridge.serve.http_server import ServerThread
from kvbridge.serve.launcher import Deployment
from kvbridge.serve.metrics import metric_value
from kvbridge.serve.proxy import make_app

_WORDS = [
    "the",
    "river",
    "ran",
    "past",
    "an",
    "old",
    "mill",
    "where",
    "a",
    "miller",
    "kept",
    "bread",
    "and",
    "grain",
    "for",
    "the",
    "town",
    "while",
    "children",
    "played",
    "near",
    "the",
    "water",
    "and",
    "birds",
    "sang",
    "in",
    "tall",
    "green",
    "trees",
]


def _one(url: str, prompt: str, max_tokens: int) -> tuple[float, float]:
    """(ttft_s, tpot_s) of one streamed greedy completion."""
    t0 = time.perf_counter()
    stamps = []
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True},
        timeout=600,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError("no token streamed")
    ttft = stamps[0] - t0
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    return ttft, tpot


def _measure(
    url: str, concurrency: int, rounds: int, words: int, max_tokens: int, tag: str
) -> tuple[float, float]:
    """Median TTFT and TPOT; prompts are new to every cache (`tag` tells the paths apart)
    so each request computes and moves its whole prompt."""
    ttfts, tpots = [], []
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for r in range(rounds):
            prompts = [
                " ".join(f"{tag}{concurrency}_{r}_{i}_{j}" for j in range(words)) + " Summary:"
                for i in range(concurrency)
            ]
            for ttft, tpot in pool.map(lambda p: _one(url, p, max_tokens), prompts):
                ttfts.append(ttft)
                tpots.append(tpot)
    return statistics.median(ttfts), statistics.median(tpots)


def run_serve_bench(args: argparse.Namespace) -> int:
    if args.multi_turn:
        from kvbridge.bench.multiturn import run_multi_turn_bench

        return run_multi_turn_bench(args)
    dep = Deployment()
    servers: list[ServerThread] = []
    common = dict(model=args.model, kv_cache_mb=64)
    try:
        print(
            f"starting prefill tp {args.prefill_tp} and decode tp {args.decode_tp} ...", flush=True
        )
        p = dep.start_instance("prefill", InstanceConfig(Role.PREFILL, args.prefill_tp, **common))
        d = dep.start_instance("decode", InstanceConfig(Role.DECODE, args.decode_tp, **common))
        dep.wait_healthy(1800, say=lambda s: print(s, flush=True))
        disagg = ServerThread(make_app(DisaggBackend([p.url], [d.url], args.model))).start()
        coloc = ServerThread(make_app(DisaggBackend([], [d.url], args.model))).start()
        servers += [disagg, coloc]
        _one(disagg.url, "warm up", 4)
        _one(coloc.url, "warm up", 4)
        print(f"{'concurrency':>11} {'path':>24} {'TTFT ms':>9} {'TPOT ms':>9}")
        for c in args.concurrency:
            before = httpx.get(f"{disagg.url}/metrics").text
            dt, dp = _measure(disagg.url, c, args.rounds, args.prompt_words, args.max_tokens, "d")
            after = httpx.get(f"{disagg.url}/metrics").text
            ct, cp = _measure(coloc.url, c, args.rounds, args.prompt_words, args.max_tokens, "c")
            n = metric_value(after, "kv_transfer_ms_count") - metric_value(
                before, "kv_transfer_ms_count"
            )
            kv = (
                metric_value(after, "kv_bytes_total") - metric_value(before, "kv_bytes_total")
            ) / max(n, 1)
            xfer = metric_value(after, "kv_transfer_ms_sum") - metric_value(
                before, "kv_transfer_ms_sum"
            )
            print(
                f"{c:>11} {f'disagg tp{args.prefill_tp}->tp{args.decode_tp}':>24} "
                f"{dt * 1e3:9.0f} {dp * 1e3:9.1f}"
            )
            print(f"{c:>11} {f'colocated tp{args.decode_tp}':>24} {ct * 1e3:9.0f} {cp * 1e3:9.1f}")
            print(
                f"{c:>11} {'ratio disagg/colocated':>24} {dt / ct:9.2f} "
                f"{dp / cp if cp else float('nan'):9.2f}   KV per request "
                f"{kv / 2**20:.2f} MiB, transfer {xfer / max(n, 1):.1f} ms"
            )
        return 0
    finally:
        for s in servers:
            s.stop()
        dep.stop()
