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
from kvbridge.errors import ConfigError
from kvbridge.plan.layout import DEFAULT_BLOCK_SIZE, DEFAULT_LAYOUT, CacheLayout
from kvbridge.serve.body_limit import DEFAULT_MAX_BODY_MB, mib_to_bytes
from kvbridge.serve.isolation import PrefixCacheIsolation


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class Engine(enum.Enum):
    """What runs the instances behind a proxy: kvbridge's reference engine (its own
    instances, `kvbridge serve --role prefill|decode`) or vLLM with a KV connector
    (vLLM's two-step P/D request, `vllm_backend.py`)."""

    KVBRIDGE = "kvbridge"
    VLLM = "vllm"


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
    """One prefill or decode instance: its engine, its HTTP server, its KV runtime."""

    role: Role
    tp_size: int
    model: str = "smollm2-135m"
    block_size: int = DEFAULT_BLOCK_SIZE
    cache_layout: CacheLayout = field(default_factory=lambda: CacheLayout.parse(DEFAULT_LAYOUT))
    kv_cache_mb: int = 256
    enable_prefix_caching: bool = True
    host: str = "127.0.0.1"
    port: int = 0
    port_file: str | None = None  # where a launched instance reports its port
    kv_host: str | None = None  # default: host
    kv_port: int = 0
    kv_token_file: str | None = None
    kv_load_failure: KVLoadFailure = KVLoadFailure.RECOMPUTE
    # the KV runtime's times: TransferConfig declares them (and says what they bound)
    lease_s: float = TransferConfig.lease_s
    transfer_timeout_s: float = TransferConfig.transfer_timeout_s
    liveness_timeout_s: float = TransferConfig.liveness_timeout_s
    handshake_timeout_s: float = TransferConfig.handshake_timeout_s
    #: decode: check pulled KV against the prefill's digests (TransferConfig declares it)
    kv_integrity: Integrity = TransferConfig.integrity
    #: prefill: which process peers read the KV from (TransferConfig declares it)
    kv_export: KVExport = TransferConfig.kv_export
    #: decode: read bytes its workers share once per host (TransferConfig declares it)
    kv_fan_out: FanOut = TransferConfig.fan_out
    max_body_mb: float = DEFAULT_MAX_BODY_MB  # larger request bodies are refused (413)
    kv_advertise_host: str | None = None  # the address peers reach the KV side channel at
    insecure: bool = False  # allow a non-loopback HTTP host without a shared token
    #: the most requests held at once (more are refused with 503 and Retry-After);
    #: None: derived from the KV cache (`admission.default_max_queued`)
    max_queued_requests: int | None = None
    #: a decode instance must take a prefilled request's KV within this long
    claim_s: float = 10.0
    #: the HTTPS certificate and key of the internal API (`tls.py`); by default an
    #: instance binding a non-loopback host makes its own, certified by the token
    tls_cert: str | None = None
    tls_key: str | None = None
    #: its compute threads' nice value raised by its role's `COMPUTE_NICE`, its KV
    #: transfer threads' not (`engine/cpu_share.py`): on shared cores transfers, then
    #: prefills, then decodes
    cpu_priority: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_layout", CacheLayout.parse(self.cache_layout))
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
                f"longer than --lease-s {self.lease_s:g}; the default is 10"
            )
        _check_body_limit(self.max_body_mb)
        _check_exposure(self.host, self.token(), self.insecure)
        from kvbridge.serve.tls import check_server_files

        check_server_files(self.tls_cert, self.tls_key)

    def token(self) -> bytes | None:
        """The shared secret (--kv-token-file, else the environment), or None."""
        return load_token(path=self.kv_token_file)

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
            kv_cache_mb=self.kv_cache_mb,
            enable_prefix_caching=self.enable_prefix_caching,
            cpu_nice=COMPUTE_NICE[self.role.value] if self.cpu_priority else 0,
        )

    def transfer_config(self) -> TransferConfig:
        """The KV runtime's settings; reads the shared secret (file or environment)."""
        return TransferConfig(
            host=self.kv_host or self.host,
            advertise_host=self.kv_advertise_host,
            base_port=self.kv_port,
            token=self.token(),
            lease_s=self.lease_s,
            transfer_timeout_s=self.transfer_timeout_s,
            liveness_timeout_s=self.liveness_timeout_s,
            handshake_timeout_s=self.handshake_timeout_s,
            integrity=self.kv_integrity,
            kv_export=self.kv_export,
            fan_out=self.kv_fan_out,
        )

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
    """The OpenAI-compatible proxy in front of prefill and decode instances."""

    model: str
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8300
    kv_load_failure: KVLoadFailure = KVLoadFailure.RECOMPUTE
    max_body_mb: float = DEFAULT_MAX_BODY_MB  # larger request bodies are refused (413)
    kv_token_file: str | None = None  # signs calls to the instances (else the environment)
    api_key: str | None = None  # required on /v1/... when set
    insecure: bool = False  # allow a non-loopback host without a shared token
    #: who shares cached prefixes (`isolation.py`); None: per API key with --api-key
    prefix_cache_isolation: PrefixCacheIsolation | None = None
    hide_cached_tokens: bool = False  # leave cache figures out of responses
    engine: Engine = Engine.KVBRIDGE  # what the instances are
    #: the CAs of the instances' own --tls-cert (else the token's deployment CA)
    tls_ca: str | None = None

    def __post_init__(self) -> None:
        _check_body_limit(self.max_body_mb)
        _check_exposure(self.host, self.token(), self.insecure)
        if self.engine is Engine.KVBRIDGE and self.token() is not None:
            for flag, urls in (("--prefill", self.prefill_urls), ("--decode", self.decode_urls)):
                for url in urls:
                    _check_instance_url(flag, url)
        if self.tls_ca is not None:
            self.instance_tls()  # a bundle that does not load is refused here
        isolation = PrefixCacheIsolation.resolve(self.prefix_cache_isolation, bool(self.api_key))
        object.__setattr__(self, "prefix_cache_isolation", isolation)

    def token(self) -> bytes | None:
        return load_token(path=self.kv_token_file)

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
    and the proxy (this process)."""

    prefill: InstanceConfig
    decode: InstanceConfig
    host: str = "127.0.0.1"
    port: int = 8300
    start_timeout_s: float = 900.0
    api_key: str | None = None
    prefix_cache_isolation: PrefixCacheIsolation | None = None
    hide_cached_tokens: bool = False
    tls_ca: str | None = None  # ProxyConfig.tls_ca

    def __post_init__(self) -> None:  # refused before any instance starts
        PrefixCacheIsolation.resolve(self.prefix_cache_isolation, bool(self.api_key))

    def instance_tls(self) -> ssl.SSLContext:
        """How this host checks its instances' HTTPS (`tls.client_context`)."""
        from kvbridge.serve.tls import client_context

        return client_context(self.decode.token(), self.tls_ca)

    def proxy(self, prefill_urls: list[str], decode_urls: list[str]) -> ProxyConfig:
        return ProxyConfig(
            self.prefill.model,
            tuple(prefill_urls),
            tuple(decode_urls),
            self.host,
            self.port,
            self.decode.kv_load_failure,
            self.decode.max_body_mb,
            self.decode.kv_token_file,
            self.api_key,
            self.decode.insecure,
            prefix_cache_isolation=self.prefix_cache_isolation,
            hide_cached_tokens=self.hide_cached_tokens,
            tls_ca=self.tls_ca,
        )
