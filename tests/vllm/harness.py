"""Real vLLM servers (the CPU build, `.venv-vllm`) for the connector's tests.

`VLLMServer` starts `python -m vllm.entrypoints.openai.api_server` in a session of its
own (stopped by killing that process group), on 127.0.0.1, or as a test host's process
on its address (`kvbridge.harness.hosts`: asked from inside its network namespace), and
waits for /health.
`pd_completion` is vLLM's two-step P/D request as a proxy makes it: the prefill
instance with kv_transfer_params {"do_remote_decode": true} and max_tokens 1, then
the decode instance with the params the prefill returned.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from kvbridge.connector import RootKey
from kvbridge.serve.metrics import metric_value
from kvbridge.vllm.launch import (
    LOADED_HOST_SETTINGS,
    free_port,
    kv_transfer_config,
    new_credential_file,
    remove_credential_file,
    small_host_args,
    start,
    stop,
    vllm_command,
    vllm_env,
    wait_healthy,
    warm_up,
)

if TYPE_CHECKING:
    from kvbridge.harness.hosts import TestHost

ROOT = Path(__file__).resolve().parents[2]
#: the test deployment's root key: it enrolls every test instance (`credential_file`)
CREDENTIAL_ROOT = RootKey.generate()
MODELS = Path(os.environ.get("KVBRIDGE_VLLM_MODELS", ROOT / ".cache" / "vllm-models"))
#: the port a vLLM instance on a test host serves on (the host's address is its own)
HOST_PORT = 8000
#: "kvbridge decode worker R pulled ID: tokens [S, N), B bytes in T ms"
PULLED = re.compile(
    r"decode worker (\d+) pulled (\S+): tokens \[(\d+), (\d+)\), (\d+) bytes "
    r"\(\+(\d+) copied from a sibling\)"
)


@dataclass
class Pulled:
    rank: int
    start_token: int
    num_tokens: int
    nbytes: int  # read from the prefill
    local_nbytes: int  # copied from another decode worker of the instance (the fan-out)


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
        workers_on_host: int | None = None,
        vllm_args: tuple[str, ...] = (),
        pp_size: int = 1,
        traced: bool = False,
        on: TestHost | None = None,
    ) -> None:
        """`pp_size`: pipeline stages (each of `tp_size` workers); `traced`: vLLM's
        arguments for pipeline parallelism (`launch.small_host_args`), for both
        instances of a pair where either has stages; `on`: the test host it runs on
        (its output then goes to the host's log, not `log_path`; its connector binds
        the host's address only with `extra`'s `host`)."""
        self.on = on
        address = on.address if on is not None else "127.0.0.1"
        self.port = HOST_PORT if on is not None else free_port()
        self.url = f"http://{address}:{self.port}"
        self.model = str(MODELS / model)
        self.log_path = on.log_path if on is not None else log_path
        self.tp_size = tp_size
        kv = None
        self.credential_file: str | None = None
        if kv_role is not None:  # every test instance of one deployment (CREDENTIAL_ROOT)
            self.credential_file = new_credential_file(CREDENTIAL_ROOT, kv_role, model)
            settings = {**LOADED_HOST_SETTINGS, "credential_file": self.credential_file}
            settings |= extra or {}
            kv = kv_transfer_config(kv_role, settings, failure_policy)
        args = small_host_args(traced or pp_size > 1) + vllm_args
        if pp_size > 1:
            args += ("--pipeline-parallel-size", str(pp_size))
        cmd = vllm_command(self.model, self.port, tp_size, block_size, kv, *args, host=address)
        env = vllm_env(tp_size * pp_size, first_core, workers_on_host)
        env["PYTHONPATH"] = str(ROOT)
        self._log = None
        if on is not None:
            on.start(cmd, env)
            assert on.proc is not None
            self.proc = on.proc
        else:
            self._log = open(log_path, "wb")  # noqa: SIM115  (closed in stop)
            self.proc = start(cmd, env, self._log)

    @contextlib.contextmanager
    def reach(self) -> Iterator[None]:
        """Where this thread reaches the instance from: its test host's network, or here."""
        with self.on.inside() if self.on is not None else contextlib.nullcontext():
            yield

    def wait_ready(self, timeout_s: float = 600) -> None:
        """Healthy (`launch.wait_healthy`, its failures with the log), then warmed up."""
        try:
            with self.reach():
                wait_healthy(self.url, self.proc, timeout_s)
        except RuntimeError as exc:  # the process exited
            raise RuntimeError(f"vLLM: {exc}; log {self.log_path}:\n{self.log_tail()}") from None
        except TimeoutError as exc:
            raise TimeoutError(f"vLLM: {exc}; log {self.log_path}") from None
        with self.reach():
            warm_up(self.url, self.model)  # its first forward's one-off work done

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def pulled(self, since: int = 0) -> list[Pulled]:
        """The decode workers' pulls logged after byte `since` of the log."""
        text = self.log_text()[since:]
        return [
            Pulled(int(m[1]), int(m[3]), int(m[4]), int(m[5]), int(m[6]))
            for m in PULLED.finditer(text)
        ]

    def metric(self, name: str) -> float:
        """A series of vLLM's /metrics (`vllm:<name>`), summed over its labels."""
        with self.reach():
            text = httpx.get(self.url + "/metrics", timeout=30).text
        return metric_value(text, name, prefix="vllm:")

    def complete(self, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
            **extra,
        }
        with self.reach():
            r = httpx.post(self.url + "/v1/completions", json=body, timeout=600)
        assert r.status_code == 200, (r.status_code, r.text)
        return dict(r.json())

    def stop(self) -> None:
        if self.on is not None:
            self.on.kill()  # every process of the host, its private /dev/shm with them
        else:
            stop(self.proc)
        if self._log is not None:
            self._log.close()
        if self.credential_file:
            remove_credential_file(self.credential_file)


class Proxy:
    """`kvbridge serve --role proxy --engine vllm` in front of a prefill and a decode
    instance."""

    def __init__(self, prefill: VLLMServer, decode: VLLMServer, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = decode.model
        self._log = open(log_path, "wb")  # noqa: SIM115  (closed in stop)
        cmd = [sys.executable, "-m", "kvbridge.cli.main", "serve", "--role", "proxy"]
        cmd += ["--engine", "vllm", "--model", decode.model, "--prefill", prefill.url]
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
        body |= {"temperature": 0}
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


def through_proxy(
    prefill: VLLMServer, decode: VLLMServer, prompt: str, max_tokens: int, log_path: Path
) -> dict[str, Any]:
    """`prompt` sent through kvbridge's proxy in front of the pair, as a client would."""
    proxy = Proxy(prefill, decode, log_path)
    try:
        return proxy.complete(prompt, max_tokens)
    finally:
        proxy.stop()


def pd_completion(
    prefill: VLLMServer, decode: VLLMServer, prompt: str, max_tokens: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """vLLM's two-step P/D request; returns (prefill response, decode response)."""
    first = prefill.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})
    params = first.get("kv_transfer_params")
    assert params, f"the prefill instance returned no kv_transfer_params: {first}"
    out = decode.complete(prompt, max_tokens, kv_transfer_params=params)
    return first, out


def pd_token_exact(
    prefill: VLLMServer, decode: VLLMServer, prompt: str, max_tokens: int
) -> tuple[dict[str, Any], int]:
    """Both instances ready, vLLM's two-step P/D request, and its tokens checked equal to
    colocated vLLM's at the prefill's and the decode's settings (the same instances asked
    without kv_transfer_params, with a cache salt: nothing of the P/D request reused);
    returns the decode's response and where the decode log stood before the request."""
    prefill.wait_ready()
    decode.wait_ready()
    since = len(decode.log_text())
    first, out = pd_completion(prefill, decode, prompt, max_tokens)
    ref_p = prefill.complete(prompt, max_tokens, cache_salt="colocated")
    ref_d = decode.complete(prompt, max_tokens, cache_salt="colocated")
    assert token_ids(out) == token_ids(ref_p) == token_ids(ref_d), (
        text(out),
        text(ref_p),
        text(ref_d),
    )
    assert token_ids(first) == token_ids(out)[:1]
    return out, since


def token_ids(resp: dict[str, Any]) -> list[int]:
    return list(resp["choices"][0]["token_ids"])


def text(resp: dict[str, Any]) -> str:
    return str(resp["choices"][0]["text"])
