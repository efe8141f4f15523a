"""`kvbridge demo`: the whole system once, end to end, checked.

Starts a prefill and a decode instance and the proxy, sends one prompt through the
OpenAI API, prints the completion and its stages, then asks the decode instance to
generate the same request colocated (prompt computed there) and checks the texts match.
Exits 1 if the request failed, if its KV cache did not come over from the prefill
instance (whatever the fallback then did: the reason is printed), or if the texts differ.
"""

from __future__ import annotations

import ssl
import sys
import time
from dataclasses import replace
from typing import Any

import httpx
import msgspec

from kvbridge.connector import free_port
from kvbridge.serve import wire
from kvbridge.serve.api_keys import read_key_file
from kvbridge.serve.backend import GenerateRequest, SamplingParams
from kvbridge.serve.config import DeploymentConfig, ProxyConfig
from kvbridge.serve.http_auth import SignedRequests
from kvbridge.serve.http_server import ServerThread
from kvbridge.serve.launcher import Deployment, LaunchError
from kvbridge.serve.proxy_main import proxy_app, proxy_banner
from kvbridge.serve.tls import client_context


def colocated_text(
    decode_url: str,
    prompt: str,
    max_tokens: int,
    token: bytes | None = None,
    verify: ssl.SSLContext | None = None,
) -> str:
    """The same greedy request computed entirely on one instance (signed with `token`
    when the instance has one; its HTTPS checked with `verify`, by default against the
    token's deployment CA)."""
    req = wire.DecodeRequest(
        GenerateRequest(
            request_id=f"colocated-{time.time_ns()}",
            prompt=prompt,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        )
    )
    parts = []
    with httpx.stream(
        "POST",
        f"{decode_url}/internal/generate",
        content=msgspec.json.encode(req),
        headers={"content-type": "application/json"},
        timeout=300,
        auth=SignedRequests(token) if token is not None else None,
        verify=verify or client_context(token),
    ) as r:
        if r.status_code != 200:
            r.read()
            raise LaunchError(f"colocated generation failed: HTTP {r.status_code}: {r.text}")
        for line in r.iter_lines():
            if line:
                ev = wire.event_decoder.decode(line)
                if ev.error:
                    raise LaunchError(f"colocated generation failed: {ev.error}")
                parts.append(ev.text)
    return "".join(parts)


def kv_failure(out: dict[str, Any]) -> str | None:
    """Why a completion from the proxy did not come through a KV transfer, or None if it
    did (or needed none: it ended at its first token)."""
    stages = out.get("kvbridge_stages", {})
    if stages.get("kv_load_failed"):
        reason = out.get("kvbridge_kv_load_error") or "no reason given"
        return f"the KV pull failed ({reason}); the decode instance recomputed the prompt"
    if out["usage"]["completion_tokens"] > 1 and not stages.get("kv_bytes"):
        return (
            "no KV cache was transferred: the prefill instance did not serve the request "
            "and the decode instance computed the prompt itself (see the proxy's warning)"
        )
    return None


def ask(
    proxy_url: str,
    decode_url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    token: bytes | None = None,
    api_key: str | None = None,
    verify: ssl.SSLContext | None = None,
) -> int:
    """Send the prompt through the proxy, print the completion and its stages, and check
    it: 0 if the KV came over and the text equals colocated generation, else 1."""
    say = print
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    say(f"$ curl {proxy_url}/v1/completions -d '{msgspec.json.encode(body).decode()}'")
    t0 = time.perf_counter()
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.post(f"{proxy_url}/v1/completions", json=body, timeout=300, headers=headers)
    elapsed = time.perf_counter() - t0
    if r.status_code != 200:
        say(f"request failed: HTTP {r.status_code}: {r.text}")
        return 1
    out = r.json()
    text = out["choices"][0]["text"]
    say(f"completion: {prompt!r} -> {text!r}")
    stages = out.get("kvbridge_stages", {})
    tokens = out["usage"]["completion_tokens"]
    decode_ms = stages.get("decode_ms", 0.0)
    say(
        f"stages: prefill {stages.get('prefill_ms', 0):.0f} ms | KV "
        f"{stages.get('kv_bytes', 0) / 2**20:.2f} MiB in {stages.get('transfer_ms', 0):.1f} ms"
        f" | decode {max(tokens - 1, 0)} tokens in {decode_ms:.0f} ms"
        + (f" ({(tokens - 1) / decode_ms * 1e3:.1f} tokens/s)" if decode_ms and tokens > 1 else "")
        + f" | total {elapsed * 1e3:.0f} ms"
    )
    failure = kv_failure(out)
    if failure is not None:
        say(f"FAILED: {failure}")
        return 1
    reference = colocated_text(decode_url, prompt, max_tokens, token, verify)
    if reference != text:
        say(f"MISMATCH: colocated generation gives {reference!r}")
        return 1
    say("check: identical to colocated generation on the decode instance")
    return 0


def _some_api_key(cfg: ProxyConfig) -> str | None:
    """A key the proxy accepts: --api-key's, else the first of --api-key-file."""
    if cfg.api_key or not cfg.api_key_file:
        return cfg.api_key
    return read_key_file(cfg.api_key_file)[0][1]


def wait_introduced(proxy_url: str, timeout_s: float) -> str:
    """Wait (at most `timeout_s`) until the proxy says every decode instance has met
    every prefill instance (its /health `introductions`); the last state seen."""
    deadline = time.monotonic() + timeout_s
    states: list[str] = []
    while True:
        try:
            intro = httpx.get(f"{proxy_url}/health", timeout=5.0).json().get("introductions", {})
            states = [state for peers in intro.values() for state in peers.values()]
        except (httpx.HTTPError, ValueError) as exc:
            states = [repr(exc)]
        if all(s in ("connected", "unsupported") for s in states) or time.monotonic() > deadline:
            return "; ".join(states) or "nothing to introduce"
        time.sleep(0.1)


def demo(cfg: DeploymentConfig, prompt: str, max_tokens: int) -> int:
    say = print
    dep = Deployment(verify=cfg.instance_tls())
    proxy: ServerThread | None = None
    try:
        say(
            f"starting prefill tp {cfg.prefill.tp_size} -> decode tp {cfg.decode.tp_size} "
            f"({cfg.prefill.model}) ..."
        )
        prefill = dep.start_instance("prefill", replace(cfg.prefill, host=cfg.host))
        decode = dep.start_instance("decode", replace(cfg.decode, host=cfg.host))
        dep.wait_healthy(cfg.start_timeout_s, say=say)
        proxy_cfg = cfg.proxy([prefill.url], [decode.url])
        app = proxy_app(proxy_cfg)
        port = cfg.port
        try:
            proxy = ServerThread(app, cfg.host, port).start()
        except Exception:
            port = free_port(cfg.host)
            say(f"port {cfg.port} is busy; the proxy uses {port}")
            proxy = ServerThread(app, cfg.host, port).start()
        for line in proxy_banner(proxy_cfg, port):
            say(line)
        # the first request meets peers already met (no handshake in its pull)
        say(f"introductions: {wait_introduced(proxy.url, 30.0)}")
        return ask(
            proxy.url,
            decode.url,
            cfg.prefill.model,
            prompt,
            max_tokens,
            proxy_cfg.token(),
            _some_api_key(proxy_cfg),
            dep.verify,
        )
    except LaunchError as exc:
        print(f"kvbridge demo: {exc}", file=sys.stderr)
        return 1
    finally:
        if proxy is not None:
            proxy.stop()
        dep.stop()
