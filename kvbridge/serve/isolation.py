"""Prefix-cache isolation: which requests may share cached KV blocks.

A prefix cache that answers every caller is an oracle: after a victim sent a prompt
with a secret in it, another caller who sends candidate texts sees
`usage.prompt_tokens_details.cached_tokens` (and the time to the first token) jump for
the right guess. vLLM's answer is the request parameter `cache_salt`: the salt enters
the hash of a request's first block (`BlockManager.root`), so blocks are shared only
between requests with the same salt. kvbridge takes the same parameter on
/v1/completions and /v1/chat/completions and, by the proxy's policy
(`--prefix-cache-isolation`), also salts by who asks:

    none      the client's `cache_salt` alone (no salt: the shared namespace)
    api-key   the API key the request presented, and its `cache_salt` (the default when
              the proxy has API keys)
    user      the tenant of the request's API key (`api_keys.py`) and its OpenAI `user`
              field, and its `cache_salt`; a request without `user` is refused (400
              naming it). Without API keys `user` is whatever the client declares:
              anyone who names another's user shares that user's cache (the proxy warns
              at start-up, `self_declared_warning`)

The proxy sends the instances only a digest of the namespace (never the key itself),
in `GenerateRequest.cache_salt`; every instance salts its block hashes with it, in
routing lookups too, so no instance shares a block across namespaces.
"""

from __future__ import annotations

import enum
import hashlib
import json

from kvbridge.errors import ConfigError


class PrefixCacheIsolation(enum.Enum):
    NONE = "none"
    API_KEY = "api-key"
    USER = "user"

    @classmethod
    def resolve(
        cls, value: PrefixCacheIsolation | str | None, has_api_key: bool
    ) -> PrefixCacheIsolation:
        """The policy in force: `value`, or by default per API key when the proxy has
        one, else none. ConfigError for a value that is not a policy, or per API key
        without a key."""
        if value is None:
            return cls.API_KEY if has_api_key else cls.NONE
        try:
            policy = cls(value)
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise ConfigError(f"--prefix-cache-isolation {value!r} is not one of {names}") from None
        if policy is cls.API_KEY and not has_api_key:
            raise ConfigError(
                "--prefix-cache-isolation api-key needs --api-key (or KVBRIDGE_API_KEY) or "
                "--api-key-file: without keys every caller is the same; use 'user' or 'none'"
            )
        return policy

    def namespace_text(self, has_api_key: bool) -> str:
        """Who shares cached prefixes under this policy, in words (the banner, /health)."""
        if self is PrefixCacheIsolation.API_KEY:
            return "the API key"
        if self is PrefixCacheIsolation.USER:
            if has_api_key:
                return "the API key's tenant and the request's user"
            return "the request's user as the client declares it (not authenticated)"
        return "everyone (only a request's cache_salt narrows it)"


def self_declared_warning(policy: PrefixCacheIsolation, has_api_key: bool) -> str | None:
    """The start-up warning of `user` isolation without API keys; None otherwise."""
    if policy is not PrefixCacheIsolation.USER or has_api_key:
        return None
    return (
        "WARNING: --prefix-cache-isolation user without API keys: the 'user' field is "
        "self-declared, so a caller who names another's user shares that user's cached "
        "prompts (and can probe them through cached_tokens); set --api-key-file (one "
        "tenant:key per line) to make the namespace the key's tenant and the user"
    )


class IsolationError(ValueError):
    """A request the policy cannot place in a namespace; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def namespace(
    policy: PrefixCacheIsolation,
    *,
    cache_salt: str | None,
    api_key: str | None = None,
    user: str | None = None,
    tenant: str | None = None,
) -> str | None:
    """The salt the instances get for one request: a digest of who asks (by `policy`:
    the `api_key`, or the `tenant` of the key and the `user`) and the client's
    `cache_salt`; None for the shared namespace (policy none, no salt). IsolationError
    when the policy needs what the request lacks."""
    who: str | list[str] | None = None
    if policy is PrefixCacheIsolation.API_KEY:
        if api_key is None:
            raise IsolationError("the request presented no API key", "authorization")
        who = api_key
    elif policy is PrefixCacheIsolation.USER:
        if not user:
            raise IsolationError(
                "user: with --prefix-cache-isolation user every request must name its "
                'user (the OpenAI "user" field): requests of one user share cached '
                "prompts, no one else's",
                "user",
            )
        who = user if tenant is None else [tenant, user]
    if who is None and cache_salt is None:
        return None
    text = json.dumps([policy.value, who, cache_salt], ensure_ascii=True)
    return hashlib.blake2b(text.encode(), digest_size=16, person=b"kvbridge-ns").hexdigest()
