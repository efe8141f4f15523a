"""A three-host deployment on test hosts, and what the multi-host tests ask of it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvbridge.harness.hosts import TestHost
from kvbridge.serve.demo import wait_introduced
from kvbridge.serve.metrics import metric_value
from kvbridge.serve.tls import client_context
from tests.serve.helpers import TOKEN, TOKEN_FILE, colocated, complete, small_instance

PORT = 8000
#: About 1,000 tokens: ~44 MB of KV from a tp-1 prefill worker, long enough on a
#: slowed link to cut it in the middle of the pull.
LONG_PROMPT = "The history of the old harbour town is long and full of events. " * 65
#: The requests each test instance holds at once (--max-queued-requests).
MAX_QUEUED = 64
#: How the test process checks the instances' HTTPS (they bind test-host addresses, so
#: they serve TLS certified by the deployment's token), as the proxy does.
VERIFY = client_context(TOKEN)


#: How each instance role starts: prefill tp 1, decode tp 3. Prefill blocks a cut link
#: strands are freed when the decode workers meet the prefill again after the heal, else
#: by the lease: keep it short (but past the slow-link pull, ~18 s, which the lease would
#: cut short); each instance holds up to MAX_QUEUED requests (64 streams fit, a burst
#: does not).
INSTANCE_SETTINGS: dict[str, dict[str, Any]] = {
    "prefill": {"tp": 1, "lease_s": 40, "max_queued_requests": MAX_QUEUED},
    "decode": {"tp": 3, "max_queued_requests": MAX_QUEUED},
}


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def serve(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "kvbridge.cli.main", "serve", *args]


@dataclass
class ThreeHosts:
    """Prefill, decode and proxy hosts of one deployment; the test process talks to it
    from the proxy host (the subnet exists only inside the namespaces)."""

    prefill: TestHost
    decode: TestHost
    proxy: TestHost
    #: each instance host's credential file (by host name), as the operator gave it
    credentials: dict[str, str] = field(default_factory=dict)
    #: what each instance role's next start takes besides `INSTANCE_SETTINGS` (by role):
    #: a test sets it before the role restarts
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: what each instance role's running process was started with (by role)
    started_with: dict[str, dict[str, Any]] = field(default_factory=dict)

    def serve(self, timeout_s: float) -> None:
        """Return once the three roles serve: as they are if each one runs and answers
        /health 200, else each (re)started."""
        hosts = (self.prefill, self.decode, self.proxy)
        if all(h.is_running and self.is_healthy(h) for h in hosts):
            return
        for host in hosts:
            host.kill()
        for role in ("prefill", "decode", "proxy"):
            self.start_role(role)
        self.wait_healthy(timeout_s)

    def start_role(self, role: str) -> None:
        """Start `role`'s process on its host: prefill tp 1, decode tp 3, or the proxy."""
        if role == "proxy":
            px = self.proxy
            upstream = ["--prefill", self.url(self.prefill), "--decode", self.url(self.decode)]
            auth = ["--auth-token-file", TOKEN_FILE]
            argv = ["--role", "proxy", "--host", px.address, "--port", str(PORT)]
            px.start(serve([*argv, *upstream, *auth]))
        else:
            settings = {**INSTANCE_SETTINGS[role], **self.settings.get(role, {})}
            self.start_instance(getattr(self, role), role, **settings)
            self.started_with[role] = settings

    def start_instance(self, host: TestHost, role: str, tp: int, **overrides: Any) -> None:
        config = small_instance(role, tp, kv_cache_mb=128, host=host.address, port=PORT)
        config = dataclasses.replace(config, **overrides)
        assert config.credential_file is not None
        self.credentials[host.name] = config.credential_file
        path = os.path.join(os.path.dirname(TOKEN_FILE), f"{host.name}.json")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(config.to_json())
        host.start([sys.executable, "-m", "kvbridge.serve.instance_main", path])

    def url(self, host: TestHost) -> str:
        """The proxy's OpenAI API (plain HTTP here), or an instance's internal API (HTTPS:
        it binds an address other hosts reach)."""
        scheme = "http" if host is self.proxy else "https"
        return f"{scheme}://{host.address}:{PORT}"

    def wait_healthy(self, timeout_s: float) -> None:
        """Return once the proxy and every instance answer /health 200."""
        deadline = time.monotonic() + timeout_s
        for host in (self.prefill, self.decode, self.proxy):
            while not self.is_healthy(host):
                assert host.is_running, f"{host.name} exited:\n{host.log_tail()}"
                assert time.monotonic() < deadline, f"{host.name} not up:\n{host.log_tail()}"
                time.sleep(0.5)

    def is_healthy(self, host: TestHost) -> bool:
        with self.proxy.inside():
            try:
                got = httpx.get(f"{self.url(host)}/health", timeout=5, verify=VERIFY)
                return got.status_code == 200
            except httpx.HTTPError:
                return False

    def complete(self, prompt: str, max_tokens: int = 8) -> dict:
        """A completion through the proxy (asserts 200)."""
        with self.proxy.inside():
            return complete(self.url(self.proxy), prompt, max_tokens)

    def stream(self, prompt: str, max_tokens: int = 8) -> str:
        """A streamed completion through the proxy, from any thread: its text (asserts
        that it ended with [DONE])."""
        parts, done = [], False
        with (
            self.proxy.inside(),
            httpx.stream(
                "POST",
                f"{self.url(self.proxy)}/v1/completions",
                json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True},
                timeout=600,
            ) as r,
        ):
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    parts.append(json.loads(line[6:])["choices"][0]["text"])
        assert done, parts
        return "".join(parts)

    def colocated(self, prompt: str, max_tokens: int = 8) -> str:
        """The request computed entirely on the decode host."""
        with self.decode.inside():
            return colocated(self.url(self.decode), prompt, max_tokens)

    def metric(self, host: TestHost, name: str, **labels: str) -> float:
        """`host`'s `kvbridge_<name>` (its samples with `labels`, summed)."""
        with host.inside():
            text = httpx.get(f"{self.url(host)}/metrics", timeout=30, verify=VERIFY).text
        return metric_value(text, name, **labels)

    def wait_introduced(self, timeout_s: float) -> None:
        """Wait until every instance answers /health and the proxy has introduced every
        decode instance to every prefill instance (after instances started again)."""
        self.wait_healthy(timeout_s)
        with self.proxy.inside():  # (its /health probes mark the instances up again)
            states = wait_introduced(self.url(self.proxy), timeout_s)
        assert set(states.split("; ")) == {"connected"}, states

    def worker_pids(self, host: TestHost) -> list[int]:
        """The tp worker processes of `host`'s instance (children of its fork server)."""
        parents = {}
        for pid in host.pids():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{pid}/stat").read_text()
                parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])
        forkservers = {
            pid
            for pid in parents
            if b"forkserver" in _cmdline(pid) and b"forkserver" not in _cmdline(parents[pid])
        }
        return sorted(pid for pid, parent in parents.items() if parent in forkservers)

    def wait_released(self, host: TestHost, timeout_s: float) -> None:
        """Wait until `host`'s instance holds no KV blocks (allocated or pinned)."""
        deadline = time.monotonic() + timeout_s
        while used := self.metric(host, "blocks_in_use") + self.metric(host, "kv_pinned_blocks"):
            assert time.monotonic() < deadline, f"{host.name} still holds {used} blocks"
            time.sleep(0.5)
