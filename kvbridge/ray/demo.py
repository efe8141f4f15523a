"""`make demo-ray`: vLLM P/D with KVBridgeConnector, deployed by Ray Serve LLM over three
test hosts.

    python -m kvbridge.ray.demo          (root: the hosts are network namespaces)

starts a Ray cluster over three test hosts and deploys the P/D application on it
(`cluster.py`: prefill tp 1 on the prefill node, decode tp 3 on the decode node), sends
one completion through Serve's ingress and prints the answer, the node of each replica
(from its credential claim) and the KV the decode workers pulled over the link, with the
bytes the prefill host's link carried meanwhile. Then it stops every host and starts
colocated vLLM at the decode's settings, which must answer the same.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvbridge.ray.app import Side
from kvbridge.ray.cluster import MODEL_ID, ClusterConfig, ClusterError, RayCluster
from kvbridge.settings import DEFAULT_MODEL


@dataclass(frozen=True)
class RayDemoConfig:
    """The demo's question and sizes (SmolLM2-135M: tp 1, 3 or 9)."""

    prompt: str = "The capital of France is"
    max_tokens: int = 10
    prefill_tp: int = 1
    decode_tp: int = 3
    log_dir: str = ".cache/ray-demo"

    def __post_init__(self) -> None:
        from kvbridge.vllm.launch import check_tp

        for side in ("prefill", "decode"):
            check_tp(f"{side}_tp", getattr(self, f"{side}_tp"))


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
    from kvbridge.harness.hosts import missing
    from kvbridge.vllm.models import DEFAULT_DIR, make

    reason = missing()
    if reason:
        print(f"FAILED: {reason}")
        return 1
    model = str(make(DEFAULT_MODEL, DEFAULT_DIR).resolve())
    logs = Path(cfg.log_dir).resolve()
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    started = time.monotonic()
    body = {"model": MODEL_ID, "prompt": cfg.prompt, "max_tokens": cfg.max_tokens}
    body["temperature"] = 0
    cluster_cfg = ClusterConfig(model, cfg.prefill_tp, cfg.decode_tp)
    print("deploying (vLLM loads in 1-3 minutes per replica on this host) ...", flush=True)
    try:
        with RayCluster(cluster_cfg, logs) as cluster:
            print(f"deployed in {time.monotonic() - started:.0f} s", flush=True)
            for side in Side:
                for c in cluster.claims(side):
                    print(
                        f"{side.value}: replica {c['credential']} on node {c['node']} "
                        f"(host {c['hostname']})"
                    )
            print(f"$ curl {cluster.url}/v1/completions -d '{json.dumps(body)}'", flush=True)
            status, answer, link = cluster.complete(body)
            if status != 200:
                print(f"FAILED: Serve answered {status}: {str(answer)[:2000]}")
                return 1
            text = answer["choices"][0]["text"]
            print(f"completion: {cfg.prompt!r} -> {text!r}")
            pulls = cluster.pulls()
            ranks = sorted(p.rank for p in pulls)
            if ranks != list(range(cfg.decode_tp)):
                print(f"FAILED: decode workers {ranks} logged a pull; all {cfg.decode_tp} should")
                return 1
            over_link = sum(p.link_bytes for p in pulls)
            local = sum(p.sibling_bytes for p in pulls)
            print(
                f"KV: {over_link:,} bytes read over the link by {len(ranks)} decode workers "
                f"({local:,} copied between them on the decode host); the prefill host sent "
                f"{link['prefill']:,} bytes during the request (KV, Ray and HTTP)"
            )
    except ClusterError as exc:
        print(f"FAILED: {exc}")
        return 1
    print("Ray cluster stopped; colocated vLLM for the reference ...", flush=True)
    ref = colocated_answer(model, cfg.decode_tp, body, logs / "colocated.log")
    if ref != text:
        print(f"FAILED: colocated vLLM (tp {cfg.decode_tp}) answers {ref!r}")
        return 1
    print(f"check: identical to colocated vLLM (tp {cfg.decode_tp})")
    print(f"done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(demo(RayDemoConfig()))
