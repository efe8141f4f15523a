"""Run the OpenAI-compatible proxy in the foreground (`kvbridge serve`)."""

from __future__ import annotations

import sys

import uvicorn
from fastapi import FastAPI

from kvbridge.connector import is_loopback
from kvbridge.serve.backend import Backend
from kvbridge.serve.config import Engine, ProxyConfig
from kvbridge.serve.disagg_backend import DisaggBackend
from kvbridge.serve.proxy import make_app


def reach(host: str) -> str:
    """Who can reach a server bound to `host`, in words for a banner."""
    if is_loopback(host):
        return "this host only"
    if host in ("0.0.0.0", "::", ""):
        return "every interface: other hosts too"
    return "other hosts too"


def proxy_banner(cfg: ProxyConfig, port: int) -> list[str]:
    """What the proxy binds where and who may call it; a warning when the OpenAI API is
    reachable from other hosts without an API key."""
    isolation = cfg.prefix_cache_isolation
    lines = [
        f"kvbridge proxy: OpenAI API on http://{cfg.host}:{port}/v1 ({reach(cfg.host)}); "
        f"API key {'required' if cfg.api_key else 'none'}; prefix cache shared per "
        f"{isolation.value if isolation else 'none'}"
        + ("; cached_tokens hidden" if cfg.hide_cached_tokens else "")
    ]
    if not is_loopback(cfg.host) and not cfg.api_key:
        lines.append(
            f"WARNING: the OpenAI API on {cfg.host}:{port} is open to anyone who can reach "
            "it, and so are the prompts other callers' cache hits reveal: set --api-key "
            "(or KVBRIDGE_API_KEY)"
        )
    return lines


def proxy_app(cfg: ProxyConfig) -> FastAPI:
    """The proxy's app over the instances `cfg` names, with its settings."""
    backend: Backend
    if cfg.engine is Engine.VLLM:
        from kvbridge.serve.vllm_backend import VLLMBackend

        backend = VLLMBackend(
            cfg.prefill_urls,
            cfg.decode_urls,
            cfg.model,
            recompute_on_failure=cfg.recompute_on_failure,
        )
    else:
        backend = DisaggBackend(
            list(cfg.prefill_urls),
            list(cfg.decode_urls),
            cfg.model,
            recompute_on_failure=cfg.recompute_on_failure,
            token=cfg.token(),
            verify=cfg.instance_tls(),
        )
    return make_app(
        backend,
        max_body_bytes=cfg.max_body_bytes,
        api_key=cfg.api_key,
        isolation=cfg.prefix_cache_isolation,
        hide_cached_tokens=cfg.hide_cached_tokens,
    )


def run_proxy(cfg: ProxyConfig) -> int:
    app = proxy_app(cfg)
    for line in proxy_banner(cfg, cfg.port):
        print(line, file=sys.stderr, flush=True)
    print(
        f"{cfg.engine.value} instances: prefill {list(cfg.prefill_urls)}, decode "
        f"{list(cfg.decode_urls)}; "
        "Ctrl-C stops everything",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning")
    return 0
