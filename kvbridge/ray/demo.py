"""`make demo-ray`: vLLM P/D with KVBridgeConnector, deployed by Ray Serve LLM over three
test hosts.

    python -m kvbridge.ray.demo          (root: the hosts are network namespaces)

1. makes three test hosts (`kvbridge.harness.hosts`: a network namespace each, on one
   bridge, with private pids, IPC and /dev/shm) and a private run directory holding the
   shared secret (a file) and a pool of role credentials per deployment, enrolled by a
   root key that stays in this process (`enrollment.py`);
2. starts a Ray node on each host (`ray start --block`): the head (which runs Serve's
   controller, proxy and the OpenAI ingress), a prefill node and a decode node, each
   offering a custom resource that pins its deployment there;
3. deploys the P/D application (`app.py`, by the driver `deploy.py` on the head host):
   prefill tp 1 on the prefill node, decode tp 3 on the decode node;
4. sends one completion through Serve's ingress and prints the answer, the node of each
   replica (from its credential claim) and the KV the decode workers pulled, with the
   bytes the prefill host's link carried meanwhile;
5. stops every host (their processes and /dev/shm go with their namespaces), then starts
   colocated vLLM at the decode's settings and checks it answers the same.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvbridge.errors import ConfigError
from kvbridge.ray.app import Deployment, RayPDConfig, pd_serving_args
from kvbridge.ray.enrollment import claims, enroll_pool
from kvbridge.settings import DEFAULT_MODEL

#: a decode worker's log line for a finished pull (`connector/roles.py`): its rank, the
#: bytes it read over the link and those it copied from a sibling on its host
PULLED = re.compile(
    r"kvbridge decode worker (\d+) pulled \S+: tokens \[\d+, \d+\), (\d+) bytes "
    r"\(\+(\d+) copied from a sibling\)"
)
#: each host's custom resource (how many units: more than any bundle count here)
RESOURCES = {"head": "kvbridge_head", "prefill": "kvbridge_prefill", "decode": "kvbridge_decode"}
#: logical CPUs each Ray node declares: a tp-n deployment needs n + 1, the ingress 1, and
#: Serve's controller and proxy some; the 2 real cores are shared by all
NODE_CPUS = 16
#: credentials enrolled per deployment: each replica start takes one (restarts too)
POOL_SIZE = 4


@dataclass(frozen=True)
class RayDemoConfig:
    """The demo's question and sizes (SmolLM2-135M: tp 1, 3 or 9)."""

    prompt: str = "The capital of France is"
    max_tokens: int = 10
    prefill_tp: int = 1
    decode_tp: int = 3
    log_dir: str = ".cache/ray-demo"
    ray_port: int = 6379
    http_port: int = 8000
    deploy_timeout_s: float = 1800

    def __post_init__(self) -> None:
        for side in ("prefill", "decode"):
            if getattr(self, f"{side}_tp") not in (1, 3, 9):
                raise ConfigError(f"{side}_tp: SmolLM2-135M runs at tp 1, 3 or 9")


def ray_start(address: str, name: str, temp_dir: Path, head: str | None, port: int) -> list[str]:
    """Host `name`'s `ray start --block` command line: a node joining the head at `head`
    (HOST:PORT), or the head itself (on `port`) when `head` is None."""
    ray = str(Path(sys.executable).parent / "ray")
    cmd = [ray, "start", "--block", "--node-ip-address", address]
    cmd += ["--num-cpus", str(NODE_CPUS), "--resources", json.dumps({RESOURCES[name]: 16})]
    cmd += ["--temp-dir", str(temp_dir), "--disable-usage-stats"]
    if head is None:
        return [*cmd, "--head", "--port", str(port), "--include-dashboard=false"]
    return [*cmd, "--address", head]


def pulled(log_dir: Path) -> list[tuple[int, int, int]]:
    """(rank, link bytes, sibling bytes) of every pull logged under `log_dir`."""
    found = []
    for path in log_dir.rglob("*"):
        if path.is_file() and path.suffix in (".out", ".err", ".log"):
            text = path.read_text(errors="replace")
            found += [(int(r), int(n), int(m)) for r, n, m in PULLED.findall(text)]
    return found


def colocated_answer(model: str, tp_size: int, body: dict[str, object], log: Path) -> str:
    """The answer of one vLLM instance at `tp_size` with no connector (on this host)."""
    import httpx

    from kvbridge.connector import free_port
    from kvbridge.vllm.launch import (
        SMALL_HOST_ARGS,
        start,
        stop,
        vllm_command,
        vllm_env,
        wait_healthy,
    )

    port = free_port()
    cmd = vllm_command(model, port, tp_size, 32, None, *SMALL_HOST_ARGS)
    proc = start(cmd, vllm_env(tp_size), open(log, "wb"))  # noqa: SIM115
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, 900)
        r = httpx.post(url + "/v1/completions", json={**body, "model": model}, timeout=900)
        r.raise_for_status()
        return str(r.json()["choices"][0]["text"])
    finally:
        stop(proc)


def demo(cfg: RayDemoConfig) -> int:
    """Run it (module docstring); 0, or 1 naming what failed. Leaves no host, process,
    run directory or vLLM shared-memory file behind."""
    import httpx

    from kvbridge.connector import RootKey
    from kvbridge.harness.hosts import HostNetwork, missing
    from kvbridge.vllm.launch import remove_orphaned_shm, vllm_shm_files
    from kvbridge.vllm.models import DEFAULT_DIR, make

    reason = missing()
    if reason:
        print(f"FAILED: {reason}")
        return 1
    model = str(make(DEFAULT_MODEL, DEFAULT_DIR).resolve())
    logs = Path(cfg.log_dir).resolve()
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    shm_before = vllm_shm_files()
    run = Path(tempfile.mkdtemp(prefix="kvbridge-ray-"))  # 0700: secrets, pools, Ray's files
    started = time.monotonic()
    try:
        token_file = run / "token"
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        root = RootKey.generate()  # the deployment's: it stays in this process
        pools = {
            side: str(enroll_pool(root, kv_role, side, POOL_SIZE, run / f"pool-{side}"))
            for side, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer"))
        }
        app = RayPDConfig(
            model=model,
            prefill=Deployment(cfg.prefill_tp, RESOURCES["prefill"], pools["prefill"]),
            decode=Deployment(cfg.decode_tp, RESOURCES["decode"], pools["decode"]),
            token_file=str(token_file),
            ingress_resource=RESOURCES["head"],
        )
        doc = {
            "serving_args": pd_serving_args(app),
            "name": "kvbridge-pd",
            "http_port": cfg.http_port,
        }
        (run / "app.json").write_text(json.dumps(doc, indent=1))
        # Ray's files (its auth token in ~/.ray, sessions, logs) stay in the run directory
        env = {**os.environ, "HOME": str(run / "home"), "RAY_USAGE_STATS_ENABLED": "0"}
        with HostNetwork(log_dir=logs) as net:
            hosts = {name: net.add(name) for name in ("head", "prefill", "decode")}
            head_address = f"{hosts['head'].address}:{cfg.ray_port}"
            for name, host in hosts.items():
                head = None if name == "head" else head_address
                host.start(
                    ray_start(host.address, name, run / f"r-{name}", head, cfg.ray_port), env
                )
                print(f"{name}: Ray node at {host.address} (log {host.log_path})", flush=True)
                if name == "head":
                    time.sleep(5)
            print("deploying (vLLM loads in 1-3 minutes per replica on this host) ...", flush=True)
            deploy = ["ip", "netns", "exec", hosts["head"].netns, sys.executable]
            deploy += ["-m", "kvbridge.ray.deploy", str(run / "app.json")]
            deploy += ["--address", head_address, "--num-nodes", str(len(hosts))]
            with open(logs / "deploy.log", "wb") as log:
                done = subprocess.run(
                    deploy, env=env, stdout=log, stderr=subprocess.STDOUT,
                    timeout=cfg.deploy_timeout_s, check=False,
                )  # fmt: skip
            if done.returncode != 0:
                tail = (logs / "deploy.log").read_text(errors="replace")[-3000:]
                print(f"FAILED: the deployment exited {done.returncode}:\n{tail}")
                return 1
            print(f"deployed in {time.monotonic() - started:.0f} s", flush=True)
            for side, pool in pools.items():
                for c in claims(pool):
                    print(
                        f"{side}: replica {c['credential']} on node {c['node']} ({c['hostname']})"
                    )
            body = {"model": "smollm2", "prompt": cfg.prompt, "max_tokens": cfg.max_tokens}
            body["temperature"] = 0
            url = f"http://{hosts['head'].address}:{cfg.http_port}/v1/completions"
            print(f"$ curl {url} -d '{json.dumps(body)}'", flush=True)
            sent = hosts["prefill"].bytes_sent()
            with hosts["head"].inside():
                r = httpx.post(url, json=body, timeout=900)
            link = hosts["prefill"].bytes_sent() - sent
            if r.status_code != 200:
                print(f"FAILED: Serve answered {r.status_code}: {r.text[:2000]}")
                return 1
            text = r.json()["choices"][0]["text"]
            print(f"completion: {cfg.prompt!r} -> {text!r}")
            pulls = pulled(run / "r-decode")
            ranks = sorted(rank for rank, _, _ in pulls)
            if ranks != list(range(cfg.decode_tp)):
                print(f"FAILED: decode workers {ranks} logged a pull; all {cfg.decode_tp} should")
                return 1
            over_link = sum(n for _, n, _ in pulls)
            local = sum(m for _, _, m in pulls)
            print(
                f"KV: {over_link:,} bytes read over the link from the prefill host, {local:,} "
                f"copied on the decode host; the prefill host sent {link:,} bytes meanwhile"
            )
        print("Ray cluster stopped; colocated vLLM for the reference ...", flush=True)
        ref = colocated_answer(model, cfg.decode_tp, {**body}, logs / "colocated.log")
        if ref != text:
            print(f"FAILED: colocated vLLM (tp {cfg.decode_tp}) answers {ref!r}")
            return 1
        print(f"check: identical to colocated vLLM (tp {cfg.decode_tp})")
        print(f"done in {time.monotonic() - started:.0f} s")
        return 0
    finally:
        shutil.rmtree(run, ignore_errors=True)
        left = remove_orphaned_shm(shm_before)
        if left:
            print(f"removed {len(left)} leftover vLLM files from /dev/shm")


if __name__ == "__main__":
    sys.exit(demo(RayDemoConfig()))
