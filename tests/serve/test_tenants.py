"""Authenticated tenants (issue #46, item 3): the proxy takes the API keys of several
tenants (`--api-key-file`, read at start-up and on SIGHUP), and `user` isolation is
bound to the tenant of the key, so one tenant naming another's user shares nothing with
it. The key file's format, the namespaces over a test backend, what the banner and
/health say, then the reload of a running `kvbridge serve --role proxy`. The attack
against real instances is in test_cache_isolation.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvbridge.connector import free_port
from kvbridge.errors import ConfigError
from kvbridge.serve.api_keys import ApiKeys, parse_key_file
from kvbridge.serve.config import DeploymentConfig, ProxyConfig
from kvbridge.serve.http_server import ServerThread
from kvbridge.serve.isolation import PrefixCacheIsolation
from kvbridge.serve.proxy import make_app
from kvbridge.serve.proxy_main import proxy_banner
from tests.serve.fake_backend import FakeBackend
from tests.serve.helpers import small_instance

KEY_FILE = """\
# tenant:key, one per line
acme: sk-acme-1
acme:sk-acme-2
globex:sk-globex:with-a-colon

"""
DECODE = ("http://127.0.0.1:1",)


def test_a_key_file_names_each_keys_tenant() -> None:
    pairs = parse_key_file(KEY_FILE, "F")
    assert pairs == [
        ("acme", "sk-acme-1"),
        ("acme", "sk-acme-2"),
        ("globex", "sk-globex:with-a-colon"),
    ]
    keys = ApiKeys(pairs)
    assert keys.tenant_of("sk-acme-2") == "acme" and keys.tenant_of(b"sk-acme-1") == "acme"
    assert keys.tenant_of("sk-globex:with-a-colon") == "globex"
    assert keys.tenant_of("sk-acme") is None and keys.tenant_of(None) is None
    assert keys.table.tenants == {"acme", "globex"} and len(keys.table) == 3


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("acme:k1\nglobex sk-secret-2\n", "F line 2 is not 'tenant:key'"),
        ("acme:k1\n:sk-secret-2\n", "F line 2 is not 'tenant:key'"),
        ("acme:k1\nglobex:\n", "F line 2 is not 'tenant:key'"),
        (
            "acme:sk-secret-2\n\nglobex:sk-secret-2\n",
            "line 3 gives tenant 'globex' the key of line 1",
        ),
        ("# nobody\n\n", "F holds no 'tenant:key' line"),
    ],
)
def test_a_key_file_that_does_not_parse_is_refused_naming_the_line(text, words) -> None:
    with pytest.raises(ConfigError, match=words) as exc:
        parse_key_file(text, "F")
    assert "sk-secret" not in str(exc.value)  # no key in a message


def _post(url: str, key: str | None, user: str | None = None, **body: object) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    payload = {"prompt": "hi", "max_tokens": 1, **body}
    if user is not None:
        payload["user"] = user
    return httpx.post(f"{url}/v1/completions", json=payload, headers=headers, timeout=30)


def test_user_isolation_is_the_keys_tenant_and_the_user() -> None:
    backend = FakeBackend()
    keys = ApiKeys(parse_key_file(KEY_FILE, "F"))
    srv = ServerThread(make_app(backend, api_key=keys, isolation="user")).start()
    try:
        calls = [
            ("sk-acme-1", "alice"),
            ("sk-acme-2", "alice"),  # another key of the same tenant: the same namespace
            ("sk-globex:with-a-colon", "alice"),  # another tenant naming acme's user
            ("sk-acme-1", "bob"),
        ]
        for key, user in calls:
            assert _post(srv.url, key, user).status_code == 200
        salts = [gen.cache_salt for gen in backend.seen]
        assert salts[0] == salts[1] and len({salts[0], salts[2], salts[3]}) == 3
        assert _post(srv.url, "sk-unknown", "alice").status_code == 401
        assert _post(srv.url, "sk-acme-1").status_code == 400  # user still required
        health = httpx.get(f"{srv.url}/health", timeout=30).json()
        assert health["prefix_cache_isolation"] == {
            "policy": "user",
            "shared_by": "the API key's tenant and the request's user",
            "authenticated": True,
        }
    finally:
        srv.stop()


def test_without_api_keys_user_isolation_says_the_user_is_self_declared(tmp_path) -> None:
    backend = FakeBackend()
    srv = ServerThread(make_app(backend, isolation="user")).start()
    try:
        health = httpx.get(f"{srv.url}/health", timeout=30).json()["prefix_cache_isolation"]
        assert health["policy"] == "user" and health["authenticated"] is False
        assert "as the client declares it" in health["shared_by"]
    finally:
        srv.stop()
    cfg = ProxyConfig("m", (), DECODE, prefix_cache_isolation=PrefixCacheIsolation.USER)
    lines = proxy_banner(cfg, 8300)
    assert "prefix cache shared per user" in lines[0]
    warning = [line for line in lines if "self-declared" in line]
    assert len(warning) == 1 and warning[0].startswith("WARNING")
    assert "--api-key-file" in warning[0]
    key_file = tmp_path / "keys"
    key_file.write_text(KEY_FILE)
    keyed = ProxyConfig(
        "m",
        (),
        DECODE,
        api_key_file=str(key_file),
        prefix_cache_isolation=PrefixCacheIsolation.USER,
    )
    lines = proxy_banner(keyed, 8300)
    assert len(lines) == 1 and "self-declared" not in lines[0]
    assert f"API keys from {key_file}: 3 keys of 2 tenants" in lines[0]
    assert "per user (the API key's tenant and the request's user)" in lines[0]


def test_a_key_file_is_checked_before_anything_starts(tmp_path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(KEY_FILE)
    cfg = ProxyConfig("m", (), DECODE, api_key_file=str(key_file))
    assert cfg.prefix_cache_isolation is PrefixCacheIsolation.API_KEY  # keys: per key
    assert cfg.api_keys().tenant_of("sk-acme-1") == "acme"
    both = ProxyConfig("m", (), DECODE, api_key="sk-solo", api_key_file=str(key_file))
    assert both.api_keys().tenant_of("sk-solo") == "default"
    key_file.write_text("acme sk-acme-1\n")
    with pytest.raises(ConfigError, match="line 1 is not 'tenant:key'"):
        ProxyConfig("m", (), DECODE, api_key_file=str(key_file))
    with pytest.raises(ConfigError, match="cannot read it"):
        ProxyConfig("m", (), DECODE, api_key_file=str(tmp_path / "missing"))
    instance = small_instance("decode", 1)
    with pytest.raises(ConfigError, match="line 1 is not 'tenant:key'"):
        DeploymentConfig(instance, instance, api_key_file=str(key_file))


def _wait_for(url: str, key: str, status: int) -> int:
    """The status of /v1/models for `key`, once it is `status` (at most 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            got = httpx.get(
                f"{url}/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=10
            ).status_code
        except httpx.TransportError:
            got = 0  # not listening yet
        if got == status or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def test_a_running_proxy_reads_its_key_file_again_on_sighup(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("acme:sk-old\n")
    port = free_port("127.0.0.1")
    log = tmp_path / "stderr"
    cmd = [sys.executable, "-m", "kvbridge.cli.main", "serve", "--role", "proxy"]
    cmd += ["--decode", DECODE[0], "--port", str(port), "--api-key-file", str(key_file)]
    cmd += ["--prefix-cache-isolation", "user"]
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stderr=err, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        assert _wait_for(url, "sk-old", 200) == 200, log.read_text()
        assert _wait_for(url, "sk-new", 401) == 401
        key_file.write_text("acme:sk-new\nglobex:sk-globex\n")
        proc.send_signal(signal.SIGHUP)
        assert _wait_for(url, "sk-new", 200) == 200, log.read_text()
        assert _wait_for(url, "sk-globex", 200) == 200
        assert _wait_for(url, "sk-old", 401) == 401  # a key taken out is refused at once
        key_file.write_text("this line has no colon\n")
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while "stay as they were" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        text = log.read_text()
        assert "line 1 is not 'tenant:key'" in text and "stay as they were" in text
        assert _wait_for(url, "sk-new", 200) == 200  # the keys in force stayed
        assert proc.poll() is None
        assert f"API keys from {key_file}: 1 key of 1 tenant;" in text
        assert "per user (the API key's tenant and the request's user)" in text
        assert f"SIGHUP: in force from {key_file}: 2 keys of 2 tenants" in text
        assert "SIGHUP reloads the API keys" in text
    finally:
        proc.terminate()
        proc.wait(30)
