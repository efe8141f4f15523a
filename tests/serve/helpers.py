"""Helpers shared by the end-to-end serving tests."""

from __future__ import annotations

import httpx

from kvbridge.serve.disagg_backend import DisaggBackend
from kvbridge.serve.http_server import ServerThread
from kvbridge.serve.proxy import make_app


def instance_args(
    role: str, tp: int, block_size: int = 16, layout: str = "HND", *extra: str
) -> list[str]:
    return [
        "--role",
        role,
        "--tp",
        str(tp),
        "--block-size",
        str(block_size),
        "--layout",
        layout,
        "--kv-cache-mb",
        "32",
        "--lease-s",
        "20",
        "--transfer-timeout-s",
        "10",
        *extra,
    ]


def proxy_for(prefill: list[str], decode: list[str], recompute: bool = True) -> ServerThread:
    backend = DisaggBackend(prefill, decode, "smollm2-135m", recompute_on_failure=recompute)
    return ServerThread(make_app(backend)).start()


def complete(url: str, prompt: str, max_tokens: int = 12) -> dict:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(f"kvbridge_{name}") and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total
