"""Run the OpenAI-compatible proxy in the foreground (`kvbridge serve`)."""

from __future__ import annotations

import sys

import uvicorn

from kvbridge.serve.config import ProxyConfig
from kvbridge.serve.disagg_backend import DisaggBackend
from kvbridge.serve.proxy import make_app


def run_proxy(cfg: ProxyConfig) -> int:
    backend = DisaggBackend(
        list(cfg.prefill_urls),
        list(cfg.decode_urls),
        cfg.model,
        recompute_on_failure=cfg.recompute_on_failure,
        token=cfg.token(),
    )
    print(
        f"kvbridge proxy on http://{cfg.host}:{cfg.port}/v1 (prefill {list(cfg.prefill_urls)}, "
        f"decode {list(cfg.decode_urls)}); Ctrl-C stops everything",
        file=sys.stderr,
        flush=True,
    )
    app = make_app(
        backend,
        max_body_bytes=cfg.max_body_bytes,
        api_key=cfg.api_key,
        isolation=cfg.prefix_cache_isolation,
        hide_cached_tokens=cfg.hide_cached_tokens,
    )
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning")
    return 0
