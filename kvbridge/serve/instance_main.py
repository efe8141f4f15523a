"""Run one prefill or decode instance in this process (`kvbridge serve --role ...`)."""

from __future__ import annotations

import argparse
import socket
import sys
import uuid
from pathlib import Path

import uvicorn

from kvbridge.engine.config import EngineConfig
from kvbridge.engine.llm_engine import LLMEngine
from kvbridge.errors import ConfigError
from kvbridge.serve.engine_loop import EngineLoop
from kvbridge.serve.instance import Instance, KVLoadFailure, Role
from kvbridge.transfer.config import TransferConfig, load_token
from kvbridge.transfer.connector import ConnectorRole, ConnectorSpec, GetEndpoint, SetEndpoints


def _progress(stage: str, done: int, total: int) -> None:
    if not total:
        print(f"  {stage}", file=sys.stderr, flush=True)
    elif done == total or done % max(1, total // 10) == 0:
        print(f"  {stage}: {done}/{total}", file=sys.stderr, flush=True)


def run_instance(args: argparse.Namespace) -> int:

    role = Role(args.role)
    if args.tp is None:
        raise ConfigError(f"--role {role.value} needs --tp (the instance's tensor-parallel size)")
    instance_id = f"{role.value}-{uuid.uuid4().hex[:8]}"
    transfer = TransferConfig(
        host=args.kv_host or args.host,
        base_port=args.kv_port,
        token=load_token(path=args.kv_token_file),
        lease_s=args.lease_s,
        transfer_timeout_s=args.transfer_timeout_s,
        handshake_timeout_s=args.handshake_timeout_s,
    )
    role_name = ConnectorRole.PRODUCER if role is Role.PREFILL else ConnectorRole.CONSUMER
    spec = ConnectorSpec(role=role_name, instance_id=instance_id, transfer=transfer)
    config = EngineConfig(
        tp_size=args.tp,
        block_size=args.block_size,
        cache_layout=args.layout,
        kv_cache_mb=args.kv_cache_mb,
    )
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        raise ConfigError(
            f"--port {args.port} on {args.host}: {exc.strerror}; choose a free port (0 picks one)"
        ) from None
    port = sock.getsockname()[1]
    if args.port_file:  # tell the launcher where we listen (atomically)
        tmp = Path(f"{args.port_file}.tmp")
        tmp.write_text(str(port))
        tmp.replace(args.port_file)
    print(f"[{instance_id}] loading {args.model} at tp {args.tp} ...", file=sys.stderr, flush=True)
    engine = LLMEngine(args.model, config, progress=_progress, connector=spec)
    endpoints = [reply.endpoint for reply in engine.connector_call(GetEndpoint())]
    if role is Role.PREFILL:
        engine.connector_call(SetEndpoints(endpoints))
    loop = EngineLoop(engine, world_size=args.tp).start()
    inst = Instance(loop, role, instance_id, args.model, KVLoadFailure(args.kv_load_failure))
    inst.endpoint = endpoints[0] if role is Role.PREFILL else ""
    print(
        f"[{instance_id}] serving on http://{args.host}:{port}"
        + (f", KV side channel {inst.endpoint}" if inst.endpoint else ""),
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
