"""`--max-body-mb` travels from the command line into every typed config, and on to a
launched instance's own command line."""

from __future__ import annotations

import pytest

from kvbridge.cli.main import build_parser
from kvbridge.cli.serve_cmd import deployment_config, instance_config
from kvbridge.errors import ConfigError
from kvbridge.serve.config import InstanceConfig


def test_max_body_mb_reaches_proxy_and_instances() -> None:
    args = build_parser().parse_args(["serve", "--max-body-mb", "2.5"])
    cfg = deployment_config(args)
    assert cfg.prefill.max_body_mb == cfg.decode.max_body_mb == 2.5
    proxy = cfg.proxy(["http://p"], ["http://d"])
    assert proxy.max_body_bytes == int(2.5 * 2**20)
    # a launched instance parses its command line back into the same config
    child = build_parser().parse_args(["serve", *cfg.decode.to_args(), "--port", "0"])
    assert instance_config(child).max_body_bytes == cfg.decode.max_body_bytes
    assert InstanceConfig(cfg.decode.role, 1).max_body_mb == 16.0  # the default


def test_instance_counts_and_prefix_caching_reach_the_deployment() -> None:
    args = build_parser().parse_args(["serve", "--decode-instances", "2", "--no-prefix-caching"])
    cfg = deployment_config(args)
    assert args.decode_instances == 2 and args.prefill_instances == 1
    assert not cfg.decode.engine_config().enable_prefix_caching
    child = build_parser().parse_args(["serve", *cfg.decode.to_args(), "--port", "0"])
    assert not instance_config(child).enable_prefix_caching
    assert InstanceConfig(cfg.decode.role, 1).engine_config().enable_prefix_caching
    proxy = cfg.proxy(["http://p"], ["http://d0", "http://d1"])
    assert proxy.decode_urls == ("http://d0", "http://d1")
    with pytest.raises(ConfigError, match="--prefill-instances 0 must be in"):
        deployment_config(build_parser().parse_args(["serve", "--prefill-instances", "0"]))
