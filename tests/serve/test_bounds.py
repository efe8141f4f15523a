"""Bounds and banners (issue #21, item 5): a request asking for more tokens than the
context holds is refused naming both numbers; a proxy other hosts can reach without an
API key warns naming the flag; banners say what is bound where."""

from __future__ import annotations

import httpx
import pytest

from kvbridge.serve.config import ProxyConfig
from kvbridge.serve.disagg_backend import DisaggBackend
from kvbridge.serve.http_server import ServerThread
from kvbridge.serve.launcher import Deployment
from kvbridge.serve.proxy import make_app
from kvbridge.serve.proxy_main import proxy_banner, reach
from tests.serve.helpers import small_instance


def test_a_public_proxy_without_an_api_key_warns_naming_the_flag() -> None:
    public = ProxyConfig("m", (), ("http://10.0.0.2:1",), "0.0.0.0", insecure=True)
    lines = proxy_banner(public, 8300)
    assert "http://0.0.0.0:8300/v1 (every interface: other hosts too)" in lines[0]
    assert "API key none" in lines[0]
    assert lines[1].startswith("WARNING") and "--api-key" in lines[1]
    assert not any("anyone on this host" in line for line in lines)
    keyed = ProxyConfig("m", (), ("http://x",), "0.0.0.0", api_key="k", insecure=True)
    lines = proxy_banner(keyed, 8300)
    assert len(lines) == 1 and "API key required" in lines[0] and "per api-key" in lines[0]
    local = proxy_banner(ProxyConfig("m", (), ("http://x",)), 8300)
    assert len(local) == 1 and "(this host only)" in local[0]


def test_reach_says_who_can_connect() -> None:
    assert reach("127.0.0.1") == reach("::1") == reach("localhost") == "this host only"
    assert "other hosts" in reach("0.0.0.0") and "other hosts" in reach("10.1.2.3")


@pytest.mark.slow
def test_max_tokens_beyond_the_context_is_a_400_naming_both(capfd) -> None:
    """Issue #21: max_tokens 2**62 was accepted and ran to the context end. Also the
    instance's banner: an --insecure instance bound to every interface does not say
    "anyone on this host". The proxy calls that instance unsigned, as it has no token."""
    dep = Deployment()
    srv = None
    try:
        open_cfg = small_instance(
            "decode", 1, kv_token_file=None, insecure=True, host="0.0.0.0", kv_host="127.0.0.1"
        )
        decode = dep.start_instance("open", open_cfg)
        dep.wait_healthy(900, say=None)
        banner = capfd.readouterr().err
        assert "internal API on http://0.0.0.0:" in banner and "other hosts too" in banner
        assert "anyone who can reach 0.0.0.0 may call the internal API" in banner
        assert "anyone on this host may call" not in banner
        backend = DisaggBackend([], [decode.url], "smollm2-135m", token=None)
        srv = ServerThread(make_app(backend)).start()
        body = {"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 2**62}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert f"max_tokens={2**62}" in message and "prompt has 6 tokens" in message
        assert "max_model_len=4096" in message and "at most max_tokens=4090" in message
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4096}
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat, timeout=300)
        assert r.status_code == 400 and "max_tokens=4096" in r.json()["error"]["message"]
        ok = httpx.post(f"{srv.url}/v1/completions", json={**body, "max_tokens": 2}, timeout=300)
        assert ok.status_code == 200
    finally:
        if srv is not None:
            srv.stop()
        dep.stop()
