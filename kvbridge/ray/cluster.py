"""A Ray cluster over three test hosts, running the P/D application (`make demo-ray`, the
Ray tests).

`RayCluster` (a context manager; root: the hosts are network namespaces,
`kvbridge.harness.hosts`) makes

1. a private run directory holding the shared secret (a file) and a pool of role
   credentials per deployment, enrolled by a root key that stays in this process
   (`enrollment.py`), and Ray's own files (its sessions, logs and auth token: HOME);
2. three hosts, each with a Ray node (`ray start --block`): the head (Serve's
   controller, proxy and the OpenAI ingress), a prefill node and a decode node, each
   offering a custom resource that pins its deployment there;
3. the deployment (`app.py`), by the driver `deploy.py` run on the head host.

It sends completions through Serve's ingress (`complete`), reads which replica claimed
which credential on which node (`claims`), what the decode workers pulled (`pulls`) and
the metrics Ray exports for each replica's vLLM (`replica_metric`), and kills a
replica's actor (`kill_replica`). `close` stops every host
(their processes and private /dev/shm go with their namespaces) and removes the run
directory and any vLLM shared-memory file left in this host's /dev/shm.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbridge.errors import KVBridgeError
from kvbridge.ray.app import Deployment, RayPDConfig, Side, pd_serving_args
from kvbridge.ray.enrollment import claims, enroll_pool

if TYPE_CHECKING:
    from kvbridge.harness.hosts import HostNetwork, TestHost

#: a decode worker's log line for a finished pull (`connector/roles.py`): its rank, the
#: request, the bytes it read over the link and those it copied from a sibling
PULLED = re.compile(
    r"kvbridge decode worker (\d+) pulled (\S+): tokens \[\d+, \d+\), (\d+) bytes "
    r"\(\+(\d+) copied from a sibling\)"
)
#: a decode worker's log line for a failed pull: its rank, the request, the reason
PULL_FAILED = re.compile(r"kvbridge decode worker (\d+) failed to pull (\S+): (.*)")
#: the custom resource of each kind of host; a prefill or decode node offers as many units
#: as one replica's bundles ask for (its tp_size), so it runs one replica at most
RESOURCES = {"head": "kvbridge_head", "prefill": "kvbridge_prefill", "decode": "kvbridge_decode"}
#: where each Ray node exports its processes' metrics (Prometheus text: Ray Serve LLM's
#: replicas record vLLM's, the connector's series included, through Ray's metrics)
METRICS_PORT = 8090
#: logical CPUs each Ray node declares: a tp-n deployment needs n + 1, the ingress 1, and
#: Serve's controller and proxy some; the host's real cores are shared by all
NODE_CPUS = 16
APP_NAME = "kvbridge-pd"
MODEL_ID = "smollm2"


class ClusterError(KVBridgeError):
    """The Ray cluster or its application did not come up or answer (what and why)."""


@dataclass(frozen=True)
class Pull:
    """One decode worker's pull of one request, from its log."""

    rank: int
    request_id: str
    link_bytes: int
    sibling_bytes: int


@dataclass(frozen=True)
class ClusterConfig:
    """The model folder, each deployment's tp_size, the prefill replicas (one host
    each: ``prefill``, ``prefill-2``, ...), vLLM's `kv_load_failure_policy`, the
    connector's `lease_s` (None: `LOADED_HOST_SETTINGS`'), how many credentials each pool
    holds (one per replica start, restarts included), the head's ports and the
    deployment's time bound."""

    model: str
    prefill_tp: int = 1
    decode_tp: int = 3
    num_prefill_replicas: int = 1
    failure_policy: str = "fail"
    lease_s: float | None = None
    pool_size: int = 4
    ray_port: int = 6379
    http_port: int = 8000
    deploy_timeout_s: float = 1800


def ray_start(
    address: str, resources: dict[str, int], temp_dir: Path, head: str | None, port: int
) -> list[str]:
    """A host's `ray start --block` command line: a node offering `resources` joining the
    head at `head` (HOST:PORT), or the head itself (on `port`) when `head` is None."""
    ray = str(Path(sys.executable).parent / "ray")
    cmd = [ray, "start", "--block", "--node-ip-address", address]
    cmd += ["--num-cpus", str(NODE_CPUS), "--resources", json.dumps(resources)]
    cmd += ["--temp-dir", str(temp_dir), "--disable-usage-stats"]
    cmd += ["--metrics-export-port", str(METRICS_PORT)]
    if head is None:
        return [*cmd, "--head", "--port", str(port), "--include-dashboard=false"]
    return [*cmd, "--address", head]


@dataclass
class RayCluster:
    """Three test hosts running Ray and the P/D application (module docstring). Owned
    by one thread; use as a context manager."""

    cfg: ClusterConfig
    log_dir: Path
    run: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvbridge-ray-")))
    pools: dict[Side, str] = field(default_factory=dict)
    net: HostNetwork | None = None
    hosts: dict[str, TestHost] = field(default_factory=dict)
    _shm_before: set[str] = field(default_factory=set)

    def __enter__(self) -> RayCluster:
        from kvbridge.vllm.launch import vllm_shm_files

        self._shm_before = vllm_shm_files()
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def env(self) -> dict[str, str]:
        """Ray's processes' environment: their files (auth token, sessions) in the run
        directory."""
        return {**os.environ, "HOME": str(self.run / "home"), "RAY_USAGE_STATS_ENABLED": "0"}

    @property
    def url(self) -> str:
        return f"http://{self.hosts['head'].address}:{self.cfg.http_port}"

    def _start(self) -> None:
        from kvbridge.connector import RootKey
        from kvbridge.harness.hosts import HostNetwork

        cfg, run = self.cfg, self.run
        token_file = run / "token"
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        root = RootKey.generate()  # the deployment's: it stays in this process
        for side, kv_role in ((Side.PREFILL, "kv_producer"), (Side.DECODE, "kv_consumer")):
            pool = run / f"pool-{side.value}"
            self.pools[side] = str(enroll_pool(root, kv_role, side.value, cfg.pool_size, pool))
        pools = self.pools
        app = RayPDConfig(
            model=cfg.model,
            prefill=Deployment(
                cfg.prefill_tp,
                RESOURCES["prefill"],
                pools[Side.PREFILL],
                num_replicas=cfg.num_prefill_replicas,
            ),
            decode=Deployment(cfg.decode_tp, RESOURCES["decode"], pools[Side.DECODE]),
            token_file=str(token_file),
            ingress_resource=RESOURCES["head"],
            model_id=MODEL_ID,
            failure_policy=cfg.failure_policy,
            lease_s=cfg.lease_s,
        )
        doc = {"serving_args": pd_serving_args(app), "name": APP_NAME, "http_port": cfg.http_port}
        (run / "app.json").write_text(json.dumps(doc, indent=1))
        self.net = HostNetwork(log_dir=self.log_dir)
        prefills = ["prefill"] + [f"prefill-{i}" for i in range(2, cfg.num_prefill_replicas + 1)]
        units = {"head": 16, "prefill": cfg.prefill_tp, "decode": cfg.decode_tp}
        for name in ("head", *prefills, "decode"):
            self.hosts[name] = self.net.add(name)
        head_address = f"{self.hosts['head'].address}:{cfg.ray_port}"
        for name, host in self.hosts.items():
            kind = name.split("-")[0]
            head = None if name == "head" else head_address
            resources = {RESOURCES[kind]: units[kind]}
            cmd = ray_start(host.address, resources, run / f"r-{name}", head, cfg.ray_port)
            host.start(cmd, self.env)
            print(f"{name}: Ray node at {host.address} (log {host.log_path})", flush=True)
        deploy = ["ip", "netns", "exec", self.hosts["head"].netns, sys.executable]
        deploy += ["-m", "kvbridge.ray.deploy", str(run / "app.json")]
        deploy += ["--address", head_address, "--num-nodes", str(len(self.hosts))]
        with open(self.log_dir / "deploy.log", "wb") as log:
            try:
                done = subprocess.run(
                    deploy, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                    timeout=cfg.deploy_timeout_s, check=False,
                )  # fmt: skip
            except subprocess.TimeoutExpired:
                raise ClusterError(
                    f"the deployment was not running after {cfg.deploy_timeout_s:.0f} s "
                    f"(see {self.log_dir / 'deploy.log'})"
                ) from None
        if done.returncode != 0:
            tail = (self.log_dir / "deploy.log").read_text(errors="replace")[-3000:]
            raise ClusterError(f"the deployment exited {done.returncode}:\n{tail}")

    def side_hosts(self, side: Side) -> dict[str, TestHost]:
        """The hosts of `side`'s replicas, by name."""
        return {n: h for n, h in self.hosts.items() if n.split("-")[0] == side.value}

    def complete(
        self, body: dict[str, Any], timeout_s: float = 900, headers: dict[str, str] | None = None
    ) -> tuple[int, Any, dict[str, int]]:
        """POST /v1/completions through Serve's ingress (from the head host): the
        status, the JSON answer (or text) and the bytes each prefill host sent meanwhile
        (by host name)."""
        import httpx

        prefills = self.side_hosts(Side.PREFILL)
        sent = {name: host.bytes_sent() for name, host in prefills.items()}
        with self.hosts["head"].inside():
            r = httpx.post(
                self.url + "/v1/completions", json=body, timeout=timeout_s, headers=headers
            )
        link = {name: host.bytes_sent() - sent[name] for name, host in prefills.items()}
        try:
            answer = r.json()
        except ValueError:
            answer = r.text
        return r.status_code, answer, link

    def claims(self, side: Side) -> list[dict[str, Any]]:
        """Each credential claim of `side`'s pool: one per replica started."""
        return claims(self.pools[side])

    def pulls(self) -> list[Pull]:
        """Every pull the decode workers logged so far."""
        return [Pull(int(r), q, int(n), int(m)) for r, q, n, m in self._grep(PULLED)]

    def failed_pulls(self) -> list[tuple[str, ...]]:
        """(rank, request id, reason) of every failed pull logged so far."""
        return self._grep(PULL_FAILED)

    def _grep(self, pattern: re.Pattern[str]) -> list[tuple[str, ...]]:
        found = []
        for path in sorted((self.run / "r-decode").rglob("*")):
            if path.is_file() and path.suffix in (".out", ".err", ".log"):
                found += pattern.findall(path.read_text(errors="replace"))
        return found

    def replica_metric(self, host: str, name: str, **labels: str) -> dict[str, float]:
        """vLLM's series `name` (its own spelling, ``vllm:kv_cache_usage_perc``) as
        host `host`'s Ray node exports it: the samples whose labels include `labels`,
        summed by replica (Ray Serve's `ReplicaId` label). Ray names it ``ray_`` +
        `name` with every character outside ``[a-zA-Z0-9_]`` as ``_``, a counter's
        samples ending in ``_total``. The exposition read last is kept in the log
        directory (``metrics-HOST.txt``)."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        full = "ray_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)
        with self.hosts[host].inside():
            text = httpx.get(f"http://{self.hosts[host].address}:{METRICS_PORT}/metrics").text
        (self.log_dir / f"metrics-{host}.txt").write_text(text)
        by_replica: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in (full, full + "_total") and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    replica = sample.labels.get("ReplicaId", "")
                    by_replica[replica] = by_replica.get(replica, 0.0) + sample.value
        return by_replica

    def replica_pids(self, side: Side, host: str | None = None) -> list[int]:
        """This machine's pids of `side`'s replica actors (Ray names their processes
        ``ray::ServeReplica:APP:Prefill:MODEL``), on host `host` only if given."""
        tag = f"ServeReplica:{APP_NAME}:{side.value.capitalize()}:"
        hosts = [h for n, h in self.side_hosts(side).items() if host in (None, n)]
        found = []
        for pid in (p for h in hosts for p in h.pids()):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if tag in cmdline:
                found.append(pid)
        return found

    def kill_replica(self, side: Side, host: str | None = None) -> list[int]:
        """SIGKILL `side`'s replica actors (the process Ray Serve watches; vLLM's engine
        processes under it follow it down), on host `host` only if given; the pids
        killed."""
        pids = self.replica_pids(side, host)
        if not pids:
            where = [host] if host else list(self.side_hosts(side))
            raise ClusterError(f"no {side.value} replica runs on {where}")
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return pids

    def wait_for(self, what: str, check: Any, timeout_s: float, every_s: float = 2) -> Any:
        """Call `check()` until it returns something true; that value. Raises
        ClusterError naming `what` after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not (got := check()):
            if time.monotonic() > deadline:
                raise ClusterError(f"{what}: not within {timeout_s:.0f} s")
            time.sleep(every_s)
        return got

    def close(self) -> None:
        from kvbridge.vllm.launch import remove_orphaned_shm

        try:
            if self.net is not None:
                self.net.close()
        finally:
            self.net = None
            shutil.rmtree(self.run, ignore_errors=True)
            remove_orphaned_shm(self._shm_before)
