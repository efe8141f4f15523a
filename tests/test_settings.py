"""A setting is declared once, by a field (`kvbridge.settings`): a config carrying
another's setting gets the same default and metadata, and what is derived from the
fields (the flags, the docs tables) shows each declaration as it is."""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, field

import pytest

from kvbridge.cli.settings_args import add_arguments, config_from_args
from kvbridge.settings import (
    REQUIRED,
    carried,
    flagged,
    same_as,
    setting,
    setting_of,
    settings,
    settings_table,
)


class Mode(enum.Enum):
    FAST = "fast"
    SAFE = "safe"


@dataclass(frozen=True)
class Runtime:
    timeout_s: float = setting(30.0, flag="--timeout-s", help="give up after this long")
    mode: Mode = setting(Mode.SAFE, flag="--mode", help="how to run")
    secret: bytes | None = setting(None, key=None, env=("X_SECRET",), help="the secret")
    limit: int = 7  # no setting


@dataclass(frozen=True)
class Service:
    name: str = setting(help="who it is")  # required
    port: int | None = setting(None, flag="--port", default_text="any free", help="a | port")
    verbose: bool = setting(False, flag="--verbose", help="say more")
    cache: bool = setting(True, flag="--no-cache", help="turn the cache off")
    pinned: bool = setting(True, flag="--pinned", help="pin threads")
    timeout_s: float = same_as(Runtime, "timeout_s")
    run_mode: Mode = same_as(Runtime, "mode", help="how the service runs")
    tags: list[str] = field(default_factory=list)


def test_same_as_copies_the_default_and_the_metadata_and_records_its_origin() -> None:
    s, t = setting_of(Service, "timeout_s"), setting_of(Runtime, "timeout_s")
    assert (
        (s.default, s.help, s.flag) == (t.default, t.help, t.flag) == (30.0, t.help, "--timeout-s")
    )
    assert Service.timeout_s == Runtime.timeout_s == 30.0
    assert s.origin == (Runtime, "timeout_s") and t.origin is None
    mode = setting_of(Service, "run_mode")
    assert (mode.default, mode.flag, mode.help) == (Mode.SAFE, "--mode", "how the service runs")
    assert carried(Service, Runtime) == [("timeout_s", "timeout_s"), ("run_mode", "mode")]


def test_settings_are_the_declared_fields_with_their_name_default_type_and_key() -> None:
    assert [s.name for s in settings(Runtime)] == ["timeout_s", "mode", "secret"]
    assert [s.key for s in settings(Runtime)] == ["timeout_s", "mode", None]
    name = setting_of(Service, "name")
    assert name.default is REQUIRED and name.type is str and name.shown_default() is None
    assert setting_of(Service, "port").type == int | None


def test_a_flag_shared_by_two_configs_is_added_once_and_must_be_declared_alike() -> None:
    @dataclass(frozen=True)
    class Carrier:
        timeout_s: float = same_as(Runtime, "timeout_s")
        mode: Mode = same_as(Runtime, "mode")

    assert [s.name for s in flagged(Runtime, Carrier)] == ["timeout_s", "mode"]

    @dataclass(frozen=True)
    class Other:
        timeout_s: float = setting(31.0, flag="--timeout-s", help="give up after this long")

    with pytest.raises(AssertionError, match="--timeout-s is declared twice"):
        flagged(Runtime, Other)
    # --mode under another name, with another help: not the same argument
    with pytest.raises(
        AssertionError, match=r"--mode is declared twice: mode and Service\.run_mode"
    ):
        flagged(Runtime, Service)


def test_the_flags_are_derived_from_the_fields_and_build_the_config_back() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p, flagged(Service))
    actions = {a.dest: a for a in p._actions}
    assert actions["run_mode"].choices == ["fast", "safe"] and actions["run_mode"].default == "safe"
    assert actions["port"].type is int and actions["port"].metavar == "PORT"
    assert isinstance(actions["pinned"], argparse.BooleanOptionalAction)
    assert "(default: any free)" in actions["port"].help
    args = p.parse_args(["--mode", "fast", "--no-cache", "--verbose", "--no-pinned"])
    cfg = config_from_args(Service, args, name="svc")
    assert cfg == Service("svc", None, True, False, False, 30.0, Mode.FAST)
    assert config_from_args(Service, p.parse_args([]), name="svc") == Service("svc")


def test_the_table_shows_each_setting_as_declared() -> None:
    table = settings_table(flagged(Service), ("flag", "default", "meaning"))
    lines = table.splitlines()
    assert lines[:2] == ["| flag | default | meaning |", "|---|---|---|"]
    assert "| `--port` | any free | a \\| port |" in lines  # a | inside a cell is escaped
    assert "| `--verbose` | not given | say more |" in lines
    assert "| `--[no-]pinned` | `on` | pin threads |" in lines
    assert "| `--timeout-s` | `30` | give up after this long |" in lines
    keyed = settings_table(settings(Runtime), ("key", "env", "default"))
    assert "| `timeout_s` |  | `30` |" in keyed and "| none | `X_SECRET` | none |" in keyed
