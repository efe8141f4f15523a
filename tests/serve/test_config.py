"""`--max-body-mb` travels from the command line into every typed config, and on to a
launched instance's own command line."""

from __future__ import annotations

from kvbridge.cli.main import build_parser
from kvbridge.cli.serve_cmd import deployment_config, instance_config
from kvbridge.serve.config import InstanceConfig


def test_max_body_mb_reaches_proxy_and_instances() -> None:
    args = build_parser().parse_args(["serve", "--max-body-mb", "2.5"])
    cfg = deployment_config(args)
    assert cfg.prefill.max_body_mb == cfg.decode.max_body_mb == 2.5
    proxy = cfg.proxy("http://p", "http://d")
    assert proxy.max_body_bytes == int(2.5 * 2**20)
    # a launched instance parses its command line back into the same config
    child = build_parser().parse_args(["serve", *cfg.decode.to_args(), "--port", "0"])
    assert instance_config(child).max_body_bytes == cfg.decode.max_body_bytes
    assert InstanceConfig(cfg.decode.role, 1).max_body_mb == 16.0  # the default
