"""Run the OpenAI-compatible proxy in the foreground (`kvbridge serve`)."""

from __future__ import annotations

import signal
import sys
import threading

import uvicorn
from fastapi import FastAPI

from kvbridge.connector import is_loopback
from kvbridge.errors import ConfigError
from kvbridge.serve.api_keys import ApiKeys, KeyTable
from kvbridge.serve.backend import Backend
from kvbridge.serve.config import Engine, ProxyConfig
from kvbridge.serve.disagg_backend import DisaggBackend
from kvbridge.serve.isolation import PrefixCacheIsolation, self_declared_warning
from kvbridge.serve.proxy import make_app


def reach(host: str) -> str:
    """Who can reach a server bound to `host`, in words for a banner."""
    if is_loopback(host):
        return "this host only"
    if host in ("0.0.0.0", "::", ""):
        return "every interface: other hosts too"
    return "other hosts too"


def proxy_banner(cfg: ProxyConfig, port: int) -> list[str]:
    """What the proxy binds where, who may call it and who shares cached prefixes; a
    warning when the OpenAI API is reachable from other hosts without an API key, and
    when `user` isolation rests on a user field nobody authenticates."""
    isolation = cfg.prefix_cache_isolation or PrefixCacheIsolation.NONE
    keys = cfg.api_keys()
    if cfg.api_key_file:
        who = f"API keys from {cfg.api_key_file}: {_keys_of(keys.table)}"
    else:
        who = f"API key {'required' if cfg.api_key else 'none'}"
    lines = [
        f"kvbridge proxy: OpenAI API on http://{cfg.host}:{port}/v1 ({reach(cfg.host)}); "
        f"{who}; prefix cache shared per {isolation.value} "
        f"({isolation.namespace_text(cfg.has_api_key)})"
        + ("; cached_tokens hidden" if cfg.hide_cached_tokens else "")
    ]
    if not is_loopback(cfg.host) and not cfg.has_api_key:
        lines.append(
            f"WARNING: the OpenAI API on {cfg.host}:{port} is open to anyone who can reach "
            "it, and so are the prompts other callers' cache hits reveal: set --api-key "
            "(or KVBRIDGE_API_KEY) or --api-key-file"
        )
    warning = self_declared_warning(isolation, cfg.has_api_key)
    if warning is not None:
        lines.append(warning)
    return lines


def proxy_app(cfg: ProxyConfig, api_keys: ApiKeys | None = None) -> FastAPI:
    """The proxy's app over the instances `cfg` names, with its settings (and
    `api_keys`, by default as `cfg` names them now)."""
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
        api_key=api_keys if api_keys is not None else cfg.api_keys(),
        isolation=cfg.prefix_cache_isolation,
        hide_cached_tokens=cfg.hide_cached_tokens,
    )


def reload_on_sighup(api_keys: ApiKeys) -> None:
    """Read the API key file again on SIGHUP (from the main thread only; it replaces
    `kvbridge serve`'s stop on SIGHUP: with a key file, stop with SIGTERM or Ctrl-C).
    What was reloaded, or why the keys in force stay, goes to stderr."""
    if api_keys.path is None or threading.current_thread() is not threading.main_thread():
        return

    def reload(signum: int, frame: object) -> None:
        try:
            table = api_keys.reload()
        except ConfigError as exc:
            say(f"kvbridge proxy: SIGHUP: {exc}; the API keys in force stay as they were")
            return
        say(f"kvbridge proxy: SIGHUP: in force from {api_keys.path}: {_keys_of(table)}")

    signal.signal(signal.SIGHUP, reload)


def _keys_of(table: KeyTable) -> str:
    """'3 keys of 2 tenants', in words."""

    def count(n: int, noun: str) -> str:
        return f"{n} {noun}" + ("" if n == 1 else "s")

    return f"{count(len(table), 'key')} of {count(len(table.tenants), 'tenant')}"


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_proxy(cfg: ProxyConfig) -> int:
    api_keys = cfg.api_keys()
    app = proxy_app(cfg, api_keys)
    for line in proxy_banner(cfg, cfg.port):
        say(line)
    say(
        f"{cfg.engine.value} instances: prefill {list(cfg.prefill_urls)}, decode "
        f"{list(cfg.decode_urls)}; Ctrl-C stops everything"
        + ("; SIGHUP reloads the API keys" if api_keys.path else "")
    )
    reload_on_sighup(api_keys)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning")
    return 0
