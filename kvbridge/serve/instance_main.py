"""Run one prefill or decode instance in this process: `kvbridge serve --role ...`, or
`python -m kvbridge.serve.instance_main CONFIG.json` for an instance a `Deployment`
launches (its `InstanceConfig` as one JSON document, `InstanceConfig.to_json`)."""

from __future__ import annotations

import os
import socket
import sys
import uuid
from pathlib import Path

import uvicorn

from kvbridge.engine.llm_engine import LLMEngine
from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.serve.config import InstanceConfig, Role
from kvbridge.serve.engine_loop import EngineLoop
from kvbridge.serve.instance import Instance
from kvbridge.transfer.connector import ConnectorRole, ConnectorSpec, GetEndpoint, SetEndpoints
from kvbridge.transfer.netdev import device_of


def _progress(stage: str, done: int, total: int) -> None:
    if not total:
        print(f"  {stage}", file=sys.stderr, flush=True)
    elif done == total or done % max(1, total // 10) == 0:
        print(f"  {stage}: {done}/{total}", file=sys.stderr, flush=True)


def run_instance(cfg: InstanceConfig) -> int:
    role = cfg.role
    instance_id = f"{role.value}-{uuid.uuid4().hex[:8]}"
    role_name = ConnectorRole.PRODUCER if role is Role.PREFILL else ConnectorRole.CONSUMER
    spec = ConnectorSpec(role=role_name, instance_id=instance_id, transfer=cfg.transfer_config())
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
    engine = LLMEngine(cfg.model, config, progress=_progress, connector=spec)
    endpoints = [reply.endpoint for reply in engine.connector_call(GetEndpoint())]
    if role is Role.PREFILL:
        engine.connector_call(SetEndpoints(endpoints))
    loop = EngineLoop(engine, world_size=cfg.tp_size).start()
    transfer = spec.transfer
    inst = Instance(
        loop,
        role,
        instance_id,
        cfg.model,
        cfg.kv_load_failure,
        max_body_bytes=cfg.max_body_bytes,
        token=transfer.token,
        claim_s=cfg.claim_s,
        exposure_lease_s=cfg.exposure_lease_s,
        max_queued_requests=cfg.max_queued_requests,
    )
    inst.endpoint = endpoints[0] if role is Role.PREFILL else ""
    devices = os.environ.get("UCX_NET_DEVICES") or device_of(transfer.reachable_host) or "all"
    security = (
        "shared token: encrypted, authenticated KV plane and signed internal calls"
        if transfer.token is not None
        else "NO shared token: anyone on this host may handshake and call the internal API"
    )
    print(
        f"[{instance_id}] serving on http://{cfg.host}:{port}"
        + (f", KV side channel {inst.endpoint}" if inst.endpoint else "")
        + f"; UCX devices {devices}; {security}",
        file=sys.stderr,
        flush=True,
    )
    try:
        server = uvicorn.Server(uvicorn.Config(inst.app(), log_level="warning"))
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
