"""Command-line flags derived from settings (`kvbridge.settings`), and the config built
from the flags: what `kvbridge serve` and `kvbridge demo` use for every flag that is a
config's field. argparse stays at this level; the configs know nothing of it.

A setting with a flag becomes an argument whose `dest` is the field's name: its type,
choices (an Enum's values), action (a bool's flag is a switch or a --x/--no-x toggle:
`Setting.is_switch`), metavar (the flag's name unless declared) and help (with its
default) follow from the field; `config_from_args` turns the parsed values back into
the field's types.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Iterable
from typing import Any, TypeVar

from kvbridge.settings import Setting, enum_type, settings

T = TypeVar("T")


def add_arguments(p: argparse.ArgumentParser, rows: Iterable[Setting]) -> None:
    """Add the flag of each setting in `rows` (`kvbridge.settings.flagged`) to `p`."""
    for s in rows:
        assert s.flag is not None, s.name
        p.add_argument(*s.flags, dest=s.name, **_argument(s))


def help_of(s: Setting) -> str:
    """The flag's help: the setting's, with its default unless the flag itself is a
    switch away from it (--insecure, --no-prefix-caching); %-escaped for argparse."""
    shown = s.shown_default()
    text = s.help if shown is None or s.is_switch else f"{s.help} (default: {shown})"
    return text.replace("%", "%%")


def config_from_args(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """`cls` built from the flags of its settings (`add_arguments`), each parsed value
    turned into its field's type (an Enum from its value); `given` sets the fields that
    have no flag, or overrides one."""
    kw: dict[str, Any] = {}
    for s in settings(cls):
        if s.flag is None or s.name in given:
            continue
        value = getattr(args, s.name)
        kind = enum_type(s.type)
        kw[s.name] = kind(value) if kind is not None and isinstance(value, str) else value
    return cls(**kw, **given)


def _argument(s: Setting) -> dict[str, Any]:
    """add_argument's keyword arguments for setting `s`."""
    kw: dict[str, Any] = {"help": help_of(s)}
    if s.is_toggle:
        return kw | {"action": argparse.BooleanOptionalAction, "default": s.default}
    if s.is_switch:
        return kw | {"action": "store_true" if s.default is False else "store_false"}
    kind = enum_type(s.type)
    if kind is not None:
        kw["choices"] = [m.value for m in kind]
        kw["default"] = None if s.default is None else s.default.value
        return kw
    kw["default"] = s.default
    scalar = next((t for t in (s.type, *typing.get_args(s.type)) if t in (int, float)), None)
    if scalar is not None:
        kw["type"] = scalar
    kw["metavar"] = s.metavar or (s.flag or "").removeprefix("--").upper().replace("-", "_")
    return kw
