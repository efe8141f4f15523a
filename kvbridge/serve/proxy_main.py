"""Run the OpenAI-compatible proxy in the foreground (`kvbridge serve`)."""

from __future__ import annotations

import argparse
import sys

import uvicorn

from kvbridge.serve.disagg_backend import DisaggBackend
from kvbridge.serve.proxy import make_app


def run_proxy(args: argparse.Namespace, prefill_urls: list[str], decode_urls: list[str]) -> int:
    backend = DisaggBackend(
        prefill_urls,
        decode_urls,
        args.model,
        recompute_on_failure=args.kv_load_failure == "recompute",
    )
    print(
        f"kvbridge proxy on http://{args.host}:{args.port}/v1 (prefill {prefill_urls}, "
        f"decode {decode_urls}); Ctrl-C stops everything",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(make_app(backend), host=args.host, port=args.port, log_level="warning")
    return 0
