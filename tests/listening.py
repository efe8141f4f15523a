"""Which TCP addresses a process listens on, from /proc (no external tools)."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def _addr(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # /proc/net/tcp6 stores four little-endian 32-bit words
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on."""
    inodes = _socket_inodes(pid)
    out = []
    for table in ("tcp", "tcp6"):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            f = line.split()
            local, state, inode = f[1], f[3], f[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                host, port = local.rsplit(":", 1)
                out.append((_addr(host), int(port, 16)))
    return out


def is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    return ip.is_loopback or (
        ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback
    )
