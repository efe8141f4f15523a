"""Which network interface carries an address (Linux), so UCX can be kept to it; and a
free TCP port.

UCX opens a TCP listener on every interface it may use. With everything on 127.0.0.1
(kvbridge's default) that would still listen on the machine's external interfaces;
across hosts, a host with several interfaces may pick one a peer cannot reach. So the
transport restricts UCX to the device that carries the KV host (`UCX_NET_DEVICES`),
unless the user set that variable.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

_SIOCGIFADDR = 0x8915


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_devices() -> dict[str, str]:
    """IPv6 address -> interface, from /proc/net/if_inet6."""
    out: dict[str, str] = {}
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) >= 6:
            addr = ipaddress.IPv6Address(bytes.fromhex(parts[0]))
            out[str(addr)] = parts[5]
    return out


def device_of(host: str) -> str | None:
    """The interface holding address `host`; "lo" for any loopback address; None for a
    wildcard, a name that is not an address, or an address no interface holds."""
    if host == "localhost":
        return "lo"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.is_loopback:
        return "lo"
    if ip.is_unspecified:
        return None
    if ip.version == 6:
        return _ipv6_devices().get(str(ip))
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == str(ip):
            return name
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `host` now (bind to port 0, read it, close): for
    a child process or a test that must be told its port before it binds it."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
