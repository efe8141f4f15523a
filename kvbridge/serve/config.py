"""Typed configuration of serving: one instance, the proxy, a whole deployment.

The CLI (`kvbridge serve`, `kvbridge demo`) builds these from its flags; everything
below it takes them, never an `argparse.Namespace`. A deployment starts each instance
as a child process (`python -m kvbridge.serve.instance_main CONFIG.json`) and hands it
its whole `InstanceConfig` as one JSON document (`to_json`/`from_json`, msgspec): the
child decodes the very object, never a command line rebuilt from it.
"""

from __future__ import annotations

import enum
import math
import ssl
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kvbridge.connector import (
    FanOut,
    Integrity,
    KVExport,
    KVLoadFailure,
    TransferConfig,
    is_loopback,
    load_token,
)
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.cpu_share import COMPUTE_NICE
from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.plan.layout import DEFAULT_BLOCK_SIZE, DEFAULT_LAYOUT, CacheLayout
from kvbridge.serve.api_keys import DEFAULT_TENANT, ApiKeys
from kvbridge.serve.body_limit import DEFAULT_MAX_BODY_MB, mib_to_bytes
from kvbridge.serve.isolation import PrefixCacheIsolation
from kvbridge.settings import DEFAULT_CLAIM_S, DEFAULT_MODEL, carried, same_as, setting, setting_of

if TYPE_CHECKING:
    from kvbridge.connector import ConnectorRole, Credential


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class Engine(enum.Enum):
    """What runs the instances behind a proxy: kvbridge's reference engine (its own
    instances, `kvbridge serve --role prefill|decode`) or vLLM with a KV connector
    (vLLM's two-step P/D request, `vllm_backend.py`)."""

    KVBRIDGE = "kvbridge"
    VLLM = "vllm"


#: Where `kvbridge serve` and the proxy find the API key when --api-key is not given.
API_KEY_ENV = "KVBRIDGE_API_KEY"
#: Where `load_token` finds the shared secret when no file is given (TransferConfig.token).
_TOKEN_ENV = setting_of(TransferConfig, "token").env

#: Slack between a pull capability's expiry and the release of its unclaimed blocks:
#: covers clocks that differ between hosts and the moment between exposing the blocks
#: and issuing the capability.
CLAIM_MARGIN_S = 5.0


def _check_body_limit(max_body_mb: float) -> None:
    if not (math.isfinite(max_body_mb) and mib_to_bytes(max_body_mb) >= 1024):
        raise ConfigError(
            f"--max-body-mb {max_body_mb} must be a finite size of at least 1 KiB "
            f"(0.001); the default is {DEFAULT_MAX_BODY_MB:g}"
        )


def _check_exposure(host: str, token: bytes | None, insecure: bool) -> None:
    """Refuse an HTTP server other hosts can reach that nobody authenticates."""
    if token is None and not insecure and not is_loopback(host):
        raise ConfigError(
            f"--host {host} is reachable from other hosts, and without a shared token "
            "anyone there could call the internal API: set --kv-token-file (or "
            "KVBRIDGE_TRANSFER_TOKEN), or pass --insecure to accept that"
        )


def _check_instance_url(flag: str, url: str) -> None:
    """Refuse plain HTTP to an instance on another host: the calls carry prompts, and
    such an instance serves HTTPS (`tls.py`)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{flag} {url}: give an instance URL such as https://HOST:PORT")
    if parts.scheme == "http" and not is_loopback(parts.hostname):
        raise ConfigError(
            f"{flag} {url}: an instance on another host serves its internal API over "
            "HTTPS (the calls carry prompts; it is certified by the shared token or by "
            f"--tls-cert): use https://{parts.netloc}{parts.path}"
        )


@dataclass(frozen=True)
class InstanceConfig:
    """One prefill or decode instance: its engine, its HTTP server, its KV runtime.

    Each field after the first six is a setting (`kvbridge.settings`): its default, help
    and `kvbridge serve` flag are declared here, the KV runtime's (lease_s, kv_integrity,
    ...) in `TransferConfig` and carried here with `same_as`. role, tp_size, block_size
    cache_layout and kv_cache_dtype have a flag per role instead (--prefill-tp, --tp,
    --decode-kv-cache-dtype, ...), port and
    port_file are given by whoever launches the instance.
    """

    role: Role
    tp_size: int
    block_size: int = DEFAULT_BLOCK_SIZE
    cache_layout: CacheLayout = field(default_factory=lambda: CacheLayout.parse(DEFAULT_LAYOUT))
    kv_cache_dtype: str = EngineConfig.kv_dtype  # the cache's; a decode converts what it pulls
    port: int = 0  # 0: a free port, reported to `port_file` (a launched instance)
    port_file: str | None = None  # where a launched instance reports its port
    # the engine
    model: str = setting(
        DEFAULT_MODEL, flag="--model", help="a .gguf file, an HF directory, or a known name"
    )
    kv_cache_mb: int = setting(
        EngineConfig.kv_cache_mb, flag="--kv-cache-mb", help="KV cache per worker, in MiB"
    )
    enable_prefix_caching: bool = setting(
        True,
        flag="--no-prefix-caching",
        help="turn automatic prefix caching off: every prompt is computed (prefill) and "
        "pulled (decode) whole",
    )
    max_queued_requests: int | None = setting(
        None,
        flag="--max-queued-requests",
        metavar="N",
        default_text=f"twice the engine's max_num_seqs ({EngineConfig.max_num_seqs}), at "
        "most one per two KV blocks",
        help="the most requests an instance holds at once (queued, running, streaming, and "
        "places reserved by the proxy); more are refused at once with 503 and Retry-After",
    )
    cpu_priority: bool = setting(
        True,
        flag="--cpu-priority",
        help="on cores a prefill and a decode instance share, KV transfers first, then "
        "prefills, then decodes: the compute threads' nice value is raised by "
        f"{COMPUTE_NICE['prefill']} in a prefill instance and by {COMPUTE_NICE['decode']} "
        "in a decode instance (to at most 19), the KV transfer threads stay at the "
        "priority the instance was started with (as the colocated engine runs a prompt's "
        "prefill before its next decode step); alone on its cores an instance runs as "
        "fast",
    )
    # the HTTP server
    host: str = setting("127.0.0.1", flag="--host", help="address the HTTP server binds")
    max_body_mb: float = setting(
        DEFAULT_MAX_BODY_MB,
        flag="--max-body-mb",
        help="largest request body the proxy and the instances accept, in MiB; a larger "
        "one is refused with 413",
    )
    insecure: bool = setting(
        False,
        flag="--insecure",
        help="allow an HTTP --host other hosts can reach without a shared token",
    )
    tls_cert: str | None = setting(
        None,
        flag="--tls-cert",
        metavar="PEM",
        help="certificate of an instance's internal API (HTTPS), with --tls-key. "
        "Without one, an instance whose --host other hosts can reach makes its own, "
        "certified by the shared token (the proxy trusts it); on loopback the API stays "
        "plain HTTP",
    )
    tls_key: str | None = setting(
        None, flag="--tls-key", metavar="PEM", help="the --tls-cert's private key"
    )
    # the KV runtime
    kv_host: str | None = setting(
        None,
        flag="--kv-host",
        default_text="--host",
        help="address of the KV side channel; other hosts reach the prefill workers there",
    )
    kv_port: int = same_as(TransferConfig, "base_port")
    kv_advertise_host: str | None = same_as(TransferConfig, "advertise_host")
    kv_token_file: str | None = setting(
        None,
        flag="--auth-token-file",
        aliases=("--kv-token-file",),
        metavar="FILE",
        env=_TOKEN_ENV,
        help="file holding the shared secret of the deployment (else "
        f"{_TOKEN_ENV[0]}, else the file named by {_TOKEN_ENV[1]}): encrypts and "
        "authenticates the KV side channel, signs every proxy -> instance call. Needed for "
        "any address other than loopback. `kvbridge serve` (all roles) makes one up for its "
        "run when none is given",
    )
    credential_file: str | None = setting(
        None,
        flag="--credential-file",
        metavar="FILE",
        help="this instance's role credential (mode 600), made with `kvbridge credential "
        "--root ROOT --role ROLE --name NAME --out FILE`: a prefill instance signs its pull "
        "capabilities with it, a decode instance takes only capabilities of prefill "
        "instances the same root enrolled. Needed with a shared token; `kvbridge serve` "
        "(all roles) makes them for its instances",
    )
    kv_load_failure: KVLoadFailure = setting(
        KVLoadFailure.RECOMPUTE,
        flag="--kv-load-failure",
        help="when a KV pull fails: recompute the prompt on the decode instance "
        "(recompute) or answer an error (fail)",
    )
    claim_s: float = setting(
        DEFAULT_CLAIM_S,
        flag="--kv-claim-s",
        help="a decode instance must take a prefilled request's KV within this long (its "
        "pull capability expires); blocks nobody took are freed after this plus "
        f"--transfer-timeout-s and {CLAIM_MARGIN_S:g} s",
    )
    lease_s: float = same_as(TransferConfig, "lease_s")
    transfer_timeout_s: float = same_as(TransferConfig, "transfer_timeout_s")
    liveness_timeout_s: float = same_as(TransferConfig, "liveness_timeout_s")
    handshake_timeout_s: float = same_as(TransferConfig, "handshake_timeout_s")
    kv_integrity: Integrity = same_as(TransferConfig, "integrity")
    kv_export: KVExport = same_as(TransferConfig, "kv_export")
    kv_fan_out: FanOut = same_as(TransferConfig, "fan_out")

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_layout", CacheLayout.parse(self.cache_layout))
        try:  # the engine's words for a dtype it does not keep, at start-up
            kv_dtype = EngineConfig(kv_dtype=self.kv_cache_dtype).kv_dtype
        except KVBridgeError as exc:
            raise ConfigError(f"--kv-cache-dtype: {exc}") from None
        object.__setattr__(self, "kv_cache_dtype", kv_dtype)
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port {self.port} must be in [0, 65536); 0 picks a free port")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ConfigError(
                f"--max-queued-requests {self.max_queued_requests} must be at least 1; "
                "leave it out to derive it from the KV cache"
            )
        if not (math.isfinite(self.claim_s) and 0 < self.claim_s <= self.lease_s):
            raise ConfigError(
                f"--kv-claim-s {self.claim_s} must be a positive number of seconds no "
                f"longer than --lease-s {self.lease_s:g}; the default is {InstanceConfig.claim_s:g}"
            )
        _check_body_limit(self.max_body_mb)
        _check_exposure(self.host, self.token(), self.insecure)
        from kvbridge.serve.tls import check_server_files

        check_server_files(self.tls_cert, self.tls_key)

    def token(self) -> bytes | None:
        """The shared secret (--kv-token-file, else the environment), or None."""
        return load_token(path=self.kv_token_file)

    @property
    def connector_role(self) -> ConnectorRole:
        from kvbridge.connector import ConnectorRole  # msgspec: not in the base install

        return ConnectorRole.PRODUCER if self.role is Role.PREFILL else ConnectorRole.CONSUMER

    def credential(self) -> Credential | None:
        """The role credential (--credential-file), or None."""
        if self.credential_file is None:
            return None
        from kvbridge.connector import Credential

        cred = Credential.load(self.credential_file, "--credential-file")
        cred.check_role(self.connector_role, "--credential-file")
        return cred

    @property
    def serves_tls(self) -> bool:
        """Whether the internal API is HTTPS: with the operator's certificate, or when
        other hosts can reach it and a token certifies it (loopback stays plain)."""
        if self.tls_cert is not None:
            return True
        return not is_loopback(self.host) and self.token() is not None

    @property
    def scheme(self) -> str:
        return "https" if self.serves_tls else "http"

    @property
    def max_body_bytes(self) -> int:
        return mib_to_bytes(self.max_body_mb)

    @property
    def exposure_lease_s(self) -> float:
        """How long a prefilled request's blocks stay pinned when nobody tells this
        instance anything: a pull may begin until its capability expires (`claim_s`),
        and a pull ends within the transfer timeout, so after both (and a margin) no
        decode worker can still be reading them; never longer than `lease_s`."""
        return min(self.lease_s, self.claim_s + self.transfer_timeout_s + CLAIM_MARGIN_S)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            tp_size=self.tp_size,
            block_size=self.block_size,
            cache_layout=self.cache_layout,
            kv_dtype=self.kv_cache_dtype,
            kv_cache_mb=self.kv_cache_mb,
            enable_prefix_caching=self.enable_prefix_caching,
            cpu_nice=COMPUTE_NICE[self.role.value] if self.cpu_priority else 0,
        )

    def transfer_config(self) -> TransferConfig:
        """The KV runtime's settings: those this config carries (`same_as`), its KV host
        and the shared secret (read from the file or the environment)."""
        carried_here = {t: getattr(self, i) for i, t in carried(InstanceConfig, TransferConfig)}
        return TransferConfig(host=self.kv_host or self.host, token=self.token(), **carried_here)

    def to_json(self) -> bytes:
        """This config as one JSON document (what a launched instance receives)."""
        import msgspec

        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes) -> InstanceConfig:
        """The config `to_json` wrote, checked again (`__post_init__`)."""
        import msgspec

        try:
            return msgspec.json.decode(data, type=cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"instance config: {exc}") from None


@dataclass(frozen=True)
class ProxyConfig:
    """The OpenAI-compatible proxy in front of prefill and decode instances.

    Its fields after the first three are settings (`kvbridge.settings`); those it shares
    with the instances are `InstanceConfig`'s (`same_as`)."""

    model: str
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    host: str = same_as(InstanceConfig, "host")
    port: int = setting(
        8300, flag="--port", help="HTTP port of the proxy, or of a single role (0: any free)"
    )
    kv_load_failure: KVLoadFailure = same_as(InstanceConfig, "kv_load_failure")
    max_body_mb: float = same_as(InstanceConfig, "max_body_mb")
    kv_token_file: str | None = same_as(InstanceConfig, "kv_token_file")
    api_key: str | None = setting(
        None,
        flag="--api-key",
        env=(API_KEY_ENV,),
        help="require 'Authorization: Bearer KEY' on the OpenAI API (/v1/...), like vLLM's "
        f"--api-key (or set {API_KEY_ENV}); the key of tenant '{DEFAULT_TENANT}'",
    )
    api_key_file: str | None = setting(
        None,
        flag="--api-key-file",
        metavar="FILE",
        help="the API keys of several tenants, one 'tenant:key' per line (# comments): "
        "each key is accepted as --api-key's is, and names its tenant, which "
        "--prefix-cache-isolation user adds to the user; read at start-up and again on "
        "SIGHUP (a file that does not parse then leaves the keys as they were)",
    )
    insecure: bool = same_as(InstanceConfig, "insecure")
    prefix_cache_isolation: PrefixCacheIsolation | None = setting(
        None,
        flag="--prefix-cache-isolation",
        default_text="api-key with API keys, else none",
        help="who shares cached prompt prefixes (the proxy): 'api-key' "
        "requests of one API key, 'user' requests of one API key tenant naming the same "
        "OpenAI 'user' (without API keys the 'user' is self-declared: a warning), 'none' "
        "everyone; a request's 'cache_salt' narrows it further",
    )
    hide_cached_tokens: bool = setting(
        False,
        flag="--hide-cached-tokens",
        help="leave usage.prompt_tokens_details.cached_tokens and kvbridge_stages out of "
        "responses (the proxy)",
    )
    engine: Engine = setting(
        Engine.KVBRIDGE,
        flag="--engine",
        help="what runs the instances: kvbridge's reference engine or vLLM with "
        "KVBridgeConnector (docs/vllm.md)",
    )
    tls_ca: str | None = setting(
        None,
        flag="--tls-ca",
        metavar="PEM",
        default_text="the shared token's deployment CA",
        help="the proxy checks the instances' --tls-cert against these CAs, host names included",
    )

    def __post_init__(self) -> None:
        _check_body_limit(self.max_body_mb)
        _check_exposure(self.host, self.token(), self.insecure)
        if self.engine is Engine.KVBRIDGE and self.token() is not None:
            for flag, urls in (("--prefill", self.prefill_urls), ("--decode", self.decode_urls)):
                for url in urls:
                    _check_instance_url(flag, url)
        if self.tls_ca is not None:
            self.instance_tls()  # a bundle that does not load is refused here
        self.api_keys()  # a key file that does not parse is refused here
        isolation = PrefixCacheIsolation.resolve(self.prefix_cache_isolation, self.has_api_key)
        object.__setattr__(self, "prefix_cache_isolation", isolation)

    def token(self) -> bytes | None:
        return load_token(path=self.kv_token_file)

    @property
    def has_api_key(self) -> bool:
        return bool(self.api_key or self.api_key_file)

    def api_keys(self) -> ApiKeys:
        """The API keys as the files hold them now (`ApiKeys.load`)."""
        return ApiKeys.load(self.api_key, self.api_key_file)

    def instance_tls(self) -> ssl.SSLContext:
        """How the proxy checks the instances' HTTPS (`tls.client_context`)."""
        from kvbridge.serve.tls import client_context

        return client_context(self.token(), self.tls_ca)

    @property
    def recompute_on_failure(self) -> bool:
        return self.kv_load_failure is KVLoadFailure.RECOMPUTE

    @property
    def max_body_bytes(self) -> int:
        return mib_to_bytes(self.max_body_mb)


@dataclass(frozen=True)
class DeploymentConfig:
    """A whole deployment on this host: one prefill and one decode instance (children),
    and the proxy (this process), whose settings it carries (`same_as`)."""

    prefill: InstanceConfig
    decode: InstanceConfig
    host: str = same_as(ProxyConfig, "host")
    port: int = same_as(ProxyConfig, "port")
    start_timeout_s: float = setting(
        900.0,
        flag="--start-timeout-s",
        help="give up if the instances are not ready after this long",
    )
    api_key: str | None = same_as(ProxyConfig, "api_key")
    api_key_file: str | None = same_as(ProxyConfig, "api_key_file")
    prefix_cache_isolation: PrefixCacheIsolation | None = same_as(
        ProxyConfig, "prefix_cache_isolation"
    )
    hide_cached_tokens: bool = same_as(ProxyConfig, "hide_cached_tokens")
    tls_ca: str | None = same_as(ProxyConfig, "tls_ca")

    def __post_init__(self) -> None:  # refused before any instance starts
        ApiKeys.load(self.api_key, self.api_key_file)
        has_api_key = bool(self.api_key or self.api_key_file)
        PrefixCacheIsolation.resolve(self.prefix_cache_isolation, has_api_key)

    def instance_tls(self) -> ssl.SSLContext:
        """How this host checks its instances' HTTPS (`tls.client_context`)."""
        from kvbridge.serve.tls import client_context

        return client_context(self.decode.token(), self.tls_ca)

    def proxy(self, prefill_urls: list[str], decode_urls: list[str]) -> ProxyConfig:
        """The proxy in front of the instances: the settings it shares with them as the
        decode instance has them, its own as this deployment has them."""
        kw = {p: getattr(self.decode, i) for p, i in carried(ProxyConfig, InstanceConfig)}
        kw |= {p: getattr(self, d) for d, p in carried(DeploymentConfig, ProxyConfig)}
        return ProxyConfig(self.prefill.model, tuple(prefill_urls), tuple(decode_urls), **kw)
