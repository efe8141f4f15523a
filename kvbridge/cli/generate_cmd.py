"""`kvbridge generate`: run the reference engine on one prompt and print the completion."""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvbridge.bench.engine_args import add_engine_arguments, engine_config


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "generate",
        help="complete one prompt with the reference engine",
        description="Complete one prompt with the reference engine; tokens "
        "stream to stdout as they come (the whole object with --json).",
    )
    p.add_argument("prompt", help="the prompt text (a user message with --chat)")
    add_engine_arguments(p)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument(
        "--json", action="store_true", help="print one JSON object: text, token ids, timings"
    )
    p.add_argument("--quiet", action="store_true", help="no loading progress on stderr")
    p.set_defaults(handler=run, extra="engine")


def run(args: argparse.Namespace) -> int:
    from kvbridge.engine.llm_engine import LLMEngine
    from kvbridge.engine.sampling import SamplingParams
    from kvbridge.engine.torchrun import DistributedExecutor, serve_worker, under_torchrun
    from kvbridge.engine.weights import print_progress, resolve_model

    config = engine_config(args)
    progress = None if args.quiet else print_progress
    factory = None
    if under_torchrun():
        import os

        if int(os.environ["RANK"]) != 0:
            serve_worker(resolve_model(args.model), config)
            return 0
        factory = DistributedExecutor
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    t0 = time.perf_counter()
    with LLMEngine(args.model, config, progress, factory) as engine:
        load_s = time.perf_counter() - t0
        prompt = args.prompt
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        if args.json:
            out = engine.generate([prompt], params)[0]
            n = len(out.token_ids)
            decode_s = out.total_s - out.ttft_s
            print(
                json.dumps(
                    {
                        "text": out.text,
                        "token_ids": out.token_ids,
                        "prompt_ids": out.prompt_ids,
                        "finish_reason": out.finish_reason.value,
                        "tp_size": args.tp,
                        "timings": {
                            "load_s": round(load_s, 3),
                            "ttft_s": round(out.ttft_s, 4),
                            "total_s": round(out.total_s, 4),
                            "decode_tokens_per_s": round((n - 1) / decode_s, 2)
                            if n > 1 and decode_s > 0
                            else None,
                        },
                    }
                )
            )
        else:
            for delta in engine.stream(prompt, params):
                sys.stdout.write(delta.new_text)
                sys.stdout.flush()
            sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m kvbridge.cli.generate_cmd ...` (e.g. under torchrun): the same command."""
    from kvbridge.errors import KVBridgeError

    parser = argparse.ArgumentParser(prog="kvbridge")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["generate", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.handler(args) or 0)
    except KVBridgeError as exc:
        print(f"kvbridge generate: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
