"""Read the key/value metadata of a GGUF file (header only; tensors are not touched).

GGUF v2/v3 layout, little-endian:
    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64 | kv_count x (key, type, value)
A key is a u64-length-prefixed UTF-8 string; a value is typed by a u32 tag (see _SCALARS;
8 = string, 9 = array of (elem_type u32, count u64, values)). Large arrays (the tokenizer's
vocabulary) are skipped unless asked for, so reading the geometry costs milliseconds.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

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
    """Reads the header from a memory map: one slice per field, and arrays skipped
    by their lengths alone."""

    def __init__(self, buf: mmap.mmap | bytes, source: str) -> None:
        self.buf = buf
        self.pos = 0
        self.source = source

    def skip(self, n: int) -> int:
        """Step over `n` bytes; returns where they began."""
        start, end = self.pos, self.pos + n
        if end > len(self.buf):
            raise ConfigError(f"{self.source} is truncated (GGUF metadata ends early)")
        self.pos = end
        return start

    def read(self, n: int) -> bytes:
        start = self.skip(n)
        return self.buf[start : self.pos]

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > 1 << 24:
            raise ConfigError(f"{self.source}: GGUF string of {n} bytes is not plausible")
        return self.read(n).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        """Step over `count` length-prefixed strings without decoding them."""
        buf, pos = self.buf, self.pos  # locals: this loop runs once per vocabulary entry
        try:
            for _ in range(count):
                pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        except struct.error:  # a length field runs past the end
            pos = len(buf) + 1
        self.skip(pos - self.pos)

    def value(self, tag: int, keep: bool) -> Any:
        if tag in _SCALARS:
            return self.unpack(_SCALARS[tag])
        if tag == _STRING:
            return self.string()
        if tag == _ARRAY:
            elem = self.unpack("<I")
            count = self.unpack("<Q")
            if not keep and count > _MAX_ARRAY:
                if elem in _SCALARS:
                    self.skip(count * struct.calcsize(_SCALARS[elem]))
                    return None
                if elem == _STRING:
                    self.skip_strings(count)
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
        try:
            buf: mmap.mmap | bytes = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            buf = b""
        try:
            return _parse(_Reader(buf, source), keep)
        finally:
            if isinstance(buf, mmap.mmap):
                buf.close()


def _parse(r: _Reader, keep: frozenset[str]) -> dict[str, Any]:
    if r.read(4) != b"GGUF":
        raise ConfigError(f"{r.source} is not a GGUF file (bad magic)")
    version = r.unpack("<I")
    if version not in (2, 3):
        raise ConfigError(f"{r.source}: GGUF version {version} is not supported; use 2 or 3")
    r.unpack("<Q")  # tensor count
    num_kv = r.unpack("<Q")
    meta: dict[str, Any] = {}
    for _ in range(num_kv):
        key = r.string()
        tag = r.unpack("<I")
        meta[key] = r.value(tag, key in keep)
    return meta
