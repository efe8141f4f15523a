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
from kvbridge.settings import setting
from kvbridge.transfer.integrity import SAMPLE_EVERY, Integrity

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

    Each field is a setting (`kvbridge.settings`): its help says what it does. vLLM's
    `kv_connector_extra_config` may set each but `token` under the field's name
    (`kvbridge.vllm.settings`); `kvbridge serve` gives those it carries flags
    (`InstanceConfig`).
    """

    host: str = setting(
        "127.0.0.1",
        help="the address the workers' side channels bind; any other than loopback "
        "needs a shared secret",
    )
    advertise_host: str | None = setting(
        None,
        flag="--kv-advertise-host",
        metavar="HOST",
        default_text="the bound address",
        help="the address peers reach the side channel at, when it differs from the bound "
        "one (required when binding every interface, e.g. 0.0.0.0); UCX is kept to the "
        "network device that carries it, unless UCX_NET_DEVICES is set",
    )
    base_port: int = setting(
        0,
        flag="--kv-port",
        help="worker r of a prefill instance listens on this port + r; 0 picks a free port "
        "(the actual endpoint is then reported)",
    )
    token: bytes | None = setting(
        None,
        key=None,  # a config document names a file holding it (`load_token`)
        env=(TOKEN_ENV, TOKEN_FILE_ENV),
        help="the shared secret: the side channel is encrypted and authenticated (ZMQ "
        "CURVE with keys derived from it, plus an HMAC-SHA256 on every message), and "
        "notifications are signed with per-handshake session keys derived from it "
        "(auth.py); without it peers are not authenticated: loopback only",
    )
    lease_s: float = setting(
        120.0,
        flag="--lease-s",
        help="a prefill worker frees exposed blocks after this long at most, even if no "
        "decode worker said it has read them",
    )
    transfer_timeout_s: float = setting(
        30.0, flag="--transfer-timeout-s", help="a KV pull not finished after this long fails"
    )
    liveness_timeout_s: float = setting(
        5.0,
        flag="--liveness-timeout-s",
        help="a KV pull fails (and the prefill worker is forgotten, so the next pull "
        "connects afresh) when the worker's side channel answered none of its heartbeats "
        "(ZMQ's, sent every fifth of this) for this long: its host or the link is down; a "
        "slow link that still answers is bounded by the transfer timeout only",
    )
    handshake_timeout_s: float = setting(
        15.0,
        flag="--handshake-timeout-s",
        help="a first contact with a prefill worker not answered after this long fails",
    )
    max_message_bytes: int = setting(
        DEFAULT_MAX_MESSAGE_BYTES,
        help="side-channel messages larger than this many bytes are refused (at least 4096)",
    )
    max_units: int = setting(
        1 << 22,
        help="the most descriptors one prepared descriptor list may hold; finer copy lists "
        "fall back to per-request descriptor lists",
    )
    integrity: Integrity = setting(
        Integrity.SAMPLE,
        flag="--kv-integrity",
        help="decode: check each pulled request's bytes against the prefill's digest of "
        "them (a mismatch is a failed pull): on, off, or sample (one "
        f"request in {SAMPLE_EVERY}, as the check costs more than a same-host pull)",
    )
    kv_export: KVExport = setting(
        KVExport.AUTO,
        flag="--kv-export",
        help="prefill: where decode workers read the KV from: an export process per worker "
        "that maps only the KV, read-only (process), the worker's own NIXL agent, which on "
        "CMA and TCP lets a peer holding the secret address the whole worker (inline), or "
        "process when a shared secret is set and inline otherwise (auto)",
    )
    fan_out: FanOut = setting(
        FanOut.AUTO,
        flag="--kv-fan-out",
        help="decode: workers that need the same prefill bytes (decode tp above the KV "
        "heads, MLA) read them once per host, one worker over the link and the others "
        "copying from it on the host: from a prefill on another host (auto), always (on), "
        "or each worker reads its own (off)",
    )

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
