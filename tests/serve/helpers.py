"""Helpers shared by the end-to-end serving tests."""

from __future__ import annotations

import atexit
import os
import secrets
import select
import shutil
import socket
import tempfile
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvbridge.connector import ConnectorRole, Credential
from kvbridge.serve.config import InstanceConfig, Role
from kvbridge.serve.demo import colocated_text
from kvbridge.serve.disagg_backend import DisaggBackend
from kvbridge.serve.http_auth import SignedRequests
from kvbridge.serve.http_server import ServerThread
from kvbridge.serve.proxy import make_app
from tests.credentials import ROOT

#: The test instances' shared secret, as a deployment has one (`kvbridge serve` makes
#: one up): their KV plane is encrypted and authenticated, and every call to them is
#: signed (AUTH), as the proxy's are.
TOKEN = secrets.token_hex(32).encode()
_TOKEN_DIR = tempfile.mkdtemp(prefix="kvbridge-test-")
TOKEN_FILE = os.path.join(_TOKEN_DIR, "token")
with open(os.open(TOKEN_FILE, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as _f:
    _f.write(TOKEN)


def _remove_token_dir(owner: int = os.getpid()) -> None:
    if os.getpid() == owner:  # not from a forked child at its exit
        shutil.rmtree(_TOKEN_DIR, ignore_errors=True)


atexit.register(_remove_token_dir)
AUTH = SignedRequests(TOKEN)


def credential_file(role: str, name: str | None = None) -> str:
    """A new credential file for a `role` instance, enrolled by the tests' root (every
    test instance is of one deployment, whichever `Deployment` started it)."""
    roles = (ConnectorRole.PRODUCER if role == "prefill" else ConnectorRole.CONSUMER,)
    name = name or f"{role}-{secrets.token_hex(4)}"
    path = os.path.join(_TOKEN_DIR, f"{name}.credential")
    ROOT.enroll(roles, name).save(path)
    return path


def instance_id(url: str) -> str:
    """A test instance's id (the reader a pull capability names)."""
    r = httpx.get(f"{url}/internal/info", auth=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return str(r.json()["instance_id"])


def colocated(url: str, prompt: str, max_tokens: int) -> str:
    """The request computed entirely on instance `url`."""
    return colocated_text(url, prompt, max_tokens, TOKEN)


def credential_of(instance_id: str) -> Credential:
    """The credential file a test instance was given (`credential_file`)."""
    name = instance_id.rsplit("@", 1)[0]
    return Credential.load(os.path.join(_TOKEN_DIR, f"{name}.credential"))


def small_instance(
    role: str, tp: int, block_size: int = 16, layout: str = "BHLNC", **overrides: Any
) -> InstanceConfig:
    """A test instance's config: a small cache, and timeouts generous enough for a
    2-core machine running two dozen processes (the fault tests pass shorter ones). Its
    compute keeps its CPU priority: the suite runs two pytest processes at once, and an
    instance yielding to the other one's tests only makes them slower (`kvbridge serve`'s
    default is checked by the SIGTERM test)."""
    fields: dict[str, Any] = dict(
        kv_cache_mb=32,
        cpu_priority=False,
        lease_s=120,
        transfer_timeout_s=60,
        handshake_timeout_s=30,
        kv_token_file=TOKEN_FILE,
    )
    fields.update(overrides)
    fields.setdefault("credential_file", credential_file(role))
    return InstanceConfig(Role(role), tp, block_size=block_size, cache_layout=layout, **fields)


def proxy_for(
    prefill: list[str], decode: list[str], recompute: bool = True, token: bytes | None = TOKEN
) -> ServerThread:
    backend = DisaggBackend(
        prefill, decode, "smollm2-135m", recompute_on_failure=recompute, token=token
    )
    return ServerThread(make_app(backend)).start()


def complete(url: str, prompt: str, max_tokens: int = 12) -> dict:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()


def raw_post(url: str, path: str, headers: bytes, chunks: list[bytes]) -> tuple[int, bytes]:
    """POST by hand: the request line and `headers`, then `chunks` until the server
    answers (or they run out); (bytes of body sent, the whole answer)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode() + headers + b"\r\n")
        sent = 0
        for chunk in chunks:
            if select.select([sock], [], [], 0)[0]:
                break  # answered before the body ended
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server answered and closed while this chunk was on its way
            sent += len(chunk)
            time.sleep(0.001)
        # A server that answers from the headers and closes with body bytes still unread
        # resets the connection (RFC 9112 9.6 allows it); the kernel hands over the answer
        # it received before the reset, then reports the reset.
        answer = b""
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            answer += data
    return sent, answer
