"""`kvbridge bench engine`: TTFT and decode speed of the reference engine at several tp
sizes, next to transformers' `generate` on the same GGUF in the same run.

Wired under `kvbridge bench` by kvbridge.cli.bench_cmd (`add_arguments` + `run`); also
runnable alone: ``python -m kvbridge.cli.bench_engine``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

_FILLER = (
    "The history of the printing press begins in the fifteenth century, when movable type "
    "made books cheaper to produce. Scholars, merchants and clergy all took part in the "
    "spread of printed works across Europe, and literacy slowly rose in the cities. "
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvbridge.cli.generate_cmd import add_engine_arguments

    add_engine_arguments(p)
    p.set_defaults(tp=None)
    p.add_argument("--tp-sizes", default="1,3,9", help="comma-separated tp sizes (default 1,3,9)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2, help="timed runs per figure (median)")
    p.add_argument(
        "--no-transformers",
        action="store_true",
        help="skip the transformers baseline (it needs transformers + accelerate)",
    )


def _prompt_ids(tokenizer: Any, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(_FILLER)
    return ids[:n]


def _bench_engine(args: argparse.Namespace, tp: int) -> dict[str, float]:
    from kvbridge.cli.generate_cmd import engine_config
    from kvbridge.engine.llm_engine import LLMEngine
    from kvbridge.engine.sampling import SamplingParams

    t0 = time.perf_counter()
    config = engine_config(args, tp_size=tp, prefill_chunk_size=max(512, args.prompt_tokens))
    with LLMEngine(args.model, config) as engine:
        start_s = time.perf_counter() - t0
        ids = _prompt_ids(engine.tokenizer, args.prompt_tokens)
        engine.generate([ids[:16]], SamplingParams(max_tokens=2))  # warm-up
        ttfts, steps = [], []
        for _ in range(args.repeat):
            out = engine.generate(
                [ids], SamplingParams(max_tokens=args.decode_tokens + 1, ignore_eos=True)
            )[0]
            ttfts.append(out.ttft_s)
            steps.append((out.total_s - out.ttft_s) / args.decode_tokens)
    return {
        "start_s": start_s,
        "ttft_s": statistics.median(ttfts),
        "step_s": statistics.median(steps),
    }


def _bench_transformers(args: argparse.Namespace, ids: list[int]) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from kvbridge.engine.weights import resolve_model

    torch.set_num_threads(args.threads or 2)
    path = resolve_model(args.model)
    t0 = time.perf_counter()
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    start_s = time.perf_counter() - t0
    x = torch.tensor([ids])
    mask = torch.ones_like(x)

    def run(n: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False
            )
        return time.perf_counter() - t

    run(2)  # warm-up
    ttfts, steps = [], []
    for _ in range(args.repeat):
        ttft = run(1)
        total = run(args.decode_tokens + 1)
        ttfts.append(ttft)
        steps.append((total - ttft) / args.decode_tokens)
    return {
        "start_s": start_s,
        "ttft_s": statistics.median(ttfts),
        "step_s": statistics.median(steps),
    }


def run(args: argparse.Namespace) -> int:
    from kvbridge.engine.tokenizer import Tokenizer
    from kvbridge.engine.weights import resolve_model

    tps = [int(x) for x in str(args.tp_sizes).split(",") if x.strip()]
    print(
        f"model {args.model}; prompt {args.prompt_tokens} tokens, decode "
        f"{args.decode_tokens} tokens; median of {args.repeat}; float32 on CPU",
        flush=True,
    )
    rows: dict[str, dict[str, float]] = {}
    print(
        f"{'':14} {'start s':>8} {'TTFT ms':>9} {'decode ms/tok':>14} {'tok/s':>7} "
        f"{'TTFT vs HF':>11} {'decode vs HF':>13} {'step vs tp1':>12}",
        flush=True,
    )

    def show(name: str, r: dict[str, float]) -> None:
        # Printed as soon as measured: a slow tp size does not hide the others' figures.
        rows[name] = r
        base, tp1 = rows.get("transformers"), rows.get("engine tp1")
        vs_hf_ttft = f"{base['ttft_s'] / r['ttft_s']:.2f}x" if base and r is not base else ""
        vs_hf_dec = f"{base['step_s'] / r['step_s']:.2f}x" if base and r is not base else ""
        vs_tp1 = f"{r['step_s'] / tp1['step_s']:.2f}" if tp1 and name.startswith("engine") else ""
        print(
            f"{name:14} {r['start_s']:8.1f} {r['ttft_s'] * 1e3:9.1f} {r['step_s'] * 1e3:14.1f} "
            f"{1 / r['step_s']:7.1f} {vs_hf_ttft:>11} {vs_hf_dec:>13} {vs_tp1:>12}",
            flush=True,
        )

    if not args.no_transformers:
        ids = _prompt_ids(Tokenizer.load(resolve_model(args.model)), args.prompt_tokens)
        print("running transformers ...", file=sys.stderr, flush=True)
        show("transformers", _bench_transformers(args, ids))
    for tp in tps:
        print(f"running engine tp {tp} ...", file=sys.stderr, flush=True)
        show(f"engine tp{tp}", _bench_engine(args, tp))
    print(
        "vs HF: transformers' time / ours (above 1 = faster than transformers); "
        "step vs tp1: decode step time relative to tp 1 (target <= 1.5 at tp 9)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvbridge bench engine", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
