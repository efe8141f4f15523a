"""HTTPS of the internal API (issue #21): the deployment CA derived from the token, an
instance's certificate, what the proxy trusts, and the refusals at start-up."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from kvbridge.errors import ConfigError
from kvbridge.serve import tls
from kvbridge.serve.config import InstanceConfig, ProxyConfig, Role
from kvbridge.serve.http_auth import RequireSignature, SignedRequests
from tests.serve.helpers import TOKEN, TOKEN_FILE


async def _hello(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    if scope["type"] != "http":
        return
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hello"})


@contextlib.contextmanager
def https_server(cert: str | None = None, key: str | None = None) -> Iterator[str]:
    """A signed-calls app over HTTPS on loopback, as an instance loads its certificate
    (the token's, unless `cert` and `key` are given); its https:// URL."""
    with tls.server_files(TOKEN, cert, key, ["127.0.0.1"]) as (certfile, keyfile):
        config = uvicorn.Config(
            RequireSignature(_hello, TOKEN, "tls-test"),
            host="127.0.0.1",
            port=0,
            log_level="warning",
            ssl_certfile=certfile,
            ssl_keyfile=keyfile,
        )
        config.load()
    if cert is None:
        assert not os.path.exists(certfile) and not os.path.exists(keyfile)  # key gone
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    try:
        yield f"https://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_every_holder_of_the_token_derives_the_same_ca_and_nobody_else_does() -> None:
    pem = tls.deployment_ca_pem(TOKEN)
    tls._deployment_ca.cache_clear()  # derived again, not remembered
    assert tls.deployment_ca_pem(TOKEN) == pem
    assert tls.deployment_ca_pem(secrets.token_hex(32).encode()) != pem
    assert TOKEN not in pem and TOKEN.hex().encode() not in pem


def test_the_proxy_reaches_an_instance_certified_by_the_token_and_nothing_else_does() -> None:
    with https_server() as url:
        got = httpx.get(f"{url}/x", auth=SignedRequests(TOKEN), verify=tls.client_context(TOKEN))
        assert got.status_code == 200 and got.text == "hello"
        other = tls.client_context(secrets.token_hex(32).encode())
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/x", verify=other)  # another deployment's proxy
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/x")  # the system's CAs know nothing of it
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.get(url.replace("https://", "http://") + "/x")  # no plain HTTP


def test_an_operators_certificate_is_checked_against_its_ca_with_host_names(
    tmp_path: Path,
) -> None:
    """--tls-cert/--tls-key on the instance, --tls-ca on the proxy: the usual PKI (here a
    CA of another token stands in for the operator's)."""
    operator = secrets.token_hex(32).encode()
    cert_pem, key_pem = tls.issue(operator, ["127.0.0.1"])
    cert, key, ca = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    cert.write_bytes(cert_pem)
    key.write_bytes(key_pem)
    ca.write_bytes(tls.deployment_ca_pem(operator))
    verify = tls.client_context(TOKEN, str(ca))
    assert verify.check_hostname
    with https_server(str(cert), str(key)) as url:
        assert httpx.get(f"{url}/health", verify=verify).status_code == 200
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/health", verify=tls.client_context(TOKEN))
    assert cert.exists() and key.exists()  # the operator's files are the operator's
    cert_pem, key_pem = tls.issue(operator, ["10.213.0.9"])  # for another address
    cert.write_bytes(cert_pem)
    key.write_bytes(key_pem)
    with (
        https_server(str(cert), str(key)) as url,
        pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"),
    ):
        httpx.get(f"{url}/health", verify=verify)


def test_an_instance_serves_https_where_other_hosts_reach_it_and_says_so(
    tmp_path: Path,
) -> None:
    def instance(**fields: object) -> InstanceConfig:
        return InstanceConfig(Role.DECODE, 1, kv_token_file=TOKEN_FILE, **fields)  # type: ignore[arg-type]

    assert instance().scheme == "http"  # loopback stays plain
    assert instance(host="10.213.0.9").scheme == "https"
    assert instance(host="0.0.0.0").scheme == "https"
    open_ = InstanceConfig(Role.DECODE, 1, host="10.213.0.9", insecure=True)
    assert open_.scheme == "http"  # no token, no certificate: --insecure said so
    cert_pem, key_pem = tls.issue(TOKEN, ["127.0.0.1"])
    (tmp_path / "c.pem").write_bytes(cert_pem)
    (tmp_path / "k.pem").write_bytes(key_pem)
    given = instance(tls_cert=str(tmp_path / "c.pem"), tls_key=str(tmp_path / "k.pem"))
    assert given.scheme == "https"  # on loopback too, when asked
    with pytest.raises(ConfigError, match="--tls-cert needs --tls-key"):
        instance(tls_cert=str(tmp_path / "c.pem"))
    with pytest.raises(ConfigError, match="--tls-key needs --tls-cert"):
        instance(tls_key=str(tmp_path / "k.pem"))
    with pytest.raises(ConfigError, match=r"--tls-cert .*k\.pem --tls-key .*c\.pem"):
        instance(tls_cert=str(tmp_path / "k.pem"), tls_key=str(tmp_path / "c.pem"))


def test_the_proxy_refuses_plain_http_to_an_instance_on_another_host(tmp_path: Path) -> None:
    def proxy(url: str, **fields: object) -> ProxyConfig:
        return ProxyConfig("m", (url,), (url,), kv_token_file=TOKEN_FILE, **fields)  # type: ignore[arg-type]

    proxy("http://127.0.0.1:8301")
    proxy("https://10.213.0.2:8301")
    with pytest.raises(ConfigError) as refused:
        proxy("http://10.213.0.2:8301")
    assert "--prefill http://10.213.0.2:8301" in str(refused.value)
    assert "use https://10.213.0.2:8301" in str(refused.value)
    with pytest.raises(
        ConfigError, match=re.escape("--prefill 10.213.0.2:8301: give an instance URL")
    ):
        proxy("10.213.0.2:8301")
    with pytest.raises(ConfigError, match=re.escape(f"--tls-ca {tmp_path}/none.pem: ")):
        proxy("https://10.213.0.2:8301", tls_ca=str(tmp_path / "none.pem"))
    # without a token the deployment is --insecure by choice: plain HTTP stays possible
    ProxyConfig("m", ("http://10.213.0.2:8301",), ("http://10.213.0.3:8302",))
