"""Real vLLM servers (the CPU build, `.venv-vllm`) for the connector's tests.

`VLLMServer` starts `python -m vllm.entrypoints.openai.api_server` in a session of its
own (stopped by killing that process group), on 127.0.0.1, and waits for /health.
`pd_completion` is vLLM's two-step P/D request as a proxy makes it: the prefill
instance with kv_transfer_params {"do_remote_decode": true} and max_tokens 1, then
the decode instance with the params the prefill returned.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
MODELS = Path(os.environ.get("KVBRIDGE_VLLM_MODELS", ROOT / ".cache" / "vllm-models"))
#: "kvbridge decode worker R pulled ID: tokens [S, N), B bytes in T ms"
PULLED = re.compile(r"decode worker (\d+) pulled (\S+): tokens \[(\d+), (\d+)\), (\d+) bytes")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def omp_bind(tp_size: int, first_core: int) -> str:
    """One core per TP rank, alternating over this machine's two (one NUMA node)."""
    ncores = os.cpu_count() or 1
    return "|".join(str((first_core + r) % ncores) for r in range(tp_size))


@dataclass
class Pulled:
    rank: int
    start_token: int
    num_tokens: int
    nbytes: int


class VLLMServer:
    """One vLLM instance with KVBridgeConnector (or none: `kv_role=None`)."""

    def __init__(
        self,
        model: str,
        tp_size: int,
        block_size: int,
        log_path: Path,
        kv_role: str | None = "kv_both",
        extra: dict[str, Any] | None = None,
        first_core: int = 0,
        failure_policy: str = "fail",
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(MODELS / model)
        self.log_path = log_path
        self.tp_size = tp_size
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--tensor-parallel-size",
            str(tp_size),
            "--block-size",
            str(block_size),
            "--dtype",
            "float32",
            "--max-model-len",
            "1024",
            "--max-num-seqs",
            "4",
            "--seed",
            "0",
            "--enforce-eager",
            # a small cache: fewer descriptors to prepare per peer on a loaded 2-core host
            "--num-gpu-blocks-override",
            "128",
            "--disable-log-stats",
        ]
        if kv_role is not None:
            kv = {
                "kv_connector": "KVBridgeConnector",
                "kv_connector_module_path": "kvbridge.vllm",
                "kv_role": kv_role,
                "kv_load_failure_policy": failure_policy,
                "kv_connector_extra_config": {
                    "lease_s": 300,
                    "transfer_timeout_s": 120,
                    "handshake_timeout_s": 60,
                    "liveness_timeout_s": 60,
                    **(extra or {}),
                },
            }
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        env = dict(os.environ)
        env.update(
            PYTHONPATH=str(ROOT),
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND=omp_bind(tp_size, first_core),
            VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS="900",
            VLLM_ENGINE_READY_TIMEOUT_S="900",
            NIXL_LOG_LEVEL="WARN",
            TOKENIZERS_PARALLELISM="false",
        )
        self._log = open(log_path, "wb")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_ready(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with {self.proc.returncode}; log {self.log_path}:\n"
                    + self.log_tail()
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"vLLM not ready after {timeout_s} s; log {self.log_path}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def pulled(self, since: int = 0) -> list[Pulled]:
        """The decode workers' pulls logged after byte `since` of the log."""
        text = self.log_text()[since:]
        return [Pulled(int(m[1]), int(m[3]), int(m[4]), int(m[5])) for m in PULLED.finditer(text)]

    def complete(self, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
            **extra,
        }
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=600)
        assert r.status_code == 200, (r.status_code, r.text)
        return dict(r.json())

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):  # workers that outlived the server
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


class Proxy:
    """`python -m kvbridge.vllm.proxy` in front of a prefill and a decode instance."""

    def __init__(self, prefill: VLLMServer, decode: VLLMServer, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = decode.model
        self._log = open(log_path, "wb")  # noqa: SIM115  (closed in stop)
        cmd = [sys.executable, "-m", "kvbridge.vllm.proxy", "--prefill", prefill.url]
        cmd += ["--decode", decode.url, "--port", str(self.port)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                httpx.get(self.url + "/health", timeout=5)
                return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise RuntimeError(f"proxy did not start; log {log_path}")

    def complete(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens}
        body |= {"temperature": 0, "return_token_ids": True}
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=600)
        assert r.status_code == 200, (r.status_code, r.text)
        return dict(r.json())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


def pd_completion(
    prefill: VLLMServer, decode: VLLMServer, prompt: str, max_tokens: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """vLLM's two-step P/D request; returns (prefill response, decode response)."""
    first = prefill.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})
    params = first.get("kv_transfer_params")
    assert params, f"the prefill instance returned no kv_transfer_params: {first}"
    out = decode.complete(prompt, max_tokens, kv_transfer_params=params)
    return first, out


def token_ids(resp: dict[str, Any]) -> list[int]:
    return list(resp["choices"][0]["token_ids"])


def text(resp: dict[str, Any]) -> str:
    return str(resp["choices"][0]["text"])
