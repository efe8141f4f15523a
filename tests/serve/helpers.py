"""Helpers shared by the end-to-end serving tests."""

from __future__ import annotations

import select
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvbridge.serve.config import InstanceConfig, Role
from kvbridge.serve.disagg_backend import DisaggBackend
from kvbridge.serve.http_server import ServerThread
from kvbridge.serve.proxy import make_app


def instance_args(
    role: str, tp: int, block_size: int = 16, layout: str = "BHLNC", **overrides: Any
) -> list[str]:
    """A test instance's command line: a small cache, and timeouts generous enough for a
    2-core machine running two dozen processes (the fault tests pass shorter ones)."""
    fields: dict[str, Any] = dict(
        kv_cache_mb=32, lease_s=120, transfer_timeout_s=60, handshake_timeout_s=30
    )
    fields.update(overrides)
    return InstanceConfig(
        Role(role), tp, block_size=block_size, cache_layout=layout, **fields
    ).to_args()


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


def raw_post(url: str, path: str, headers: bytes, chunks: list[bytes]) -> tuple[int, bytes]:
    """POST by hand: the request line and `headers`, then `chunks` until the server
    answers (or they run out); (bytes of body sent, the whole answer)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode() + headers + b"\r\n")
        sent = 0
        for chunk in chunks:
            if select.select([sock], [], [], 0)[0]:
                break  # answered before the body ended
            sock.sendall(chunk)
            sent += len(chunk)
            time.sleep(0.001)
        answer = b""
        while data := sock.recv(65536):
            answer += data
    return sent, answer
