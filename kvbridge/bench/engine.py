"""`kvbridge bench engine`: TTFT and decode speed of the reference engine at several tp
sizes, next to transformers' `generate` on the same GGUF in the same run.

Wired under `kvbridge bench` by kvbridge.cli.bench_cmd (`add_arguments` + `run`); also
runnable alone: ``python -m kvbridge.bench.engine``.
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
    from kvbridge.bench.engine_args import add_engine_arguments

    add_engine_arguments(p)
    p.set_defaults(tp=None)
    p.add_argument("--tp-sizes", default="1,3,9", help="comma-separated tp sizes (default 1,3,9)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2, help="timed runs per figure (median)")
    p.add_argument(
        "--floor",
        action="store_true",
        help="also time each tp > 1 with free collectives (tp shard processes, no "
        "communication): what the step costs on these cores before any communication",
    )
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


class _Transformers:
    """transformers' model on the same file, loaded once, measured next to each engine run
    (the machine is shared and noisy: only figures taken side by side compare)."""

    def __init__(self, args: argparse.Namespace, ids: list[int]) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from kvbridge.engine.weights import resolve_model

        path = resolve_model(args.model)
        t0 = time.perf_counter()
        if path.is_dir():
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
        self.start_s = time.perf_counter() - t0
        self.x = torch.tensor([ids])
        self.decode_tokens = args.decode_tokens
        from kvbridge.bench.engine_args import engine_config

        self.threads = engine_config(args, tp_size=1).torch_threads()  # the tp-1 engine's
        self._generate(2)  # warm-up

    def _generate(self, n: int) -> float:
        import torch

        torch.set_num_threads(self.threads)
        t = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                self.x,
                attention_mask=torch.ones_like(self.x),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
            )
        return time.perf_counter() - t

    def measure(self) -> tuple[float, float]:
        """(TTFT s, decode s per token)."""
        ttft = self._generate(1)
        total = self._generate(self.decode_tokens + 1)
        return ttft, (total - ttft) / self.decode_tokens


def _bench_engine(args: argparse.Namespace, tp: int, hf: _Transformers | None) -> dict[str, float]:
    """Engine figures at `tp` and, measured alternately with them, transformers' figures."""
    import torch

    from kvbridge.bench.engine_args import engine_config
    from kvbridge.engine.llm_engine import LLMEngine
    from kvbridge.engine.sampling import SamplingParams

    t0 = time.perf_counter()
    config = engine_config(
        args,
        tp_size=tp,
        prefill_chunk_size=max(512, args.prompt_tokens),
        enable_prefix_caching=False,  # every run computes its prompt whole
    )
    with LLMEngine(args.model, config) as engine:
        start_s = time.perf_counter() - t0
        ids = _prompt_ids(engine.tokenizer, args.prompt_tokens)
        engine.generate([ids[:16]], SamplingParams(max_tokens=2))  # warm-up
        params = SamplingParams(max_tokens=args.decode_tokens + 1, ignore_eos=True)
        ttfts, steps, hf_ttfts, hf_steps = [], [], [], []
        for _ in range(args.repeat):
            if tp == 1:  # the transformers baseline set its own between the runs
                torch.set_num_threads(config.torch_threads())
            out = engine.generate([ids], params)[0]
            ttfts.append(out.ttft_s)
            steps.append((out.total_s - out.ttft_s) / args.decode_tokens)
            if hf is not None:
                hf_ttft, hf_step = hf.measure()
                hf_ttfts.append(hf_ttft)
                hf_steps.append(hf_step)
    med = statistics.median
    return {
        "start_s": start_s,
        "ttft_s": med(ttfts),
        "step_s": med(steps),
        "hf_ttft_s": med(hf_ttfts) if hf_ttfts else float("nan"),
        "hf_step_s": med(hf_steps) if hf_steps else float("nan"),
    }


def _floor(args: argparse.Namespace, tp: int, leave_core: bool) -> float:
    from kvbridge.bench.engine_args import engine_config
    from kvbridge.bench.floor import floor_step_s
    from kvbridge.engine.weights import resolve_model

    what = "switch" if leave_core else "floor"
    print(f"running {what} tp {tp} ...", file=sys.stderr, flush=True)
    config = engine_config(
        args,
        tp_size=tp,
        prefill_chunk_size=max(512, args.prompt_tokens),
        enable_prefix_caching=False,  # every run computes its prompt whole
    )
    return floor_step_s(
        resolve_model(args.model), config, args.prompt_tokens, args.decode_tokens, leave_core
    )


def run(args: argparse.Namespace) -> int:
    from kvbridge.engine.tokenizer import Tokenizer
    from kvbridge.engine.weights import resolve_model

    tps = [int(x) for x in str(args.tp_sizes).split(",") if x.strip()]
    print(
        f"model {args.model}; prompt {args.prompt_tokens} tokens, decode "
        f"{args.decode_tokens} tokens; median of {args.repeat}; float32 on CPU; "
        "transformers measured alternately with each engine run",
        flush=True,
    )
    hf = None
    if not args.no_transformers:
        print("loading transformers ...", file=sys.stderr, flush=True)
        hf = _Transformers(
            args, _prompt_ids(Tokenizer.load(resolve_model(args.model)), args.prompt_tokens)
        )
        print(f"transformers load {hf.start_s:.1f} s", flush=True)
    print(
        f"{'':10} {'start s':>8} {'TTFT ms':>9} {'ms/tok':>8} {'tok/s':>7} "
        f"{'HF TTFT ms':>11} {'HF ms/tok':>10} {'TTFT vs HF':>11} {'decode vs HF':>13} "
        f"{'step vs tp1':>12}",
        flush=True,
    )
    tp1_step = None
    for tp in tps:
        print(f"running engine tp {tp} ...", file=sys.stderr, flush=True)
        r = _bench_engine(args, tp, hf)
        if tp == 1:
            tp1_step = r["step_s"]
        vs_ttft = f"{r['hf_ttft_s'] / r['ttft_s']:.2f}x" if hf else ""
        vs_dec = f"{r['hf_step_s'] / r['step_s']:.2f}x" if hf else ""
        vs_tp1 = f"{r['step_s'] / tp1_step:.2f}" if tp1_step else ""
        # Printed as soon as measured: a slow tp size does not hide the others' figures.
        print(
            f"{'engine tp' + str(tp):10} {r['start_s']:8.1f} {r['ttft_s'] * 1e3:9.1f} "
            f"{r['step_s'] * 1e3:8.1f} {1 / r['step_s']:7.1f} {r['hf_ttft_s'] * 1e3:11.1f} "
            f"{r['hf_step_s'] * 1e3:10.1f} {vs_ttft:>11} {vs_dec:>13} {vs_tp1:>12}",
            flush=True,
        )
        if args.floor and tp > 1:
            for label, leave_core in (("floor", False), ("switch", True)):
                floor = _floor(args, tp, leave_core)
                vs_floor = f"{floor / tp1_step:.2f}" if tp1_step else ""
                print(
                    f"{label + ' tp' + str(tp):10} {'':8} {'':9} {floor * 1e3:8.1f} "
                    f"{1 / floor:7.1f} {'':11} {'':10} {'':>11} {'':>13} {vs_floor:>12}",
                    flush=True,
                )
    print(
        "vs HF: transformers' time / ours (above 1 = faster than transformers); "
        "step vs tp1: decode step time relative to tp 1 (target <= 1.5 at tp 9)"
    )
    if args.floor:
        print(
            "floor tpN: N processes each computing its rank's shard at the same time with "
            "collectives that exchange nothing; switch tpN: the same, but each collective "
            "sleeps 10 us (the rank leaves its core, as a waiting rank must when ranks "
            "outnumber cores)"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvbridge bench engine", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
