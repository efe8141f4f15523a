"""`--max-body-mb` travels from the command line into every typed config, and on to a
launched instance's own command line."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest

from kvbridge.cli.main import build_parser
from kvbridge.cli.serve_cmd import DEFAULT_TP, deployment_config, fill_demo_defaults
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.cpu_share import COMPUTE_NICE
from kvbridge.errors import ConfigError
from kvbridge.plan.layout import DEFAULT_BLOCK_SIZE
from kvbridge.serve.config import InstanceConfig, KVLoadFailure, Role
from kvbridge.transfer.config import TransferConfig


def test_max_body_mb_reaches_proxy_and_instances() -> None:
    args = build_parser().parse_args(["serve", "--max-body-mb", "2.5"])
    cfg = deployment_config(args)
    assert cfg.prefill.max_body_mb == cfg.decode.max_body_mb == 2.5
    proxy = cfg.proxy(["http://p"], ["http://d"])
    assert proxy.max_body_bytes == int(2.5 * 2**20)
    # a launched instance decodes its config document back into the same config
    assert InstanceConfig.from_json(cfg.decode.to_json()) == cfg.decode
    assert InstanceConfig(cfg.decode.role, 1).max_body_mb == 16.0  # the default


def test_instance_counts_and_prefix_caching_reach_the_deployment() -> None:
    args = build_parser().parse_args(["serve", "--decode-instances", "2", "--no-prefix-caching"])
    cfg = deployment_config(args)
    assert args.decode_instances == 2 and args.prefill_instances == 1
    assert not cfg.decode.engine_config().enable_prefix_caching
    assert not InstanceConfig.from_json(cfg.decode.to_json()).enable_prefix_caching
    assert InstanceConfig(cfg.decode.role, 1).engine_config().enable_prefix_caching
    proxy = cfg.proxy(["http://p"], ["http://d0", "http://d1"])
    assert proxy.decode_urls == ("http://d0", "http://d1")
    with pytest.raises(ConfigError, match="--prefill-instances 0 must be in"):
        deployment_config(build_parser().parse_args(["serve", "--prefill-instances", "0"]))


def test_a_deployment_uses_the_users_token_in_any_form_and_makes_one_up_only_without(
    tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """`kvbridge serve`/`demo` read the token like every other command (flag, then
    KVBRIDGE_TRANSFER_TOKEN, then KVBRIDGE_TRANSFER_TOKEN_FILE); only when none is set do
    they make one up for the run (0600, removed at the end)."""
    from kvbridge.cli.serve_cmd import deployment_token
    from kvbridge.transfer.config import load_token

    monkeypatch.delenv("KVBRIDGE_TRANSFER_TOKEN", raising=False)
    monkeypatch.delenv("KVBRIDGE_TRANSFER_TOKEN_FILE", raising=False)
    env_file = tmp_path / "token"
    env_file.write_text("the-users-own-secret-0123456789")
    monkeypatch.setenv("KVBRIDGE_TRANSFER_TOKEN_FILE", str(env_file))
    args = build_parser().parse_args(["demo"])
    with deployment_token(args):
        assert args.kv_token_file is None
        assert load_token(path=args.kv_token_file) == b"the-users-own-secret-0123456789"
    monkeypatch.delenv("KVBRIDGE_TRANSFER_TOKEN_FILE")
    with deployment_token(args):
        made_up = args.kv_token_file
        assert made_up is not None and oct(os.stat(made_up).st_mode & 0o777) == "0o600"
        assert len(load_token(path=made_up) or b"") == 64
    assert args.kv_token_file is None and not os.path.exists(made_up)


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_every_flag_named_after_a_setting_defaults_to_the_settings_declaration() -> None:
    """Each setting is declared once (its config class); the CLI shows that default."""
    declared = {
        f.name: f.default
        for f in dataclasses.fields(InstanceConfig)
        # required, or not the same setting: --port is the public port (the proxy's, or a
        # single role's) where an InstanceConfig's 0 is a launched instance's free port
        if f.default is not dataclasses.MISSING and f.name != "port"
    }
    checked = []
    for action in _subparser("serve")._actions:
        if action.dest in declared:
            want = declared[action.dest]
            assert action.default == getattr(want, "value", want), action.dest
            checked.append(action.dest)
    assert {"lease_s", "handshake_timeout_s", "transfer_timeout_s", "kv_cache_mb"} <= set(checked)
    assert InstanceConfig.lease_s == TransferConfig.lease_s
    assert InstanceConfig.handshake_timeout_s == TransferConfig.handshake_timeout_s
    for command, flags in (
        ("serve", ("block_size", "prefill_block_size", "decode_block_size")),
        ("generate", ("block_size",)),
    ):
        defaults = {a.dest: a.default for a in _subparser(command)._actions}
        assert all(defaults[f] == DEFAULT_BLOCK_SIZE == EngineConfig.block_size for f in flags)
    # the demo's sizes depend on --engine: the reference engine's are the same declarations
    demo = build_parser().parse_args(["demo"])
    fill_demo_defaults(demo)
    assert demo.prefill_block_size == demo.decode_block_size == DEFAULT_BLOCK_SIZE
    assert (demo.prefill_tp, demo.decode_tp) == (DEFAULT_TP["prefill"], DEFAULT_TP["decode"])


def test_a_launched_instances_config_document_round_trips_and_is_checked_again(
    tmp_path,
) -> None:  # type: ignore[no-untyped-def]
    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123")
    cfg = InstanceConfig(
        Role.PREFILL,
        2,
        block_size=32,
        cache_layout="LBNHC",
        max_queued_requests=5,
        kv_token_file=str(token),
        enable_prefix_caching=False,
        kv_load_failure=KVLoadFailure.FAIL,
    )
    assert InstanceConfig.from_json(cfg.to_json()) == cfg
    bad = cfg.to_json().replace(b'"claim_s":10.0', b'"claim_s":-1')
    with pytest.raises(ConfigError, match="--kv-claim-s -1"):
        InstanceConfig.from_json(bad)
    with pytest.raises(ConfigError, match=r"instance config: Expected `int`.*\$\.tp_size"):
        InstanceConfig.from_json(cfg.to_json().replace(b'"tp_size":2', b'"tp_size":"2"'))


@pytest.mark.parametrize("nice", [-1, 20, True])
def test_a_nice_value_outside_0_to_19_is_refused_naming_the_range(nice: int) -> None:
    with pytest.raises(ConfigError, match=rf"cpu_nice={nice!r} must be .* from 0 .* to 19"):
        EngineConfig(cpu_nice=nice)


def test_cpu_priority_orders_prefill_compute_before_decode_compute_or_neither() -> None:
    prefill, decode = (InstanceConfig(r, 3).engine_config().cpu_nice for r in Role)
    assert (prefill, decode) == (COMPUTE_NICE["prefill"], COMPUTE_NICE["decode"])
    assert 0 < prefill < decode
    for role in Role:
        assert InstanceConfig(role, 3, cpu_priority=False).engine_config().cpu_nice == 0


def test_yield_compute_raises_the_compute_threads_nice_by_the_increment_only() -> None:
    """In a child process started 4 nice values below this one (4, from nice 0): the
    threads that existed before (the compute) go to 4 + 7, the ones kept (made for the
    KV connector) stay at 4, a thread the compute makes afterwards inherits 11, one
    already at 18 is not raised back, and an increment past 19 stops there."""
    import subprocess
    import sys

    started = min(os.getpriority(os.PRIO_PROCESS, 0) + 4, 19)
    compute, low = min(started + 7, 19), max(18, started)
    code = (
        "import threading, os, time\n"
        "from kvbridge.engine.cpu_share import compute_nice, thread_ids, yield_compute\n"
        "def tid_of(box): box.append(threading.get_native_id()); time.sleep(3)\n"
        "old, low, kv = [], [], []\n"
        "for box in (old, low): threading.Thread(target=tid_of, args=(box,)).start()\n"
        f"time.sleep(0.2); os.setpriority(os.PRIO_PROCESS, low[0], {low})\n"
        "compute = thread_ids()\n"
        "threading.Thread(target=tid_of, args=(kv,)).start(); time.sleep(0.2)\n"
        "top = compute_nice(19)\n"
        "n = yield_compute(7, keep=thread_ids() - compute)\n"
        "new = []; threading.Thread(target=tid_of, args=(new,)).start(); time.sleep(0.2)\n"
        "nice = lambda t: os.getpriority(os.PRIO_PROCESS, t)\n"
        "print(n, top, *(nice(t) for t in (threading.get_native_id(), old[0], kv[0], "
        "new[0], low[0])))\n"
    )
    out = subprocess.run(
        ["nice", "-n", "4", sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    lowered, *nices = out.stdout.split()
    want = [19, compute, compute, started, compute, max(low, compute)]
    assert int(lowered) >= (2 if compute > started else 0), out
    assert [int(n) for n in nices] == want, out
