"""Helpers shared by the end-to-end serving tests."""

from __future__ import annotations

import httpx

from kvbridge.serve.disagg_backend import DisaggBackend
from kvbridge.serve.http_server import ServerThread
from kvbridge.serve.proxy import make_app


def instance_args(
    role: str, tp: int, block_size: int = 16, layout: str = "BHLNC", *extra: str
) -> list[str]:
    """A test instance: a small cache, and timeouts generous enough for a 2-core machine
    running two dozen processes (the fault tests pass shorter ones in `extra`)."""
    args = ["--role", role, "--tp", str(tp), "--block-size", str(block_size)]
    args += ["--layout", layout, "--kv-cache-mb", "32", "--lease-s", "120"]
    return [*args, "--transfer-timeout-s", "60", "--handshake-timeout-s", "30", *extra]


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
