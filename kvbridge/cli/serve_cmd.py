"""`kvbridge serve` and `kvbridge demo`: disaggregated serving behind an OpenAI API.

kvbridge serve                       proxy + prefill (tp 3) + decode (tp 9)
kvbridge serve --role prefill --tp 3 --port 8301
kvbridge serve --role decode  --tp 9 --port 8302
kvbridge serve --role proxy --prefill https://h1:8301 --decode https://h2:8302
kvbridge serve --role proxy --engine vllm --prefill http://h1:8100 --decode http://h2:8200
kvbridge demo [--engine vllm]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import secrets
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from kvbridge.bench.engine_args import layout_arg
from kvbridge.cli.settings_args import add_arguments, config_from_args
from kvbridge.engine.config import EngineConfig
from kvbridge.errors import ConfigError
from kvbridge.plan.cast import CASTABLE
from kvbridge.plan.layout import DEFAULT_BLOCK_SIZE, DEFAULT_LAYOUT, LAYOUT_HELP
from kvbridge.serve.config import (
    API_KEY_ENV,
    DeploymentConfig,
    Engine,
    InstanceConfig,
    ProxyConfig,
    Role,
)
from kvbridge.settings import Setting, flagged

#: The flags of `kvbridge serve` and `kvbridge demo` that are a config's settings, each
#: declared once, by its field (`kvbridge.settings`); docs/serving.md's table of them is
#: rendered from this list (tests/test_settings_docs.py).
SETTINGS = flagged(InstanceConfig, ProxyConfig, DeploymentConfig)
#: A whole deployment of the reference engine: prefill and decode tp.
DEFAULT_TP = {"prefill": 3, "decode": 9}


def _settings(*names: str, but: bool = False) -> list[Setting]:
    """The SETTINGS named (`but`: all but those), in their order."""
    return [s for s in SETTINGS if (s.name in names) != but]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model disaggregated (prefill -> decode) behind an OpenAI API",
        description="Start the OpenAI-compatible proxy with a prefill and a decode instance "
        "(or one role alone). Ctrl-C stops everything.",
    )
    p.add_argument("--role", choices=["all", "prefill", "decode", "proxy"], default="all")
    add_arguments(p, _settings("engine", "port"))
    p.add_argument("--port-file", default=None, help=argparse.SUPPRESS)  # launcher-internal
    for side, tp in DEFAULT_TP.items():
        p.add_argument(f"--{side}-tp", type=int, default=tp, help=f"{side} tp (default {tp})")
        p.add_argument(f"--{side}-pp", type=int, default=1, help=f"{side} pp (1 only for now)")
        p.add_argument(f"--{side}-block-size", type=int, default=DEFAULT_BLOCK_SIZE)
        p.add_argument(
            f"--{side}-layout",
            type=layout_arg,
            default=DEFAULT_LAYOUT,
            metavar="LAYOUT",
            help=f"{side} cache layout (default {DEFAULT_LAYOUT}; see --layout)",
        )
        p.add_argument(
            f"--{side}-kv-cache-dtype",
            default=EngineConfig.kv_dtype,
            metavar="DTYPE",
            help=f"{side} KV cache dtype (default {EngineConfig.kv_dtype}; see --kv-cache-dtype)",
        )
        p.add_argument(
            f"--{side}-instances",
            type=int,
            default=1,
            metavar="N",
            help=f"{side} instances to start (default 1); the proxy routes each request to "
            "the one whose prefix cache holds most of its prompt, else the least loaded",
        )
    p.add_argument("--tp", type=int, default=None, help="tp of a single prefill/decode role")
    p.add_argument(
        "--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="block size of a single role"
    )
    p.add_argument(
        "--layout",
        "--cache-layout",
        type=layout_arg,
        default=DEFAULT_LAYOUT,
        metavar="LAYOUT",
        help=f"{LAYOUT_HELP} (of a single role)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=EngineConfig.kv_dtype,
        metavar="DTYPE",
        help=f"KV cache dtype of a single role: {', '.join(CASTABLE)} (default "
        f"{EngineConfig.kv_dtype}; the model computes in float32, K and V are cast on write); "
        "a decode instance converts KV pulled from a prefill instance of another dtype",
    )
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="prefill instance URL (role proxy; repeat for round-robin)",
    )
    p.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL",
        help="decode instance URL (role proxy; repeat for round-robin)",
    )
    add_arguments(p, _settings("engine", "port", but=True))
    p.set_defaults(handler=run_serve, extra="serve")

    d = sub.add_parser(
        "demo",
        help="start the default serve, ask it one question, check the answer, exit",
        description=f"Starts prefill tp {DEFAULT_TP['prefill']} -> decode tp {DEFAULT_TP['decode']} "
        "(with --engine vllm: two vLLM "
        "instances with KVBridgeConnector, tp 1 -> tp 3, block 32), sends the prompt "
        "through the OpenAI API, prints the completion and the stages, and checks the "
        "text equals the same request generated colocated.",
    )
    d.add_argument("prompt", nargs="?", default="The capital of France is")
    d.add_argument("--max-tokens", type=int, default=10)
    add_arguments(d, _settings("engine"))
    for side, tp in DEFAULT_TP.items():
        d.add_argument(f"--{side}-tp", type=int, default=None, help=f"default {tp}")
        d.add_argument(f"--{side}-pp", type=int, default=1)
        d.add_argument(
            f"--{side}-block-size", type=int, default=None, help=f"default {DEFAULT_BLOCK_SIZE}"
        )
        d.add_argument(
            f"--{side}-layout", type=layout_arg, default=DEFAULT_LAYOUT, metavar="LAYOUT"
        )
        d.add_argument(
            f"--{side}-kv-cache-dtype",
            default=EngineConfig.kv_dtype,
            metavar="DTYPE",
            help=f"{side} KV cache dtype: {', '.join(CASTABLE)} (default {EngineConfig.kv_dtype})",
        )
    add_arguments(d, _settings("engine", but=True))
    d.set_defaults(handler=run_demo, extra="serve")


def _check_pp(args: argparse.Namespace) -> None:
    for side in ("prefill", "decode"):
        pp = getattr(args, f"{side}_pp", 1)
        if pp != 1:
            raise ConfigError(
                f"--{side}-pp={pp}: the reference engine runs pp_size=1 only; "
                f"the planner and transfer runtime handle pp; use --{side}-pp 1 here"
            )


def instance_config(args: argparse.Namespace, side: str | None = None) -> InstanceConfig:
    """The typed config of one instance: `side` of a full deployment ("prefill" or
    "decode", from the --prefill-*/--decode-* flags), or the single --role instance."""
    if side is None:
        if args.tp is None:
            raise ConfigError(
                f"--role {args.role} needs --tp (the instance's tensor-parallel size)"
            )
        return config_from_args(
            InstanceConfig,
            args,
            role=Role(args.role),
            tp_size=args.tp,
            block_size=args.block_size,
            cache_layout=args.layout,
            kv_cache_dtype=args.kv_cache_dtype,
            port=args.port,
            port_file=getattr(args, "port_file", None),
        )
    return config_from_args(
        InstanceConfig,
        args,
        role=Role(side),
        tp_size=getattr(args, f"{side}_tp"),
        block_size=getattr(args, f"{side}_block_size"),
        cache_layout=getattr(args, f"{side}_layout"),
        kv_cache_dtype=getattr(args, f"{side}_kv_cache_dtype"),
    )


def deployment_config(args: argparse.Namespace) -> DeploymentConfig:
    _check_pp(args)
    if getattr(args, "credential_file", None):
        raise ConfigError(
            f"--credential-file {args.credential_file} names one instance's credential; "
            "`kvbridge serve` with all roles enrolls each instance it starts: leave it out, "
            "or start each role with --role and its own --credential-file"
        )
    for side in ("prefill", "decode"):
        n = getattr(args, f"{side}_instances", 1)
        if not 1 <= n <= 16:
            raise ConfigError(f"--{side}-instances {n} must be in [1, 16]")
    return config_from_args(
        DeploymentConfig,
        args,
        prefill=instance_config(args, "prefill"),
        decode=instance_config(args, "decode"),
        api_key=api_key(args),
    )


def proxy_config(args: argparse.Namespace) -> ProxyConfig:
    """The config of --role proxy, in front of the --prefill and --decode URLs."""
    return config_from_args(
        ProxyConfig,
        args,
        model=args.model,
        prefill_urls=tuple(args.prefill),
        decode_urls=tuple(args.decode),
        api_key=api_key(args),
    )


def api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get(API_KEY_ENV) or None


@contextlib.contextmanager
def deployment_token(args: argparse.Namespace) -> Iterator[None]:
    """A whole deployment authenticates its KV plane and internal calls even when the
    user gave no secret: make one up for this run, in a file only we can read (0600),
    for the instances we start; remove it at the end. A secret the user gave in any of
    the ways `load_token` reads (the flag, KVBRIDGE_TRANSFER_TOKEN,
    KVBRIDGE_TRANSFER_TOKEN_FILE) is used as it is: the instances read it the same way."""
    from kvbridge.transfer.config import load_token

    if load_token(path=args.kv_token_file) is not None:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="kvbridge-") as tmp:
        path = os.path.join(tmp, "token")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        args.kv_token_file = path
        try:
            yield
        finally:
            args.kv_token_file = None


def run_serve(args: argparse.Namespace) -> int:
    if Engine(args.engine) is Engine.VLLM and args.role != "proxy":
        raise ConfigError(
            f"--engine vllm with --role {args.role}: kvbridge serves the proxy in front of "
            "vLLM instances (--role proxy --engine vllm --prefill URL --decode URL); start "
            "the instances with vLLM itself and KVBridgeConnector (docs/vllm.md), or try "
            "`kvbridge demo --engine vllm`"
        )
    if args.role in ("prefill", "decode"):
        from kvbridge.serve.instance_main import run_instance

        return run_instance(instance_config(args))
    from kvbridge.serve.proxy_main import run_proxy

    if args.role == "proxy":
        if not args.decode:
            raise ConfigError(
                "--role proxy needs at least one --decode URL "
                "(and --prefill URLs for disaggregation)"
            )
        return run_proxy(proxy_config(args))
    with deployment_token(args):
        return _run_deployment(args, run_proxy)


def _run_deployment(args: argparse.Namespace, run_proxy: Any) -> int:
    cfg = deployment_config(args)
    from kvbridge.serve.launcher import Deployment

    dep = Deployment(verify=cfg.instance_tls())
    try:
        urls: dict[str, list[str]] = {"prefill": [], "decode": []}
        for side, inst, count in (
            ("prefill", cfg.prefill, args.prefill_instances),
            ("decode", cfg.decode, args.decode_instances),
        ):
            for i in range(count):
                name = side if count == 1 else f"{side}{i}"
                urls[side].append(
                    dep.start_instance(name, dataclasses.replace(inst, host=cfg.host)).url
                )
        print(
            f"loading {cfg.prefill.model}: {args.prefill_instances} x prefill tp "
            f"{cfg.prefill.tp_size}, {args.decode_instances} x decode tp "
            f"{cfg.decode.tp_size} ...",
            file=sys.stderr,
        )
        dep.wait_healthy(cfg.start_timeout_s, say=lambda s: print(s, file=sys.stderr))
        return run_proxy(cfg.proxy(urls["prefill"], urls["decode"]))
    finally:
        dep.stop()


def fill_demo_defaults(args: argparse.Namespace) -> None:
    """The reference engine's demo sizes for the flags left unset (each engine has its
    own: `kvbridge.vllm.launch.VLLMDemoConfig` for vLLM)."""
    for side, tp in DEFAULT_TP.items():
        if getattr(args, f"{side}_tp") is None:
            setattr(args, f"{side}_tp", tp)
        if getattr(args, f"{side}_block_size") is None:
            setattr(args, f"{side}_block_size", DEFAULT_BLOCK_SIZE)


def run_demo(args: argparse.Namespace) -> int:
    if Engine(args.engine) is Engine.VLLM:
        return _run_vllm_demo(args)
    from kvbridge.serve.demo import demo

    fill_demo_defaults(args)
    with deployment_token(args):
        return demo(deployment_config(args), args.prompt, args.max_tokens)


def _run_vllm_demo(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            f"--engine vllm runs vLLM from this Python ({sys.executable}), which has no "
            "vllm: `make demo-vllm` builds vLLM's CPU build in .venv-vllm and runs "
            "`.venv-vllm/bin/kvbridge demo --engine vllm` there"
        )
    from kvbridge.vllm.launch import VLLMDemoConfig, demo

    for side in ("prefill", "decode"):
        for flag, default in (("pp", 1), ("layout", DEFAULT_LAYOUT)):
            value = getattr(args, f"{side}_{flag}")
            if value != default:
                raise ConfigError(
                    f"--{side}-{flag} {value} with --engine vllm: the vLLM demo runs "
                    "pp 1 and vLLM's own cache layout; leave the flag out"
                )

    if not args.cpu_priority:
        raise ConfigError(
            "--no-cpu-priority with --engine vllm: vLLM runs its own processes, kvbridge "
            "sets no CPU priority for them; leave the flag out"
        )
    given = {
        f: getattr(args, f)
        for f in ("prefill_tp", "decode_tp", "prefill_block_size", "decode_block_size")
        if getattr(args, f) is not None
    }
    return demo(VLLMDemoConfig(prompt=args.prompt, max_tokens=args.max_tokens, **given))
