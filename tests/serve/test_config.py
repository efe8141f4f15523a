"""Every flag of `kvbridge serve` is a setting declared once, by a config's field: it
defaults to the field's default, and travels from the command line into every typed
config (`--max-body-mb` to the proxy and the instances), and on to a launched instance's
config document."""

from __future__ import annotations

import argparse
import os
import shlex

import pytest

from kvbridge.cli.main import build_parser
from kvbridge.cli.serve_cmd import (
    DEFAULT_TP,
    SETTINGS,
    deployment_config,
    fill_demo_defaults,
    instance_config,
    proxy_config,
)
from kvbridge.connector import ConnectorRole, Credential, RootKey
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.cpu_share import COMPUTE_NICE
from kvbridge.errors import ConfigError
from kvbridge.plan.layout import DEFAULT_BLOCK_SIZE
from kvbridge.serve.config import (
    DeploymentConfig,
    Engine,
    InstanceConfig,
    KVLoadFailure,
    ProxyConfig,
    Role,
)
from kvbridge.serve.isolation import PrefixCacheIsolation
from kvbridge.settings import carried, settings
from kvbridge.transfer.config import FanOut, KVExport, TransferConfig
from kvbridge.transfer.integrity import Integrity


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


def test_the_kv_cache_dtype_reaches_each_roles_engine_and_fp8_is_refused_at_start_up() -> None:
    """--decode-kv-cache-dtype sets the decode engine's cache dtype (aliases canonical),
    through a launched instance's config document; a single role takes --kv-cache-dtype;
    a dtype the engine does not keep is refused naming the flag, the value and what works."""
    cfg = deployment_config(_parse("serve --decode-kv-cache-dtype bf16"))
    assert cfg.prefill.engine_config().kv_dtype == "float32"
    assert cfg.decode.engine_config().kv_dtype == "bfloat16"
    assert InstanceConfig.from_json(cfg.decode.to_json()) == cfg.decode
    one = instance_config(_parse("serve --role decode --tp 3 --kv-cache-dtype float16"))
    assert one.engine_config().kv_dtype == "float16"
    with pytest.raises(
        ConfigError,
        match=r"^--kv-cache-dtype: kv_dtype='fp8': .* one of float32, bfloat16, float16; use",
    ):
        deployment_config(_parse("demo --prefill-kv-cache-dtype fp8"))


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


def _parse(command_line: str) -> argparse.Namespace:
    return build_parser().parse_args(shlex.split(command_line))


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_every_flag_named_after_a_setting_defaults_to_the_settings_declaration() -> None:
    """Each setting is declared once (its config's field); both commands take its flag,
    with its aliases, under the field's name, with the field's default."""
    declared = {
        s.name: s for cls in (InstanceConfig, ProxyConfig, DeploymentConfig) for s in settings(cls)
    }
    for command in ("serve", "demo"):
        actions = {a.dest: a for a in _subparser(command)._actions}
        for s in SETTINGS:
            action = actions[s.name]
            assert set(s.flags) <= set(action.option_strings), (command, s.name)
            assert action.default == getattr(s.default, "value", s.default), (command, s.name)
    # every flagged setting of the three configs, each flag once
    assert {s.name for s in SETTINGS} == {n for n, s in declared.items() if s.flag}
    assert InstanceConfig.lease_s == TransferConfig.lease_s
    assert InstanceConfig.handshake_timeout_s == TransferConfig.handshake_timeout_s
    assert DeploymentConfig.port == ProxyConfig.port and ProxyConfig.host == InstanceConfig.host
    for command, flags in (
        ("serve", ("block_size", "prefill_block_size", "decode_block_size")),
        ("generate", ("block_size",)),
    ):
        defaults = {a.dest: a.default for a in _subparser(command)._actions}
        assert all(defaults[f] == DEFAULT_BLOCK_SIZE == EngineConfig.block_size for f in flags)
    generate = {a.dest: a.default for a in _subparser("generate")._actions}
    assert (generate["model"], generate["kv_cache_mb"]) == (
        InstanceConfig.model,
        EngineConfig.kv_cache_mb,
    )
    # the demo's sizes depend on --engine: the reference engine's are the same declarations
    demo = build_parser().parse_args(["demo"])
    fill_demo_defaults(demo)
    assert demo.prefill_block_size == demo.decode_block_size == DEFAULT_BLOCK_SIZE
    assert (demo.prefill_tp, demo.decode_tp) == (DEFAULT_TP["prefill"], DEFAULT_TP["decode"])


def test_the_help_shows_each_settings_help_and_default(capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("COLUMNS", "10000")  # one line per flag: no hyphen split across lines
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for s in SETTINGS:
        assert s.flag in text
        assert " ".join(s.help.split())[:40] in text, s.name
    assert (
        "--kv-claim-s KV_CLAIM_S" in text and "--transfer-timeout-s and 5 s (default: 10)" in text
    )
    assert "--auth-token-file FILE, --kv-token-file FILE" in text
    assert "--cpu-priority, --no-cpu-priority" in text and "(default: on)" in text
    assert "(default: twice the engine's max_num_seqs (16)" in text


def test_every_flag_reaches_its_instances_config_and_the_kv_runtimes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """One flag per setting, and every one arrives: a single role's instance gets each
    flag's value (none left at its default but the TLS files, which must exist), and its
    KV runtime every setting it carries from TransferConfig."""
    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123")
    credential = tmp_path / "decode.cred"
    RootKey.generate().enroll((ConnectorRole.CONSUMER,), "decode").save(credential)
    argv = shlex.split(
        "serve --role decode --tp 2 --port 8411 --model m.gguf --kv-cache-mb 64 "
        "--no-prefix-caching --max-queued-requests 5 --no-cpu-priority --host 127.0.0.3 "
        "--max-body-mb 2.5 --insecure --kv-host 127.0.0.2 --kv-port 7000 "
        "--kv-advertise-host 127.0.0.4 --kv-load-failure fail --kv-claim-s 7 --lease-s 60 "
        "--transfer-timeout-s 20 --liveness-timeout-s 3 --handshake-timeout-s 9 "
        f"--kv-integrity on --kv-export inline --kv-fan-out off --kv-token-file {token} "
        f"--credential-file {credential}"
    )
    cfg = instance_config(build_parser().parse_args(argv))
    assert cfg.credential() == Credential.load(credential)
    assert (cfg.role, cfg.tp_size, cfg.port, cfg.model, cfg.kv_cache_mb) == (
        Role.DECODE,
        2,
        8411,
        "m.gguf",
        64,
    )
    assert (cfg.claim_s, cfg.lease_s, cfg.kv_load_failure) == (7.0, 60.0, KVLoadFailure.FAIL)
    assert (cfg.kv_integrity, cfg.kv_export, cfg.kv_fan_out) == (
        Integrity.ON,
        KVExport.INLINE,
        FanOut.OFF,
    )
    left = {
        s.name for s in settings(InstanceConfig) if s.flag and getattr(cfg, s.name) == s.default
    }
    assert left == {"tls_cert", "tls_key"}
    assert InstanceConfig.from_json(cfg.to_json()) == cfg
    kv = cfg.transfer_config()
    assert (kv.host, kv.advertise_host, kv.base_port, kv.token) == (
        "127.0.0.2",
        "127.0.0.4",
        7000,
        b"0123456789abcdef0123",
    )
    assert (kv.lease_s, kv.transfer_timeout_s, kv.liveness_timeout_s) == (60.0, 20.0, 3.0)
    assert (kv.handshake_timeout_s, kv.integrity, kv.kv_export, kv.fan_out) == (
        9.0,
        Integrity.ON,
        KVExport.INLINE,
        FanOut.OFF,
    )
    carried_names = {t for _, t in carried(InstanceConfig, TransferConfig)}
    assert carried_names == {
        "base_port",
        "advertise_host",
        "lease_s",
        "transfer_timeout_s",
        "liveness_timeout_s",
        "handshake_timeout_s",
        "integrity",
        "kv_export",
        "fan_out",
    }
    # a setting left out takes the field's default, here and in the runtime
    plain = instance_config(build_parser().parse_args(["serve", "--role", "prefill", "--tp", "1"]))
    assert plain.port == ProxyConfig.port and plain.transfer_config().lease_s == 120.0


def test_the_proxys_flags_reach_its_config_and_a_deployments_proxy(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("KVBRIDGE_API_KEY", raising=False)
    args = _parse(
        "serve --role proxy --engine vllm --prefill http://127.0.0.1:1 --decode "
        "http://127.0.0.1:2 --port 0 --api-key k --prefix-cache-isolation user "
        "--hide-cached-tokens --kv-load-failure fail --max-body-mb 3"
    )
    proxy = proxy_config(args)
    assert (proxy.engine, proxy.port, proxy.api_key, proxy.hide_cached_tokens) == (
        Engine.VLLM,
        0,
        "k",
        True,
    )
    assert (proxy.prefix_cache_isolation, proxy.kv_load_failure, proxy.max_body_mb) == (
        PrefixCacheIsolation.USER,
        KVLoadFailure.FAIL,
        3.0,
    )
    # the API key from the environment, when the flag is not given
    monkeypatch.setenv("KVBRIDGE_API_KEY", "from-env")
    args = _parse("serve --role proxy --decode http://127.0.0.1:2")
    assert proxy_config(args).api_key == "from-env"
    # a deployment's proxy: its own settings from the deployment, shared ones from decode
    args = _parse("serve --port 8412 --kv-load-failure fail --max-body-mb 4 --hide-cached-tokens")
    dep = deployment_config(args)
    proxy = dep.proxy(["http://p"], ["http://d"])
    assert (proxy.port, proxy.api_key, proxy.hide_cached_tokens) == (8412, "from-env", True)
    assert (proxy.kv_load_failure, proxy.max_body_mb, proxy.model) == (
        KVLoadFailure.FAIL,
        4.0,
        InstanceConfig.model,
    )
    assert proxy.prefix_cache_isolation is PrefixCacheIsolation.API_KEY  # with a key


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
