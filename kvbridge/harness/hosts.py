"""Test hosts on one machine: Linux network namespaces on a bridge.

A `HostNetwork` makes one Linux bridge in the root namespace and, per `TestHost`, a
network namespace holding one end of a veth pair (`eth0`, with an address in a private
/24 that exists only inside those namespaces); the other end is a port of the bridge.
A host runs its process under ``unshare --uts --ipc --pid --fork --mount-proc`` with its
own hostname and a private /dev/shm, so hosts share no pids, IPC or shared memory: the
transfer runtime has to use TCP between them, as between machines.

Links are cut and slowed from outside: `cut` sets the bridge's end of a host's veth
down (the cable pulled), `slow` puts a token-bucket filter on the host's `eth0` (what
the host sends, e.g. the KV a prefill host serves).

The test process reaches hosts from inside a namespace (`TestHost.inside`: this thread
enters the host's network namespace; sockets made there stay in it). Needs root,
iproute2 (`ip`, `tc`) and util-linux's `unshare`; `missing()` says what is lacking.
`close()` kills every host's processes (a host's pid namespace dies with its first
process) and deletes the namespaces, veths and bridge; it runs on errors too (context
manager) and at interpreter exit. Names start with ``kvbh-``/``kvbh`` so leftovers are
recognisable.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge.errors import KVBridgeError

CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
ETH_P_ALL = 0x0003
SO_RCVBUFFORCE = 33
SOL_PACKET = 263
PACKET_STATISTICS = 6
#: The private subnet of the test hosts (host i is SUBNET.{i+1}); no route leads to it
#: from the root namespace.
SUBNET = "10.213.0"

_libc = ctypes.CDLL(None, use_errno=True)


class HostError(KVBridgeError):
    """A test-host command failed (its command line and output are in the message)."""


def missing() -> str | None:
    """Why test hosts cannot be made here (not root, a tool missing, namespaces or
    virtual links refused), or None."""
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces, veth pairs, a bridge)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"test hosts need the `{tool}` command (iproute2 / util-linux)"
    # root without the capabilities (an unprivileged container): try it all in a
    # throwaway namespace, gone when the probe exits
    probe = "ip link add kvbhb type bridge && ip link add kvbhv type veth peer name kvbhw"
    cmd = ["unshare", "--net", "--uts", "--ipc", "--pid", "--fork", "--mount-proc"]
    done = subprocess.run([*cmd, "sh", "-c", probe], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return f"cannot make network namespaces, bridges or veths here: {done.stderr.strip()}"
    return None


def sh(argv: Sequence[str], timeout_s: float = 30.0, check: bool = True) -> str:
    """Run a short command; its stdout. Raises HostError with its output when it fails."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise HostError(f"`{' '.join(argv)}` did not finish within {timeout_s:g} s") from None
    if check and done.returncode != 0:
        raise HostError(f"`{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


@dataclass
class Capture:
    """The frames a `TestHost.capture` saw, concatenated, and how many it missed."""

    data: bytearray = field(default_factory=bytearray)
    dropped: int = 0

    def __contains__(self, needle: bytes) -> bool:
        return needle in self.data


@dataclass
class TestHost:
    """One test host: a network namespace with `eth0` at `address`, and at most one
    running process tree (`start`). Owned by its `HostNetwork`; not thread-safe, except
    `inside`, which any thread may use."""

    __test__ = False  # not a pytest test class

    name: str
    netns: str
    veth: str  # the bridge's end, in the root namespace
    address: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    #: holds the UTS and IPC namespaces that harness workers on this host share
    _holder: subprocess.Popen[bytes] | None = None

    def start(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        """Run `argv` as this host's process (pid 1 of its pid namespace), output to
        `log_path`. A host runs one process tree at a time."""
        if self.is_running:
            raise HostError(f"host {self.name} already runs a process; stop it first")
        # pid 1 sets the hostname and mounts a private /dev/shm (gone with the host),
        # then becomes argv; --kill-child: if unshare dies, pid 1 dies, and with it
        # every process of the host.
        script = 'hostname "$0" && mount -t tmpfs -o size=4g tmpfs /dev/shm && exec "$@"'
        cmd = ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--ipc", "--pid"]
        cmd += ["--fork", "--mount-proc", "--kill-child=SIGKILL", "sh", "-c", script]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*cmd, self.name, *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

    @property
    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, timeout_s: float = 30.0) -> None:
        """Kill the host's processes at once (the host crashed); returns once none of
        them is left. Raises HostError if some outlive `timeout_s`."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                raise HostError(f"host {self.name}'s unshare outlived SIGKILL") from None
        if self._holder is not None:  # ours to reap
            self._holder.kill()
            self._holder.wait(timeout_s)
            self._holder = None
        deadline = time.monotonic() + timeout_s
        while pids := self.pids():
            if time.monotonic() > deadline:
                raise HostError(f"host {self.name}: processes {pids} outlived its pid 1")
            for pid in pids:  # not ours to wait for: the kernel reaps them
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)

    def pids(self) -> list[int]:
        """Processes in this host's network namespace."""
        out = sh(["ip", "netns", "pids", self.netns], check=False)
        return [int(p) for p in out.split()]

    def run(self, argv: Sequence[str], timeout_s: float = 30.0) -> str:
        """Run a short command in this host's network namespace; its stdout."""
        return sh(["ip", "netns", "exec", self.netns, *argv], timeout_s)

    def cut(self) -> None:
        """Pull the cable: the bridge's end of this host's link goes down."""
        sh(["ip", "link", "set", self.veth, "down"])

    def heal(self) -> None:
        """Plug the cable back in and remove any rate limit."""
        self.unslow()
        sh(["ip", "link", "set", self.veth, "up"])

    def slow(self, rate: str = "200mbit", burst: str = "32kbit", latency: str = "400ms") -> None:
        """Limit what this host sends to `rate` (a token-bucket filter on its eth0)."""
        tbf = ["tbf", "rate", rate, "burst", burst, "latency", latency]
        self.run(["tc", "qdisc", "replace", "dev", "eth0", "root", *tbf])

    def unslow(self) -> None:
        if self.is_slowed():
            self.run(["tc", "qdisc", "del", "dev", "eth0", "root"])

    def is_slowed(self) -> bool:
        return "tbf" in self.run(["tc", "qdisc", "show", "dev", "eth0"])

    def bytes_sent(self) -> int:
        """Bytes this host has sent on its link (the bridge end's receive counter)."""
        return int(Path(f"/sys/class/net/{self.veth}/statistics/rx_bytes").read_text())

    def bytes_received(self) -> int:
        """Bytes this host's link has delivered to it (the bridge end's send counter)."""
        return int(Path(f"/sys/class/net/{self.veth}/statistics/tx_bytes").read_text())

    @contextlib.contextmanager
    def capture(self) -> Iterator[Capture]:
        """What a sniffer on this host's cable sees: every frame its link carries, both
        ways, until the block ends (an AF_PACKET socket on the bridge's end of the veth,
        in the root namespace, with a 64 MiB buffer); `Capture.dropped` counts the
        frames the kernel could not hand over."""
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
        sock.bind((self.veth, 0))
        sock.settimeout(0.05)
        seen, stop = Capture(), threading.Event()

        def run() -> None:
            while not stop.is_set():
                try:
                    seen.data.extend(sock.recv(1 << 18))
                except TimeoutError:
                    continue
                except OSError:
                    if stop.wait(0.05):  # the link is down: wait for it, or the end
                        return

        thread = threading.Thread(target=run, name=f"capture-{self.name}", daemon=True)
        thread.start()
        try:
            yield seen
        finally:
            stop.set()
            thread.join(5)
            stats = sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8)
            seen.dropped = int.from_bytes(stats[4:8], "little")  # tpacket_stats.tp_drops
            sock.close()

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """The calling thread works in this host's network namespace until the block
        ends (sockets it opens there stay there)."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            target = os.open(f"/run/netns/{self.netns}", os.O_RDONLY)
            try:
                _setns_fd(target, CLONE_NEWNET)
            finally:
                os.close(target)
            try:
                yield
            finally:
                _setns_fd(own, CLONE_NEWNET)
        finally:
            os.close(own)

    def worker_options(self) -> dict[str, Any]:
        """`WorkerSpec` fields that put harness workers on this host (in its network,
        UTS and IPC namespaces, which they share as one host's processes do)."""
        return {
            "host": self.address,
            "netns": self.netns,
            "hostname": self.name,
            "host_pid": self.holder_pid(),
        }

    def holder_pid(self, timeout_s: float = 10.0) -> int:
        """The pid of a process in this host's namespaces (network, and UTS and IPC of
        its own under its name) that harness workers join (`become`), started when first
        asked for and again after `kill`: workers of one host then see each other as
        one machine's processes (shared memory, CMA), as an instance's workers do."""
        if self._holder is None or self._holder.poll() is not None:
            # ip and unshare exec (no fork): the pid ends up as sleep, in the namespaces
            script = 'hostname "$0" && exec sleep infinity'
            cmd = ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--ipc"]
            self._holder = subprocess.Popen(
                [*cmd, "sh", "-c", script, self.name],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            deadline = time.monotonic() + timeout_s
            comm = Path(f"/proc/{self._holder.pid}/comm")
            while comm.read_text(errors="replace").strip() != "sleep":
                if self._holder.poll() is not None or time.monotonic() > deadline:
                    raise HostError(f"host {self.name}: its namespace holder did not start")
                time.sleep(0.01)
        return self._holder.pid

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""


def become(netns: str, hostname: str, host_pid: int = 0) -> None:
    """Move the calling process onto a test host, at its start (before it opens a socket
    or starts a thread): into the host's network namespace, and into its UTS and IPC
    namespaces, those of `host_pid` (`TestHost.holder_pid`; 0: new ones of its own under
    `hostname`). Its pids stay the machine's (a process cannot change pid namespace).
    Used by harness workers a benchmark puts on hosts."""
    if host_pid:
        for ns, flag in (("net", CLONE_NEWNET), ("uts", CLONE_NEWUTS), ("ipc", CLONE_NEWIPC)):
            _setns(f"/proc/{host_pid}/ns/{ns}", flag)
        if socket.gethostname() != hostname:
            raise HostError(f"pid {host_pid} is not on host {hostname!r}")
        return
    _setns(f"/run/netns/{netns}", CLONE_NEWNET)
    if _libc.unshare(CLONE_NEWUTS | CLONE_NEWIPC) != 0:
        raise HostError(f"unshare(UTS, IPC) failed: {os.strerror(ctypes.get_errno())}")
    socket.sethostname(hostname)


def _setns(path: str, flag: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _setns_fd(fd, flag)
    except HostError as exc:
        raise HostError(f"{path}: {exc}") from None
    finally:
        os.close(fd)


def _setns_fd(fd: int, flag: int) -> None:
    if _libc.setns(fd, flag) != 0:
        raise HostError(f"setns failed: {os.strerror(ctypes.get_errno())}")


@dataclass
class HostNetwork:
    """Test hosts on one bridge. Use as a context manager (or call `close`)."""

    tag: str = field(default_factory=lambda: f"{os.getpid() % 0xFFFF:04x}")
    hosts: dict[str, TestHost] = field(default_factory=dict)
    #: where each host's output goes (`TestHost.log_path`); by default a temporary
    #: directory removed by `close`, a given one is kept
    log_dir: Path | None = None
    _bridge: str | None = None
    _own_log_dir: bool = False

    def __post_init__(self) -> None:
        reason = missing()
        if reason:
            raise HostError(reason)
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="kvbh-logs-"))
            self._own_log_dir = True
        atexit.register(self.close)

    @property
    def bridge(self) -> str:
        if self._bridge is None:
            name = f"kvbh{self.tag}br"
            sh(["ip", "link", "add", name, "type", "bridge"])
            self._bridge = name
            sh(["ip", "link", "set", name, "up"])
        return self._bridge

    def add(self, name: str) -> TestHost:
        """A new host `name` (hostname too) at the next address of the subnet."""
        if name in self.hosts:
            raise HostError(f"host name {name!r} is taken; pick another")
        i = len(self.hosts)
        host = TestHost(
            name,
            f"kvbh-{self.tag}-{name}",
            f"kvbh{self.tag}v{i}",
            f"{SUBNET}.{i + 1}",
            Path(self.log_dir or ".") / f"{name}.log",
        )
        bridge = self.bridge
        sh(["ip", "netns", "add", host.netns])
        self.hosts[name] = host  # from here on close() removes it
        peer = ["peer", "name", "eth0", "netns", host.netns]
        sh(["ip", "link", "add", host.veth, "type", "veth", *peer])
        sh(["ip", "link", "set", host.veth, "master", bridge, "up"])
        host.run(["ip", "addr", "add", f"{host.address}/24", "dev", "eth0"])
        host.run(["ip", "link", "set", "eth0", "up"])
        host.run(["ip", "link", "set", "lo", "up"])
        return host

    def close(self) -> None:
        """Kill every host's processes, delete namespaces, veths and the bridge.
        Idempotent; tries every step even when one fails, then raises the first error."""
        errors: list[Exception] = []
        for host in self.hosts.values():
            for step in (host.kill, lambda h=host: sh(["ip", "netns", "del", h.netns])):
                try:
                    step()
                except Exception as exc:
                    errors.append(exc)
            # a veth dies with its namespace's end; make sure of it
            sh(["ip", "link", "del", host.veth], check=False)
        self.hosts.clear()
        if self._bridge is not None:
            sh(["ip", "link", "del", self._bridge], check=False)
            self._bridge = None
        if self._own_log_dir and self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        atexit.unregister(self.close)
        if errors:
            raise errors[0]

    def __enter__(self) -> HostNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
