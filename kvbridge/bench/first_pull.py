"""`kvbridge bench first-pull`: the first pull across hosts against the later ones, per
start order.

Three test hosts (`kvbridge.harness.hosts`: network namespaces on a bridge, KV over TCP
between them), a prefill instance, a decode instance and the proxy, each started with
`kvbridge serve --role ...` as an operator deploys them: a shared token (CURVE side
channels, signed internal calls, the instances' internal API over TLS) and each
instance's own role credential. For each start order the deployment is (re)started that
way, and as soon as the proxy answers /health 200 a series of short completions is sent
one at a time through it. Printed per order: the first request's pull (`transfer_ms`)
against the median of the later ones in the same series, their ratio, and what the
first pull met: the decode workers that waited for a handshake and the paths to prefill
workers it was the first READ over (`kv_handshakes`, `kv_cold_peers`).

Start orders:

    with              the instances and the proxy started together
    proxy-first       the proxy up (and answering) before the instances start
    instances-first   the instances up before the proxy starts
    prefill-restart   the prefill instance killed and started again under a serving proxy
    decode-restart    the same for the decode instance

Needs root (network namespaces); refuses with the reason otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvbridge.harness.hosts import HostNetwork, TestHost, missing

ORDERS = ("with", "proxy-first", "instances-first", "prefill-restart", "decode-restart")
#: The port every role listens on (each on its own host).
PORT = 8000
_WORDS = [
    "harbour",
    "river",
    "lantern",
    "copper",
    "meadow",
    "signal",
    "orchard",
    "velvet",
    "canyon",
    "ember",
    "quartz",
    "willow",
    "beacon",
    "glacier",
    "saffron",
    "thunder",
    "marble",
    "falcon",
    "prairie",
    "cobalt",
]


class Hosts(Protocol):
    """A deployment on three test hosts that `run_order` starts in an order: the bench's
    (`BenchHosts`) or the tests' (`tests.hosts.helpers.ThreeHosts`)."""

    prefill: TestHost
    decode: TestHost
    proxy: TestHost

    def start_role(self, role: str) -> None: ...

    def wait_healthy(self, timeout_s: float) -> None: ...

    def is_healthy(self, host: TestHost) -> bool: ...

    def complete(self, prompt: str, max_tokens: int = 8) -> dict[str, Any]: ...


@dataclass
class Series:
    """One start order's requests: each one's `kvbridge_stages` (the first one first)."""

    order: str
    stages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def first(self) -> dict[str, Any]:
        return self.stages[0]

    @property
    def first_ms(self) -> float:
        return float(self.first["transfer_ms"])

    @property
    def later_ms(self) -> float:
        """The median pull of the requests after the first."""
        return statistics.median(float(s["transfer_ms"]) for s in self.stages[1:])

    @property
    def ratio(self) -> float:
        return self.first_ms / self.later_ms


def prompt(tag: str, words: int) -> str:
    """A short prompt of its own (no instance's prefix cache holds it)."""
    rng = random.Random(tag)
    return f"{tag}: " + " ".join(rng.choice(_WORDS) for _ in range(words))


def _answers(dep: Hosts, host: TestHost) -> bool:
    """`host` answers /health at all (200 or not): its server is up."""
    import httpx  # (the serve extra; this module is imported to register the command)

    with dep.proxy.inside():
        try:
            httpx.get(f"http://{host.address}:{PORT}/health", timeout=5)
            return True
        except httpx.HTTPError:
            return False


def start(dep: Hosts, order: str, timeout_s: float) -> None:
    """(Re)start `dep` in `order`; returns once the proxy and both instances answer
    /health 200 (what an operator's readiness check waits for). An instance to restart
    that died already is started again under the others as they are."""
    restart = order.removesuffix("-restart")
    if restart != order:
        host = getattr(dep, restart)
        others = [h for h in (dep.prefill, dep.decode, dep.proxy) if h is not host]
        if not all(h.is_running for h in others):
            start(dep, "with", timeout_s)  # something to restart an instance under
        host.kill()
        dep.start_role(restart)
        dep.wait_healthy(timeout_s)
        return
    for host in (dep.proxy, dep.prefill, dep.decode):
        host.kill()
    deadline = time.monotonic() + timeout_s
    if order == "proxy-first":
        dep.start_role("proxy")
        while not _answers(dep, dep.proxy):
            assert dep.proxy.is_running, dep.proxy.log_tail()
            assert time.monotonic() < deadline, "the proxy did not come up"
            time.sleep(0.2)
    dep.start_role("prefill")
    dep.start_role("decode")
    if order == "instances-first":
        for host in (dep.prefill, dep.decode):
            while not dep.is_healthy(host):
                assert host.is_running, host.log_tail()
                assert time.monotonic() < deadline, f"{host.name} did not come up"
                time.sleep(0.2)
    if order != "proxy-first":
        dep.start_role("proxy")
    dep.wait_healthy(max(deadline - time.monotonic(), 1.0))


def run_order(
    dep: Hosts, order: str, requests: int, words: int = 8, timeout_s: float = 900, tag: str = ""
) -> Series:
    """Start `dep` in `order`, then send `requests` completions through the proxy one
    after the other, the first as soon as it is ready; their stages."""
    start(dep, order, timeout_s)
    series = Series(order)
    for i in range(requests):
        got = dep.complete(prompt(f"{order}{tag} {i}", words), 2)
        series.stages.append(got["kvbridge_stages"])
    return series


@dataclass
class BenchHosts:
    """The bench's deployment: prefill tp `prefill_tp` and decode tp `decode_tp` on their
    own hosts, the proxy on a third; a token and role credentials made for the run."""

    net: HostNetwork
    files: Path
    prefill_tp: int
    decode_tp: int
    model: str
    kv_cache_mb: int
    prefill: TestHost = field(init=False)
    decode: TestHost = field(init=False)
    proxy: TestHost = field(init=False)

    def __post_init__(self) -> None:
        from kvbridge.connector import RootKey
        from kvbridge.serve.tls import client_context

        self.prefill, self.decode = self.net.add("prefill"), self.net.add("decode")
        self.proxy = self.net.add("proxy")
        token = os.urandom(32).hex().encode()
        self.token_file = self.files / "token"
        self._write(self.token_file, token)
        self.root = RootKey.generate()
        self.verify = client_context(token)
        self._starts = 0

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(data)

    def url(self, host: TestHost) -> str:
        scheme = "http" if host is self.proxy else "https"
        return f"{scheme}://{host.address}:{PORT}"

    def start_role(self, role: str) -> None:
        from kvbridge.connector import ConnectorRole
        from kvbridge.serve.config import InstanceConfig, Role

        host: TestHost = getattr(self, role)
        if role == "proxy":
            upstream = ["--prefill", self.url(self.prefill), "--decode", self.url(self.decode)]
            argv = ["serve", "--role", "proxy", "--host", host.address, "--port", str(PORT)]
            argv += [*upstream, "--auth-token-file", str(self.token_file)]
            host.start([sys.executable, "-m", "kvbridge.cli.main", *argv])
            return
        self._starts += 1  # a new credential per start, as an operator enrolls one
        kv_role = ConnectorRole.PRODUCER if role == "prefill" else ConnectorRole.CONSUMER
        credential = self.files / f"{role}-{self._starts}.credential"
        self.root.enroll((kv_role,), f"{role}-{self._starts}").save(str(credential))
        tp = self.prefill_tp if role == "prefill" else self.decode_tp
        config = InstanceConfig(
            Role(role),
            tp,
            model=self.model,
            kv_cache_mb=self.kv_cache_mb,
            host=host.address,
            port=PORT,
            kv_token_file=str(self.token_file),
            credential_file=str(credential),
        )
        path = self.files / f"{role}.json"
        self._write(path, config.to_json())
        host.start([sys.executable, "-m", "kvbridge.serve.instance_main", str(path)])

    def is_healthy(self, host: TestHost) -> bool:
        import httpx

        with self.proxy.inside():
            try:
                got = httpx.get(f"{self.url(host)}/health", timeout=5, verify=self.verify)
                return got.status_code == 200
            except httpx.HTTPError:
                return False

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for host in (self.prefill, self.decode, self.proxy):
            while not self.is_healthy(host):
                if not host.is_running:
                    raise RuntimeError(f"{host.name} exited:\n{host.log_tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{host.name} not up:\n{host.log_tail()}")
                time.sleep(0.2)

    def complete(self, prompt: str, max_tokens: int = 8) -> dict[str, Any]:
        import httpx

        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        with self.proxy.inside():
            r = httpx.post(f"{self.url(self.proxy)}/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        got: dict[str, Any] = r.json()
        if "kvbridge_kv_load_error" in got:
            raise RuntimeError(f"a pull failed: {got['kvbridge_kv_load_error']}")
        return got


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvbridge.serve.config import InstanceConfig

    p.add_argument("--orders", nargs="+", choices=ORDERS, default=list(ORDERS))
    p.add_argument("--runs", type=int, default=3, help="series per start order (default 3)")
    p.add_argument("--requests", type=int, default=6, help="requests per series (default 6)")
    p.add_argument("--prompt-words", type=int, default=8, help="words per prompt (default 8)")
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=3)
    p.add_argument("--model", default=InstanceConfig.model)
    p.add_argument("--kv-cache-mb", type=int, default=128)


@contextlib.contextmanager
def _hosts(args: argparse.Namespace) -> Iterator[BenchHosts]:
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-") as tmp, HostNetwork() as net:
        yield BenchHosts(
            net, Path(tmp), args.prefill_tp, args.decode_tp, args.model, args.kv_cache_mb
        )


def run_first_pull_bench(args: argparse.Namespace) -> int:
    reason = missing()
    if reason:
        print(f"kvbridge bench first-pull needs test hosts: {reason}", file=sys.stderr)
        return 2
    if args.requests < 2:
        print(f"--requests {args.requests}: give 2 or more (a first and a later one)")
        return 2
    say: Callable[[str], None] = lambda s: print(s, flush=True)  # noqa: E731
    say(
        f"prefill tp {args.prefill_tp} -> decode tp {args.decode_tp} on test hosts, proxy on "
        f"a third; {args.requests} requests of {args.prompt_words} words per series"
    )
    say(
        f"{'order':>16} {'run':>3} {'first ms':>9} {'later ms':>9} {'first/later':>11} "
        f"{'handshakes':>10} {'cold paths':>10}"
    )
    ratios: dict[str, list[float]] = {}
    with _hosts(args) as dep:
        for run in range(args.runs):
            for order in args.orders:
                s = run_order(dep, order, args.requests, args.prompt_words, tag=f" r{run}")
                ratios.setdefault(order, []).append(s.ratio)
                say(
                    f"{order:>16} {run:>3} {s.first_ms:9.1f} {s.later_ms:9.1f} {s.ratio:11.2f} "
                    f"{s.first.get('kv_handshakes', '?'):>10} "
                    f"{s.first.get('kv_cold_peers', '?'):>10}   pulls "
                    f"{[round(float(st['transfer_ms']), 1) for st in s.stages]} ms"
                )
    worst = max(max(r) for r in ratios.values())
    for order, r in ratios.items():
        say(f"{order:>16}: first/later {min(r):.2f}-{max(r):.2f}")
    say(f"target first pull <= 2x a later one in every order: at most {worst:.2f}x, "
        f"{'met' if worst <= 2 else 'missed'}")  # fmt: skip
    return 0
