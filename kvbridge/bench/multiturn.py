"""`kvbridge bench serve --multi-turn`: chat conversations with prefix caching on and off.

Two deployments (prefill tp A -> decode tp B) are started side by side, one with
automatic prefix caching and one with `--no-prefix-caching`. C conversations run T
turns each; every turn all C send their next request at once (streamed chat
completions, greedy), first to the caching deployment, then to the other, so both see
the same machine. Per turn it prints TTFT, prompt tokens, cached tokens (usage's
prompt_tokens_details), prefill tokens computed and KV bytes pulled (from the
instances' /metrics, over the turn), and the targets of issue 11: from turn 3 on the KV
pulled per request stays within (the turn's new tokens + one block) x the bytes the
decode instance reads per token (the plan's: every decode worker its heads, replicas
included), and from turn 4 on TTFT is at least 2x better with caching.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvbridge.bench.client import WORDS
from kvbridge.serve.config import InstanceConfig, Role
from kvbridge.serve.disagg_backend import DisaggBackend
from kvbridge.serve.http_server import ServerThread
from kvbridge.serve.launcher import Deployment
from kvbridge.serve.metrics import metric_value
from kvbridge.serve.proxy import make_app


#: Words of the user turns (each turn picks its own sequence of them).
def _user_message(conv: int, turn: int, words: int) -> str:
    pick = random.Random(1000 * conv + turn)  # the same text on every run and path
    body = " ".join(pick.choice(WORDS) for _ in range(words))
    return f"Conversation {conv}, turn {turn}. Notes: {body}. Summarise the notes briefly."


@dataclass
class _Turn:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class _Path:
    """One deployment: its proxy and what its conversations said so far."""

    name: str
    url: str
    decode_url: str
    history: list[list[dict[str, str]]] = field(default_factory=list)


def _chat(url: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[_Turn, str]:
    t0 = time.perf_counter()
    first = None
    text, use = [], {}
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=600,
    ) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                use = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    ttft = (first or time.perf_counter()) - t0
    cached = use.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    turn = _Turn(ttft, use.get("prompt_tokens", 0), cached, use.get("completion_tokens", 0))
    return turn, "".join(text)


def _decode_kv_bytes(path: _Path) -> float:
    """KV bytes the decode instance pulled so far (its /metrics are open)."""
    return metric_value(
        httpx.get(f"{path.decode_url}/metrics", timeout=30).text, "kv_instance_bytes_total"
    )


def _turn(
    path: _Path, pool: concurrent.futures.Executor, turn: int, args: argparse.Namespace
) -> tuple[list[_Turn], float]:
    """One turn of every conversation at once: (turns, KV bytes pulled per request)."""
    before = _decode_kv_bytes(path)
    for c, hist in enumerate(path.history):
        hist.append({"role": "user", "content": _user_message(c, turn, args.turn_words)})
    results = list(pool.map(lambda h: _chat(path.url, h, args.max_tokens), path.history))
    for hist, (_, reply) in zip(path.history, results, strict=True):
        hist.append({"role": "assistant", "content": reply})
    turns = [t for t, _ in results]
    kv = _decode_kv_bytes(path) - before
    return turns, kv / len(turns)


def run_multi_turn_bench(args: argparse.Namespace) -> int:
    from kvbridge.engine.weights import resolve_model
    from kvbridge.plan.geometry import load_model_spec
    from kvbridge.plan.layout import InstanceLayout
    from kvbridge.plan.planner import make_plan

    block = args.block_size
    spec = load_model_spec(resolve_model(args.model))
    plan = make_plan(
        spec,
        InstanceLayout(args.prefill_tp, block_size=block),
        InstanceLayout(args.decode_tp, block_size=block),
    )
    # what the decode instance reads per token: every worker its heads (replicas too)
    bytes_per_token = plan.bytes_per_token
    dep = Deployment()
    servers: list[ServerThread] = []
    common: dict[str, Any] = dict(
        model=args.model,
        kv_cache_mb=args.kv_cache_mb,
        block_size=block,
        cpu_priority=args.cpu_priority,
    )
    try:
        print(
            f"starting prefill tp {args.prefill_tp} -> decode tp {args.decode_tp}, twice "
            f"(prefix caching on / off); {args.conversations} conversations x {args.turns} "
            "turns ...",
            flush=True,
        )
        paths = []
        for name, caching in (("on", True), ("off", False)):
            p = dep.start_instance(
                f"prefill-{name}",
                InstanceConfig(
                    Role.PREFILL, args.prefill_tp, enable_prefix_caching=caching, **common
                ),
            )
            d = dep.start_instance(
                f"decode-{name}",
                InstanceConfig(
                    Role.DECODE, args.decode_tp, enable_prefix_caching=caching, **common
                ),
            )
            paths.append((name, p.url, d.url))
        dep.wait_healthy(1800, say=lambda s: print(s, flush=True))
        runs = []
        for name, p_url, d_url in paths:
            server = ServerThread(make_app(DisaggBackend([p_url], [d_url], args.model))).start()
            servers.append(server)
            runs.append(_Path(name, server.url, d_url))
            _chat(server.url, [{"role": "user", "content": f"warm up {name}"}], 2)
        for run in runs:
            run.history = [[] for _ in range(args.conversations)]
        print(
            f"{'turn':>4} {'caching':>7} {'TTFT ms':>8} {'prompt':>7} {'cached':>7} "
            f"{'computed':>8} {'KV MiB':>7} {'bound MiB':>9} {'KV ok':>5} {'TTFT off/on':>11}"
        )
        previous = 0.0
        ok = True
        with concurrent.futures.ThreadPoolExecutor(args.conversations) as pool:
            for turn in range(1, args.turns + 1):
                rows = [(run.name, *_turn(run, pool, turn, args)) for run in runs]
                ttft = {name: statistics.median(t.ttft_s for t in ts) for name, ts, _ in rows}
                for name, ts, kv in rows:
                    prompt = statistics.mean(t.prompt_tokens for t in ts)
                    cached = statistics.mean(t.cached_tokens for t in ts)
                    computed = prompt - cached  # prompt tokens whose KV was computed
                    bound = (prompt - previous + block) * bytes_per_token
                    kv_ok = "-" if name == "off" or turn < 3 else ("yes" if kv <= bound else "NO")
                    ok &= kv_ok != "NO"
                    ratio = ""
                    if name == "on":
                        r = ttft["off"] / ttft["on"]
                        ratio = f"{r:.2f}" + (" (>=2?)" if turn >= 4 else "")
                    print(
                        f"{turn:>4} {name:>7} {ttft[name] * 1e3:8.0f} {prompt:7.0f} "
                        f"{cached:7.0f} {computed:8.0f} {kv / 2**20:7.2f} "
                        f"{bound / 2**20 if name == 'on' else float('nan'):9.2f} {kv_ok:>5} "
                        f"{ratio:>11}",
                        flush=True,
                    )
                previous = statistics.mean(t.prompt_tokens for t in rows[0][1])
        print(
            f"KV bound (turns >= 3): {'met' if ok else 'NOT met'}; bound = (the turn's new "
            f"tokens + one block of {block}) x {bytes_per_token} bytes the decode instance "
            f"reads per token ({spec.bytes_per_token} of KV, each decode worker reading its "
            "heads, replicas included)"
        )
        return 0
    finally:
        for s in servers:
            s.stop()
        dep.stop()
