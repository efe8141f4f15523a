"""Prefix-cache isolation (issue #21, item 1): a caller cannot learn from a cache hit what
another one sent. The proxy's policy and `cache_salt` (fast, over a test backend), then
the attack itself against real prefill and decode instances: a victim's secret prompt,
an attacker with another key or salt, and no `cached_tokens` jump for the right guess."""

from __future__ import annotations

import httpx
import pytest

from kvbridge.errors import ConfigError
from kvbridge.serve.api_keys import ApiKeys
from kvbridge.serve.config import ProxyConfig
from kvbridge.serve.disagg_backend import DisaggBackend
from kvbridge.serve.http_server import ServerThread
from kvbridge.serve.isolation import PrefixCacheIsolation
from kvbridge.serve.proxy import make_app
from tests.serve.fake_backend import FakeBackend
from tests.serve.helpers import TOKEN

KEYS = ["sk-victim", "sk-attacker"]


def _post(url: str, body: dict, key: str | None = None, path: str = "/v1/completions"):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=300)


@pytest.fixture
def proxy():
    """A proxy over a test backend with two API keys (isolation per key, the default)."""
    backend = FakeBackend()
    srv = ServerThread(make_app(backend, api_key=KEYS)).start()
    yield srv.url, backend
    srv.stop()


def test_each_api_key_and_each_cache_salt_is_a_namespace_of_its_own(proxy) -> None:
    url, backend = proxy
    body = {"prompt": "hi", "max_tokens": 1}
    for key in (KEYS[0], KEYS[0], KEYS[1]):
        assert _post(url, body, key).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert _post(url, chat, KEYS[0], "/v1/chat/completions").status_code == 200
    assert _post(url, {**body, "cache_salt": "doc-1"}, KEYS[0]).status_code == 200
    salts = [gen.cache_salt for gen in backend.seen]
    assert salts[0] == salts[1] == salts[3] and salts[0] is not None  # one key, one space
    assert len({salts[0], salts[2], salts[4]}) == 3  # another key, or a salt: another
    # the instances see a digest, never the key
    assert not any(key in str(salt) for key in KEYS for salt in salts)


def test_cache_salt_is_vllms_parameter_on_both_apis() -> None:
    backend = FakeBackend()
    srv = ServerThread(make_app(backend)).start()  # no key: isolation none
    try:
        body = {"prompt": "hi", "max_tokens": 1}
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert _post(srv.url, body).status_code == 200
        for b, path in ((body, "/v1/completions"), (chat, "/v1/chat/completions")):
            for salt in ("a", "a", "b"):
                assert _post(srv.url, {**b, "cache_salt": salt}, path=path).status_code == 200
        salts = [gen.cache_salt for gen in backend.seen]
        assert salts[0] is None  # no salt, no policy: the shared namespace
        assert salts[1] == salts[2] == salts[4] == salts[5] != salts[3] == salts[6]
        r = _post(srv.url, {**body, "cache_salt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
        r = _post(srv.url, {**body, "cache_salt": 7})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
        assert len(backend.seen) == 7
    finally:
        srv.stop()


def test_isolation_per_user_needs_the_user_field() -> None:
    backend = FakeBackend()
    srv = ServerThread(make_app(backend, isolation="user")).start()
    try:
        body = {"prompt": "hi", "max_tokens": 1}
        r = _post(srv.url, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "user"
        assert "--prefix-cache-isolation user" in r.json()["error"]["message"]
        for user in ("alice", "alice", "bob"):
            assert _post(srv.url, {**body, "user": user}).status_code == 200
        salts = [gen.cache_salt for gen in backend.seen]
        assert salts[0] == salts[1] != salts[2]
    finally:
        srv.stop()


def test_isolation_per_api_key_needs_a_key() -> None:
    with pytest.raises(ConfigError, match="api-key needs --api-key"):
        ProxyConfig("m", (), ("http://127.0.0.1:1",), prefix_cache_isolation="api-key")  # type: ignore[arg-type]
    with_key = ProxyConfig("m", (), ("http://127.0.0.1:1",), api_key="k")
    assert with_key.prefix_cache_isolation is PrefixCacheIsolation.API_KEY
    without = ProxyConfig("m", (), ("http://127.0.0.1:1",))
    assert without.prefix_cache_isolation is PrefixCacheIsolation.NONE


def test_hide_cached_tokens_leaves_the_cache_figures_out() -> None:
    backend = FakeBackend()
    srv = ServerThread(make_app(backend, hide_cached_tokens=True)).start()
    try:
        out = _post(srv.url, {"prompt": "hi", "max_tokens": 2}).json()
        assert "prompt_tokens_details" not in out["usage"] and "kvbridge_stages" not in out
        assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 2
        body = {"prompt": "hi", "max_tokens": 2, "stream": True}
        body["stream_options"] = {"include_usage": True}
        text = _post(srv.url, body).text
        assert '"usage"' in text and "cached_tokens" not in text
    finally:
        srv.stop()


# ---- the attack, against real instances ------------------------------------------------

#: The victim's prompt: a shared preamble, then the secret. The attacker knows the
#: preamble and guesses the secret; with a shared cache the right guess hits the blocks
#: holding the secret (issue #21: 32 of 40 tokens cached against 16 for wrong guesses).
PREAMBLE = "Internal memo for the finance team only. The vault combination is "
SECRET = "4812 9377 1650 2284, do not share it."
WRONG = ["1111 2222 3333 4444", "9090 8080 7070 6060", "5555 1234 9876 0000"]


def _cached(url: str, prompt: str, key: str | None, **extra: object) -> int:
    r = _post(url, {"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}, key)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def _attack(url: str, tag: str, key: str | None, **extra: object) -> tuple[int, list[int]]:
    """The attacker's cached_tokens for the right guess, and for two wrong ones (after a
    first wrong guess warmed the attacker's own cache with the preamble)."""
    guesses = [tag + PREAMBLE + w + ", do not share it." for w in WRONG]
    wrong = [_cached(url, guess, key, **extra) for guess in guesses]
    return _cached(url, tag + PREAMBLE + SECRET, key, **extra), wrong[1:]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["api-key", "cache_salt", "shared"])
def test_an_attacker_learns_nothing_from_the_victims_cached_prompt(instances, policy) -> None:
    """Per API key (the default with keys) and per cache_salt, the right guess looks
    exactly like a wrong one; "shared" (no key, no salt: policy none) is the control
    that shows the oracle the others close (the right guess hits the secret's blocks)."""
    keys: list[str | None] = list(KEYS) if policy == "api-key" else [None, None]
    salts: list[dict[str, str]] = [{}, {}]
    if policy == "cache_salt":
        salts = [{"cache_salt": "victim"}, {"cache_salt": "attacker"}]
    backend = DisaggBackend(
        [instances[("prefill", 1)]], [instances[("decode", 1)]], "smollm2-135m", token=TOKEN
    )
    api_keys = KEYS if policy == "api-key" else None
    srv = ServerThread(make_app(backend, api_key=api_keys)).start()
    tag = f"[{policy}] "
    try:
        victim = tag + PREAMBLE + SECRET
        assert _cached(srv.url, victim, keys[0], **salts[0]) == 0
        # the victim's own namespace still caches: its repeat hits
        assert _cached(srv.url, victim, keys[0], **salts[0]) >= 32
        right, wrong = _attack(srv.url, tag, keys[1], **salts[1])
        assert wrong[0] == wrong[1] > 0, wrong  # the attacker's own preamble hits
        if policy == "shared":
            assert right > wrong[0], (right, wrong)  # the oracle: the secret's blocks hit
        else:
            assert right == wrong[0], (right, wrong)  # the victim's blocks are not found
    finally:
        srv.stop()


@pytest.mark.slow
@pytest.mark.parametrize("keys", ["tenants", "self-declared"])
def test_a_tenant_naming_another_tenants_user_gets_nothing_of_its_cache(instances, keys) -> None:
    """Issue #46: under `user` isolation a caller who claimed `"user": "alice"` got
    alice's memo from the cache. With API keys of tenants the namespace is the key's
    tenant and the user: tenant B naming tenant A's alice gets 0 cached tokens for the
    very memo, while A's own alice still hits. "self-declared" (no keys: what the
    start-up warning is about) is the control that shows the claim working."""
    api_keys = ApiKeys([("tenant-a", "sk-a"), ("tenant-b", "sk-b")])
    victim, claimer = ("sk-a", "sk-b") if keys == "tenants" else (None, None)
    backend = DisaggBackend(
        [instances[("prefill", 1)]], [instances[("decode", 1)]], "smollm2-135m", token=TOKEN
    )
    app = make_app(backend, api_key=api_keys if keys == "tenants" else None, isolation="user")
    srv = ServerThread(app).start()
    memo = f"[{keys}] " + PREAMBLE + SECRET
    try:
        assert _cached(srv.url, memo, victim, user="alice") == 0
        claimed = _cached(srv.url, memo, claimer, user="alice")
        if keys == "tenants":
            assert claimed == 0
            assert _cached(srv.url, memo, victim, user="alice") >= 32  # alice's own hit
        else:
            assert claimed >= 32  # the claim alone opened alice's cache
    finally:
        srv.stop()
