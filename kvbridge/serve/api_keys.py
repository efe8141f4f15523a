"""The proxy's API keys, each the key of a tenant: who a caller of the OpenAI API is.

`--api-key-file FILE` names the tenants, one per line as ``tenant:key`` (a tenant may
have several keys, e.g. while one is replaced; a key belongs to one tenant). Blank lines
and lines starting with ``#`` are skipped; the tenant is what comes before the first
``:``, the key all after it, both without surrounding spaces. `--api-key KEY` (or
KVBRIDGE_API_KEY) is one more key, of the tenant DEFAULT_TENANT. The file is read at
start-up (a file that does not parse is refused then, naming the line) and again by
`ApiKeys.reload` (the proxy's SIGHUP): a file that no longer parses leaves the keys in
force as they were.

A key is looked up by its SHA-256, never compared byte by byte: how long a lookup takes
says nothing about a key unless one knows a key whose digest is close to it. Keys are
kept in memory as digests only, and no message ever holds a key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvbridge.errors import ConfigError

#: The tenant of --api-key's key (and of keys given to `make_app` without tenants).
DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class KeyTable:
    """The tenants' keys at one moment: key digest -> tenant."""

    tenants_by_digest: Mapping[bytes, str]

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(self.tenants_by_digest.values())

    def __len__(self) -> int:
        return len(self.tenants_by_digest)


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def parse_key_file(text: str, source: str) -> list[tuple[str, str]]:
    """(tenant, key) of each line of an API key file's `text` (`source` names it in
    errors). ConfigError naming the line for one that is no ``tenant:key``, a key given
    twice, or a file without keys."""
    pairs: list[tuple[str, str]] = []
    first_line: dict[bytes, int] = {}
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        tenant, colon, key = (part.strip() for part in line.partition(":"))
        if not colon or not tenant or not key:
            raise ConfigError(
                f"{source} line {n} is not 'tenant:key' (a tenant name, a colon, the key): "
                "write one TENANT:KEY per line (blank lines and lines starting with # are "
                "skipped)"
            )
        digest = _digest(key)
        if digest in first_line:
            raise ConfigError(
                f"{source} line {n} gives tenant {tenant!r} the key of line "
                f"{first_line[digest]}: a key names one tenant; give each its own"
            )
        first_line[digest] = n
        pairs.append((tenant, key))
    if not pairs:
        raise ConfigError(
            f"{source} holds no 'tenant:key' line: every call of the OpenAI API would be "
            "refused; write one TENANT:KEY per line"
        )
    return pairs


def read_key_file(path: str) -> list[tuple[str, str]]:
    """(tenant, key) of each line of the API key file at `path` (`parse_key_file`)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-key-file {path}: cannot read it ({exc})") from None
    return parse_key_file(text, f"--api-key-file {path}")


class ApiKeys:
    """The API keys the proxy accepts and the tenant of each: `tenant_keys` (--api-key's)
    and those of the file at `path`. Made at start-up; `tenant_of` is called from the
    proxy's event loop, `reload` from its SIGHUP handler: a reload swaps the whole table
    at once, so a lookup sees the old table or the new one."""

    def __init__(
        self, tenant_keys: Iterable[tuple[str, str]] = (), path: str | None = None
    ) -> None:
        self.path = path
        self._fixed = list(tenant_keys)  # the keys given other than by the file
        self._table = _table_of(self._fixed + (read_key_file(path) if path else []))

    @classmethod
    def load(cls, api_key: str | None = None, path: str | None = None) -> ApiKeys:
        """The keys of --api-key (tenant DEFAULT_TENANT) and of --api-key-file."""
        return cls([(DEFAULT_TENANT, api_key)] if api_key else [], path)

    @classmethod
    def of(cls, keys: ApiKeys | str | Iterable[str] | None) -> ApiKeys:
        """`keys` as ApiKeys: plain keys are each of tenant DEFAULT_TENANT."""
        if isinstance(keys, ApiKeys):
            return keys
        plain = [keys] if isinstance(keys, str) else list(keys or [])
        return cls((DEFAULT_TENANT, key) for key in plain)

    def reload(self) -> KeyTable:
        """Read the file again and put its keys (and --api-key's) in force; the new
        table. ConfigError, with the keys in force unchanged, when it does not parse."""
        if self.path is None:
            raise ConfigError("no --api-key-file to reload the API keys from")
        self._table = _table_of(self._fixed + read_key_file(self.path))
        return self._table

    @property
    def table(self) -> KeyTable:
        return self._table

    def __bool__(self) -> bool:
        return len(self._table) > 0

    def tenant_of(self, key: str | bytes | None) -> str | None:
        """The tenant of a presented key; None for no key or one not in force."""
        if not key:
            return None
        return self._table.tenants_by_digest.get(_digest(key))


def _table_of(tenant_keys: Iterable[tuple[str, str]]) -> KeyTable:
    table: dict[bytes, str] = {}
    for tenant, key in tenant_keys:
        if not key:
            raise ConfigError(f"tenant {tenant!r} has an empty API key")
        if table.setdefault(_digest(key), tenant) != tenant:
            raise ConfigError(
                f"one key is given to tenants {table[_digest(key)]!r} and {tenant!r} "
                "(--api-key's is tenant 'default'): a key names one tenant"
            )
    return KeyTable(table)
