"""Read the key/value metadata of a GGUF file (header only; tensors are not touched).

GGUF v2/v3 layout, little-endian:
    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64 | kv_count x (key, type, value)
A key is a u64-length-prefixed UTF-8 string; a value is typed by a u32 tag (see _SCALARS;
8 = string, 9 = array of (elem_type u32, count u64, values)). Large arrays (the tokenizer's
vocabulary) are skipped unless asked for, so reading the geometry costs microseconds.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

from kvbridge.errors import ConfigError

_SCALARS: dict[int, str] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
#: Arrays longer than this are not materialized unless their key is asked for.
_MAX_ARRAY = 4096


class _Reader:
    def __init__(self, f: BinaryIO, source: str) -> None:
        self.f = f
        self.source = source

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise ConfigError(f"{self.source} is truncated (GGUF metadata ends early)")
        return data

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > 1 << 24:
            raise ConfigError(f"{self.source}: GGUF string of {n} bytes is not plausible")
        return self.read(n).decode("utf-8", errors="replace")

    def value(self, tag: int, keep: bool) -> Any:
        if tag in _SCALARS:
            return self.unpack(_SCALARS[tag])
        if tag == _STRING:
            return self.string()
        if tag == _ARRAY:
            elem = self.unpack("<I")
            count = self.unpack("<Q")
            if elem in _SCALARS and not keep and count > _MAX_ARRAY:
                self.f.seek(count * struct.calcsize(_SCALARS[elem]), 1)
                return None
            items = [self.value(elem, keep) for _ in range(count)]
            return items if keep or count <= _MAX_ARRAY else None
        raise ConfigError(f"{self.source}: unknown GGUF value type {tag}")


def read_metadata(path: str | Path, keep: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Return the metadata dict of a GGUF file.

    Arrays longer than 4096 entries come back as None unless their key is in `keep`.
    """
    source = str(path)
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise ConfigError(f"cannot read GGUF file {source}: {exc.strerror or exc}") from None
    with f:
        r = _Reader(f, source)
        if r.read(4) != b"GGUF":
            raise ConfigError(f"{source} is not a GGUF file (bad magic)")
        version = r.unpack("<I")
        if version not in (2, 3):
            raise ConfigError(f"{source}: GGUF version {version} is not supported; use 2 or 3")
        r.unpack("<Q")  # tensor count
        num_kv = r.unpack("<Q")
        meta: dict[str, Any] = {}
        for _ in range(num_kv):
            key = r.string()
            tag = r.unpack("<I")
            meta[key] = r.value(tag, key in keep)
        return meta
