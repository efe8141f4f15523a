"""Run one prefill or decode instance in this process: `kvbridge serve --role ...`, or
`python -m kvbridge.serve.instance_main CONFIG.json` for an instance a `Deployment`
launches (its `InstanceConfig` as one JSON document, `InstanceConfig.to_json`)."""

from __future__ import annotations

import os
import signal
import socket
import sys
import uuid
from pathlib import Path

import uvicorn

from kvbridge.connector import (
    ConnectorSpec,
    Identity,
    KVConnectorConfig,
    is_loopback,
    net_device_of,
)
from kvbridge.engine.cpu_share import compute_nice
from kvbridge.engine.llm_engine import LLMEngine
from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.serve.config import InstanceConfig, Role
from kvbridge.serve.engine_loop import EngineLoop
from kvbridge.serve.instance import Instance
from kvbridge.serve.instance_app import build_app
from kvbridge.serve.proxy_main import reach
from kvbridge.serve.tls import server_files


def _progress(stage: str, done: int, total: int) -> None:
    if not total:
        print(f"  {stage}", file=sys.stderr, flush=True)
    elif done == total or done % max(1, total // 10) == 0:
        print(f"  {stage}: {done}/{total}", file=sys.stderr, flush=True)


def _server_config(cfg: InstanceConfig, inst: Instance) -> uvicorn.Config:
    """uvicorn's config of the internal API, loaded (with its certificate, if HTTPS:
    a key `tls.server_files` made is on disk only while it loads)."""
    app = build_app(inst)
    if not cfg.serves_tls:
        config = uvicorn.Config(app, log_level="warning")
        config.load()
        return config
    names = [cfg.host, cfg.kv_advertise_host or "", socket.gethostname(), "localhost", "127.0.0.1"]
    with server_files(cfg.token(), cfg.tls_cert, cfg.tls_key, names) as (cert, key):
        config = uvicorn.Config(app, log_level="warning", ssl_certfile=cert, ssl_keyfile=key)
        config.load()
    return config


def _cpu(increment: int, started: int) -> str:
    """The CPU priorities of an instance started at nice `started` (cpu_share.py)."""
    compute = compute_nice(increment, started)
    if compute == started:
        return f"compute and KV transfers at CPU nice {started} (as started)"
    return f"compute at CPU nice {compute}, KV transfers at {started} (as started)"


def run_instance(cfg: InstanceConfig) -> int:
    # a launched instance is in a background process group of the launcher's terminal:
    # with `stty tostop`, its first write there would stop it
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    started_nice = os.getpriority(os.PRIO_PROCESS, 0)  # (tp 1 lowers this thread's)
    role = cfg.role
    credential = cfg.credential()
    if credential is not None:  # its id names its key: nobody else can act as it
        instance_id, packed, identity = credential.instance_id, credential.packed(), ""
    elif role is Role.PREFILL:
        instance_id, packed, identity = f"{role.value}-{uuid.uuid4().hex[:8]}", b"", ""
    else:  # a key pair of its own, which its id names: nobody else can pull as it
        key = Identity.generate()
        instance_id, packed, identity = key.bind(role.value), b"", key.secret.decode()
    transfer = cfg.transfer_config()
    spec = ConnectorSpec(cfg.connector_role, instance_id, transfer, packed, identity)
    config = cfg.engine_config()
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.host, cfg.port))
    except OSError as exc:
        raise ConfigError(
            f"--port {cfg.port} on {cfg.host}: {exc.strerror}; choose a free port (0 picks one)"
        ) from None
    port = sock.getsockname()[1]
    if cfg.port_file:  # tell the launcher where we listen (atomically)
        tmp = Path(f"{cfg.port_file}.tmp")
        tmp.write_text(str(port))
        tmp.replace(cfg.port_file)
    print(
        f"[{instance_id}] loading {cfg.model} at tp {cfg.tp_size} ...", file=sys.stderr, flush=True
    )
    connector = KVConnectorConfig(
        spec,
        claim_s=cfg.claim_s,
        exposure_lease_s=cfg.exposure_lease_s,
        kv_load_failure=cfg.kv_load_failure,
    )
    engine = LLMEngine(cfg.model, config, progress=_progress, connector=connector)
    loop = EngineLoop(engine, world_size=cfg.tp_size).start()
    transfer = spec.transfer
    inst = Instance(
        loop,
        role,
        instance_id,
        cfg.model,
        max_body_bytes=cfg.max_body_bytes,
        token=transfer.token,
        max_queued_requests=cfg.max_queued_requests,
    )
    devices = os.environ.get("UCX_NET_DEVICES") or net_device_of(transfer.reachable_host) or "all"
    who = "anyone on this host" if is_loopback(cfg.host) else f"anyone who can reach {cfg.host}"
    security = (
        "shared token: encrypted, authenticated KV plane and signed internal calls"
        if transfer.token is not None
        else f"NO shared token: {who} may call the internal API, anyone on this host may "
        "handshake with the KV side channel"
    )
    if role is Role.PREFILL:
        security += (
            "; peers read the KV from an export process per worker (only the KV, "
            "read-only, sandboxed)"
            if spec.exports_kv
            else "; peers read the KV from each worker's own NIXL agent (--kv-export inline)"
        )
    if cfg.serves_tls:
        security += (
            "; internal API over TLS ("
            + ("--tls-cert" if cfg.tls_cert else "certified by the deployment's token")
            + ")"
        )
    print(
        f"[{instance_id}] internal API on {cfg.scheme}://{cfg.host}:{port} ({reach(cfg.host)})"
        + (f", KV side channel {inst.endpoint}" if inst.endpoint else "")
        + f"; UCX devices {devices}; {security}; {_cpu(config.cpu_nice, started_nice)}",
        file=sys.stderr,
        flush=True,
    )
    try:
        server = uvicorn.Server(_server_config(cfg, inst))
        server.run(sockets=[sock])
    finally:
        loop.stop()
        engine.shutdown()
    return 0


def main(argv: list[str]) -> int:
    """Entry point of a launched instance: argv is the path of its config document."""
    if len(argv) != 1:
        print("usage: python -m kvbridge.serve.instance_main CONFIG.json", file=sys.stderr)
        return 2
    try:
        data = Path(argv[0]).read_bytes()
    except OSError as exc:
        print(f"kvbridge instance: error: cannot read config {argv[0]}: {exc}", file=sys.stderr)
        return 2
    try:
        return run_instance(InstanceConfig.from_json(data))
    except KVBridgeError as exc:
        print(f"kvbridge instance: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
