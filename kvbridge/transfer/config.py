"""Configuration of one worker's transfer runtime (producer or consumer side).

Times are seconds. Every wait the runtime does is bounded by one of them.
"""

from __future__ import annotations

import enum
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from kvbridge.errors import ConfigError
from kvbridge.transfer.integrity import Integrity

#: Environment variables read by `load_token`.
TOKEN_ENV = "KVBRIDGE_TRANSFER_TOKEN"
TOKEN_FILE_ENV = "KVBRIDGE_TRANSFER_TOKEN_FILE"

#: Default cap on one side-channel message; a handshake reply is a few KiB plus the
#: NIXL agent metadata (which grows with registered regions), so 4 MiB is generous.
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20


class KVExport(enum.Enum):
    """Which process a prefill worker's peers read its KV from (`kvbridge.transfer.export`)."""

    #: an export process of its own that maps only the KV (read-only) and runs the agent
    PROCESS = "process"
    #: the worker's own agent: a peer holding its metadata can address the whole worker
    #: on software transports (CMA, TCP)
    INLINE = "inline"
    #: PROCESS when the deployment has a token and the cache is (or can be moved) in
    #: shared memory, INLINE otherwise (no token: loopback peers, unauthenticated)
    AUTO = "auto"


class FanOut(enum.Enum):
    """Whether a decode instance's workers on one host that need the same prefill bytes
    (GQA heads replicated when decode tp > num_kv_heads, MLA's latent) read them from
    the prefill instance once, one worker reading and the others copying from it on
    the host (`planner.make_plan(decode_hosts=)`), or each over the link."""

    #: fan out from a prefill instance on another host (its endpoint is not an address
    #: of this host); on one host a copy costs what a read does, so each reads its own
    AUTO = "auto"
    ON = "on"  # fan out from every prefill instance, on this host too
    OFF = "off"  # every decode worker reads its own bytes


@dataclass(frozen=True)
class TransferConfig:
    """How a worker's side channel listens and how long the runtime waits.

    Attributes:
        host: address the producer's side channel binds (127.0.0.1 unless configured);
            any other needs a token.
        advertise_host: the address peers reach this worker at, when it differs from
            `host` (required when binding a wildcard such as 0.0.0.0). UCX is kept to
            the network device that carries it (or `host`), unless UCX_NET_DEVICES is set.
        base_port: worker ``rank`` of a producer instance serves ``base_port + rank``;
            0 lets the OS pick (the actual endpoint is then reported by the producer).
        token: shared secret; when set, the side channel is encrypted and authenticated
            (ZMQ CURVE with keys derived from it, plus an HMAC-SHA256 on every message),
            and notifications are signed with per-handshake session keys derived from
            it (see auth.py). Without it peers are not authenticated: loopback only.
        lease_s: a producer releases exposed blocks after this long even if the
            expected consumers never notified completion.
        transfer_timeout_s: a consumer fails a request not finished after this long.
        liveness_timeout_s: a consumer fails a pull (and forgets the producer worker,
            so the next pull connects afresh) when the worker's side channel answered
            none of its heartbeats (ZMQ's, sent every fifth of this) for this long: its
            host or the link is down. A slow link still carries them, so a slow pull
            is bounded by `transfer_timeout_s` only.
        handshake_timeout_s: a consumer fails a handshake not answered after this long.
        max_message_bytes: side-channel messages larger than this are rejected.
        max_units: most descriptors one prepared descriptor list may hold; finer
            copy lists fall back to per-request descriptor lists.
        integrity: whether a consumer checks a digest of what it pulled against the
            producer's (`integrity.py`): every pull, none, or a sample (the default:
            the check costs more than a same-host pull; docs/benchmarks.md).
        kv_export: which process peers read a prefill worker's KV from (`KVExport`).
        fan_out: whether a decode instance's workers read bytes they share once per
            host (`FanOut`).
    """

    host: str = "127.0.0.1"
    advertise_host: str | None = None
    base_port: int = 0
    token: bytes | None = None
    lease_s: float = 120.0
    transfer_timeout_s: float = 30.0
    liveness_timeout_s: float = 5.0
    handshake_timeout_s: float = 15.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_units: int = 1 << 22
    integrity: Integrity = Integrity.SAMPLE
    kv_export: KVExport = KVExport.AUTO
    fan_out: FanOut = FanOut.AUTO

    def __post_init__(self) -> None:
        if not 0 <= self.base_port < 65536:
            raise ConfigError(
                f"base_port={self.base_port} must be in [0, 65536); 0 picks a free port"
            )
        for field in ("lease_s", "transfer_timeout_s", "liveness_timeout_s", "handshake_timeout_s"):
            value = getattr(self, field)
            if not value > 0:
                raise ConfigError(f"{field}={value!r} must be a positive number of seconds")
        for field, kind, what in (
            ("integrity", Integrity, "KV integrity mode"),
            ("kv_export", KVExport, "KV export mode"),
            ("fan_out", FanOut, "KV fan-out mode"),
        ):
            value = getattr(self, field)
            if not isinstance(value, kind):  # a name, from a JSON or vLLM config
                try:
                    object.__setattr__(self, field, kind(value))
                except ValueError:
                    names = ", ".join(m.value for m in kind)
                    raise ConfigError(f"{field}={value!r} is not a {what}; use {names}") from None
        if self.max_message_bytes < 4096:
            raise ConfigError(
                f"max_message_bytes={self.max_message_bytes} is too small for a handshake; "
                "use at least 4096"
            )
        if self.advertise_host is None and self.host in ("0.0.0.0", "::", ""):
            raise ConfigError(
                f"KV host {self.host!r} binds every interface, so peers need to be told "
                "which address reaches it: set --kv-advertise-host"
            )
        if self.token is None and not is_loopback(self.host):
            raise ConfigError(
                f"KV host {self.host!r} is not a loopback address, and a side channel other "
                "hosts can reach needs a shared secret: set --kv-token-file (or "
                f"{TOKEN_ENV}), or keep --kv-host 127.0.0.1"
            )
        if self.token is not None and len(self.token) < 16:
            raise ConfigError(
                f"token of {len(self.token)} bytes is too short to authenticate peers; "
                "use at least 16 bytes (e.g. `openssl rand -hex 32`)"
            )

    @property
    def reachable_host(self) -> str:
        """The address peers use to reach this worker."""
        return self.advertise_host or self.host

    @property
    def wants_export_process(self) -> bool:
        """Whether a producer whose cache is in shared memory exports it from a process
        of its own (`KVExport`)."""
        if self.kv_export is KVExport.AUTO:
            return self.token is not None
        return self.kv_export is KVExport.PROCESS

    def fans_out_from(self, endpoint: str) -> bool:
        """Whether a decode worker fans out the reads of the producer at `endpoint`
        (`FanOut`)."""
        if self.fan_out is FanOut.AUTO:
            return not is_local_endpoint(endpoint)
        return self.fan_out is FanOut.ON

    def port_of(self, rank: int) -> int:
        """The side-channel port worker `rank` binds (0: any free port)."""
        return self.base_port + rank if self.base_port else 0


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (127.0.0.0/8, ::1) or "localhost"."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local_endpoint(endpoint: str) -> bool:
    """Whether the side channel at `endpoint` (``tcp://HOST:PORT``) is on this host: a
    loopback address, or one of this host's (network namespace's) own addresses, which
    a socket can bind. A name that does not resolve counts as another host's."""
    host = endpoint.partition("://")[2].rpartition(":")[0].strip("[]")
    if is_loopback(host):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr[0], 0))
            except OSError:
                continue
            return True
    return False


def load_token(value: str | None = None, path: str | Path | None = None) -> bytes | None:
    """The shared token, from the first of these that is set: `value`, the file `path`
    (both given by a flag), ``KVBRIDGE_TRANSFER_TOKEN``, the file named by
    ``KVBRIDGE_TRANSFER_TOKEN_FILE``; None if none is. Every command and config reads
    the token through this function, so the order is the same everywhere. Surrounding
    whitespace of a file's content is ignored."""
    if value:
        return value.encode()
    if not path:
        env = os.environ.get(TOKEN_ENV)
        if env:
            return env.encode()
        path = os.environ.get(TOKEN_FILE_ENV) or None
    if path is None:
        return None
    try:
        text = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(
            f"cannot read transfer token file {path}: {exc.strerror or exc}"
        ) from None
    if not text:
        raise ConfigError(f"transfer token file {path} is empty; put the shared secret in it")
    return text
