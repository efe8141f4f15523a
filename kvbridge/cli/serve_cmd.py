"""`kvbridge serve` and `kvbridge demo`: disaggregated serving behind an OpenAI API.

kvbridge serve                       proxy :8300 + prefill (tp 3) + decode (tp 9)
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
from kvbridge.engine.cpu_share import COMPUTE_NICE
from kvbridge.errors import ConfigError
from kvbridge.plan.layout import DEFAULT_BLOCK_SIZE, DEFAULT_LAYOUT, LAYOUT_HELP
from kvbridge.serve.config import Engine, InstanceConfig, ProxyConfig
from kvbridge.transfer.config import FanOut, KVExport
from kvbridge.transfer.integrity import SAMPLE_EVERY, Integrity

#: The flags' defaults are InstanceConfig's (the one declaration of each setting);
#: tests/serve/test_config.py checks every flag named after one of its fields.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(InstanceConfig)}
#: A whole deployment of the reference engine: prefill and decode tp.
DEFAULT_TP = {"prefill": 3, "decode": 9}
ENGINE_HELP = (
    "what runs the instances: kvbridge's reference engine (default) or vLLM with "
    "KVBridgeConnector (docs/vllm.md)"
)


def add_engine_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine",
        choices=[e.value for e in Engine],
        default=ProxyConfig.engine.value,
        help=ENGINE_HELP,
    )


def add_instance_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=_DEFAULTS["model"],
        help="a .gguf file, an HF directory, or smollm2-135m (default %(default)s)",
    )
    p.add_argument(
        "--host",
        default=_DEFAULTS["host"],
        help="address the HTTP server binds (default %(default)s)",
    )
    p.add_argument(
        "--kv-host",
        default=None,
        help="address of the KV side channel (default: --host); other hosts "
        "reach the prefill workers there",
    )
    p.add_argument(
        "--kv-port",
        type=int,
        default=_DEFAULTS["kv_port"],
        help="first side-channel port (worker r uses port+r; default: any free)",
    )
    p.add_argument(
        "--kv-load-failure",
        choices=["recompute", "fail"],
        default=_DEFAULTS["kv_load_failure"].value,
        help="when a KV pull fails: recompute the prompt on the decode instance "
        "(default) or answer an error",
    )
    p.add_argument(
        "--kv-integrity",
        choices=[m.value for m in Integrity],
        default=_DEFAULTS["kv_integrity"].value,
        help="decode: check each pulled request's bytes against the prefill's digest of "
        "them (a mismatch is a failed pull): on, off, or sample (one request in "
        f"{SAMPLE_EVERY}; default %(default)s)",
    )
    p.add_argument(
        "--kv-export",
        choices=[m.value for m in KVExport],
        default=_DEFAULTS["kv_export"].value,
        help="prefill: where decode workers read the KV from: an export process per worker "
        "that maps only the KV, read-only (process), the worker's own NIXL agent, which "
        "on CMA and TCP lets a peer holding the secret address the whole worker (inline), "
        "or process when a shared secret is set and inline otherwise (auto; default)",
    )
    p.add_argument(
        "--kv-fan-out",
        choices=[m.value for m in FanOut],
        default=_DEFAULTS["kv_fan_out"].value,
        help="decode: workers that need the same prefill bytes (decode tp above the KV "
        "heads, MLA) read them once per host, one worker over the link and the others "
        "copying from it on the host: from a prefill on another host (auto; default), "
        "always (on), or each worker reads its own (off)",
    )
    p.add_argument(
        "--cpu-priority",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS["cpu_priority"],
        help="on cores a prefill and a decode instance share, KV transfers first, then "
        "prefills, then decodes: the compute threads' nice value is raised by "
        f"{COMPUTE_NICE['prefill']} in a prefill instance and by {COMPUTE_NICE['decode']} in "
        "a decode instance (to at most 19), the KV transfer threads at the priority the "
        "instance was started with (as the colocated engine runs a prompt's prefill "
        "before its next decode step); alone on its cores an instance runs as fast "
        "(default: on)",
    )
    p.add_argument(
        "--lease-s",
        type=float,
        default=_DEFAULTS["lease_s"],
        help="prefill blocks are freed after this long at most if no decode pulls them "
        "(sooner when nobody took them: see --kv-claim-s; default %(default)s)",
    )
    p.add_argument(
        "--transfer-timeout-s",
        type=float,
        default=_DEFAULTS["transfer_timeout_s"],
        help="a KV pull not finished after this long fails (default %(default)s)",
    )
    p.add_argument(
        "--liveness-timeout-s",
        type=float,
        default=_DEFAULTS["liveness_timeout_s"],
        help="a KV pull fails when the prefill worker's side channel answered no heartbeat "
        "for this long (its host or the link is down; default %(default)s); a slow link that still "
        "answers is bounded by --transfer-timeout-s only",
    )
    p.add_argument(
        "--handshake-timeout-s",
        type=float,
        default=_DEFAULTS["handshake_timeout_s"],
        help="a first contact with a prefill instance not answered after this long fails "
        "(default %(default)s)",
    )
    p.add_argument(
        "--auth-token-file",
        "--kv-token-file",
        dest="kv_token_file",
        default=None,
        metavar="FILE",
        help="file holding the shared secret of the deployment (else KVBRIDGE_TRANSFER_TOKEN, "
        "else the file named by KVBRIDGE_TRANSFER_TOKEN_FILE): encrypts and "
        "authenticates the KV side channel, signs pull capabilities and every proxy -> "
        "instance call. Needed for any address other than loopback. `kvbridge serve` "
        "(all roles) makes one up for its run when none is given",
    )
    p.add_argument(
        "--kv-advertise-host",
        default=None,
        metavar="HOST",
        help="the address other hosts reach the KV side channel at (needed when --kv-host "
        "is 0.0.0.0); UCX is kept to the interface carrying it",
    )
    p.add_argument(
        "--tls-cert",
        default=None,
        metavar="PEM",
        help="certificate of an instance's internal API (HTTPS), with --tls-key. Without "
        "one, an instance whose --host other hosts can reach makes its own, certified by "
        "the shared token (the proxy trusts it); on loopback the API stays plain HTTP",
    )
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the --tls-cert's private key")
    p.add_argument(
        "--tls-ca",
        default=None,
        metavar="PEM",
        help="the proxy checks the instances' --tls-cert against these CAs, host names "
        "included (default: the shared token's deployment CA)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow an HTTP --host other hosts can reach without a shared token",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on the OpenAI API (/v1/...), like vLLM's "
        "--api-key (or set KVBRIDGE_API_KEY)",
    )
    p.add_argument(
        "--prefix-cache-isolation",
        choices=["none", "api-key", "user"],
        default=None,
        help="who shares cached prompt prefixes (the proxy): 'api-key' requests of one API "
        "key, 'user' requests naming the same OpenAI 'user', 'none' everyone; a request's "
        "'cache_salt' narrows it further (default: api-key with --api-key, else none)",
    )
    p.add_argument(
        "--hide-cached-tokens",
        action="store_true",
        help="leave usage.prompt_tokens_details.cached_tokens and kvbridge_stages out of "
        "responses (the proxy)",
    )
    p.add_argument(
        "--kv-cache-mb",
        type=int,
        default=_DEFAULTS["kv_cache_mb"],
        help="KV cache per worker (MiB; default %(default)s)",
    )
    p.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="turn automatic prefix caching off: every prompt is computed (prefill) and "
        "pulled (decode) whole",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        metavar="N",
        help="the most requests an instance holds at once (queued, running, streaming, "
        "and places reserved by the proxy); more are refused at once with 503 and "
        "Retry-After (default: twice the engine's max_num_seqs (16), at most one per two "
        "KV blocks)",
    )
    p.add_argument(
        "--kv-claim-s",
        type=float,
        default=_DEFAULTS["claim_s"],
        help="a decode instance must take a prefilled request's KV within this long "
        "(its pull capability expires); blocks nobody took are freed after this plus "
        "--transfer-timeout-s and 5 s (default %(default)s)",
    )
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=_DEFAULTS["max_body_mb"],
        help="largest request body the proxy and the instances accept, in MiB "
        "(default %(default)s); a larger one is refused with 413",
    )
    p.add_argument(
        "--start-timeout-s",
        type=float,
        default=900.0,
        help="give up if the instances are not ready after this long",
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model disaggregated (prefill -> decode) behind an OpenAI API",
        description="Start the OpenAI-compatible proxy with a prefill and a decode instance "
        "(or one role alone). Ctrl-C stops everything.",
    )
    p.add_argument("--role", choices=["all", "prefill", "decode", "proxy"], default="all")
    add_engine_argument(p)
    p.add_argument("--port", type=int, default=8300, help="HTTP port (default 8300; 0: any)")
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
    add_instance_arguments(p)
    p.set_defaults(handler=run_serve, extra="serve")

    d = sub.add_parser(
        "demo",
        help="start the default serve, ask it one question, check the answer, exit",
        description="Starts prefill tp 3 -> decode tp 9 (with --engine vllm: two vLLM "
        "instances with KVBridgeConnector, tp 1 -> tp 3, block 32), sends the prompt "
        "through the OpenAI API, prints the completion and the stages, and checks the "
        "text equals the same request generated colocated.",
    )
    d.add_argument("prompt", nargs="?", default="The capital of France is")
    d.add_argument("--max-tokens", type=int, default=10)
    add_engine_argument(d)
    for side, tp in DEFAULT_TP.items():
        d.add_argument(f"--{side}-tp", type=int, default=None, help=f"default {tp}")
        d.add_argument(f"--{side}-pp", type=int, default=1)
        d.add_argument(
            f"--{side}-block-size", type=int, default=None, help=f"default {DEFAULT_BLOCK_SIZE}"
        )
        d.add_argument(
            f"--{side}-layout", type=layout_arg, default=DEFAULT_LAYOUT, metavar="LAYOUT"
        )
    d.add_argument("--port", type=int, default=8300)
    add_instance_arguments(d)
    d.set_defaults(handler=run_demo, extra="serve")


def _check_pp(args: argparse.Namespace) -> None:
    for side in ("prefill", "decode"):
        pp = getattr(args, f"{side}_pp", 1)
        if pp != 1:
            raise ConfigError(
                f"--{side}-pp={pp}: the reference engine runs pp_size=1 only; "
                f"the planner and transfer runtime handle pp; use --{side}-pp 1 here"
            )


def instance_config(args: argparse.Namespace, side: str | None = None) -> Any:
    """The typed config of one instance: `side` of a full deployment ("prefill" or
    "decode", from the --prefill-*/--decode-* flags), or the single --role instance."""
    from kvbridge.serve.config import InstanceConfig, KVLoadFailure, Role

    if side is None:
        if args.tp is None:
            raise ConfigError(
                f"--role {args.role} needs --tp (the instance's tensor-parallel size)"
            )
        role, tp, block, layout = args.role, args.tp, args.block_size, args.layout
    else:
        role = side
        tp, block = getattr(args, f"{side}_tp"), getattr(args, f"{side}_block_size")
        layout = getattr(args, f"{side}_layout")
    return InstanceConfig(
        role=Role(role),
        tp_size=tp,
        model=args.model,
        block_size=block,
        cache_layout=layout,
        kv_cache_mb=args.kv_cache_mb,
        enable_prefix_caching=args.prefix_caching,
        host=args.host,
        port=args.port if side is None else 0,
        port_file=getattr(args, "port_file", None) if side is None else None,
        kv_host=args.kv_host,
        kv_port=args.kv_port,
        kv_token_file=args.kv_token_file,
        kv_advertise_host=args.kv_advertise_host,
        insecure=args.insecure,
        kv_load_failure=KVLoadFailure(args.kv_load_failure),
        kv_integrity=Integrity(args.kv_integrity),
        kv_export=KVExport(args.kv_export),
        kv_fan_out=FanOut(args.kv_fan_out),
        cpu_priority=args.cpu_priority,
        lease_s=args.lease_s,
        transfer_timeout_s=args.transfer_timeout_s,
        liveness_timeout_s=args.liveness_timeout_s,
        handshake_timeout_s=args.handshake_timeout_s,
        max_body_mb=args.max_body_mb,
        max_queued_requests=args.max_queued_requests,
        claim_s=args.kv_claim_s,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )


def deployment_config(args: argparse.Namespace) -> Any:
    from kvbridge.serve.config import DeploymentConfig

    _check_pp(args)
    for side in ("prefill", "decode"):
        n = getattr(args, f"{side}_instances", 1)
        if not 1 <= n <= 16:
            raise ConfigError(f"--{side}-instances {n} must be in [1, 16]")
    return DeploymentConfig(
        instance_config(args, "prefill"),
        instance_config(args, "decode"),
        args.host,
        args.port,
        args.start_timeout_s,
        api_key(args),
        tls_ca=args.tls_ca,
        **proxy_options(args),
    )


def api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get("KVBRIDGE_API_KEY") or None


def proxy_options(args: argparse.Namespace) -> dict[str, Any]:
    """The proxy's prefix-cache privacy settings (`serve.isolation`)."""
    from kvbridge.serve.isolation import PrefixCacheIsolation

    isolation = args.prefix_cache_isolation
    return {
        "prefix_cache_isolation": None if isolation is None else PrefixCacheIsolation(isolation),
        "hide_cached_tokens": args.hide_cached_tokens,
    }


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
    from kvbridge.serve.config import KVLoadFailure, ProxyConfig
    from kvbridge.serve.proxy_main import run_proxy

    if args.role == "proxy":
        if not args.decode:
            raise ConfigError(
                "--role proxy needs at least one --decode URL "
                "(and --prefill URLs for disaggregation)"
            )
        return run_proxy(
            ProxyConfig(
                args.model,
                tuple(args.prefill),
                tuple(args.decode),
                args.host,
                args.port,
                KVLoadFailure(args.kv_load_failure),
                args.max_body_mb,
                args.kv_token_file,
                api_key(args),
                args.insecure,
                engine=Engine(args.engine),
                tls_ca=args.tls_ca,
                **proxy_options(args),
            )
        )
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
