"""Start a whole disaggregated deployment on this machine: a prefill instance and a
decode instance as child processes (each with its own tp workers), then the proxy.

Children are started as `python -m kvbridge.serve.instance_main CONFIG.json` (their
`InstanceConfig` as one JSON document) in their own process groups (Ctrl-C in a terminal
reaches us, not them) of our session (so the scheduler weighs their threads against each
other, and `--cpu-priority` lets transfers, then prefills, come before decodes);
`Deployment.stop()` (also on Ctrl-C, errors and interpreter exit) terminates them and
their workers. Every wait is bounded.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from kvbridge.errors import KVBridgeError
from kvbridge.serve.config import InstanceConfig

if TYPE_CHECKING:
    from kvbridge.connector import RootKey


def _new_root() -> RootKey:
    from kvbridge.connector import RootKey

    return RootKey.generate()


class LaunchError(KVBridgeError):
    """An instance did not come up (it exited, or was not healthy in time)."""


@dataclass
class Child:
    """One instance process. It binds a free port itself and writes it to `port_file`
    (picking a port here and passing it down would race with other listeners)."""

    name: str
    host: str
    port_file: Path
    proc: subprocess.Popen[bytes]
    scheme: str = "http"
    port: int = 0

    @property
    def url(self) -> str:
        if not self.port:
            deadline = time.monotonic() + 1800
            while not self.port_file.exists():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise LaunchError(
                        f"{self.name} instance exited with status "
                        f"{self.proc.returncode} before listening"
                    )
                time.sleep(0.05)
            self.port = int(self.port_file.read_text())
        return f"{self.scheme}://{self.host}:{self.port}"


def _signal_exit(signum: int, frame: object) -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):  # once: a second one must not cut the stop
        signal.signal(sig, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def _exit_cleanly_on_signals() -> None:
    """Make SIGTERM and SIGHUP (the terminal closed) raise SystemExit, so `finally`
    blocks and atexit stop the instances.

    The default action ends the process at once, and uvicorn re-raises the SIGTERM it
    caught once the proxy has shut down: either way the instances (in their own
    process groups, which a terminal's SIGHUP does not reach) would be left running.
    Only from the main thread, and only over a default handler."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _signal_exit)


@dataclass
class Deployment:
    """The instance processes of one `kvbridge serve`; the proxy runs in the caller."""

    #: how the instances' HTTPS is checked (`DeploymentConfig.instance_tls`)
    verify: ssl.SSLContext | None = None
    children: list[Child] = field(default_factory=list)
    _tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvbridge-")))
    #: the deployment's root key (`kvbridge.connector.RootKey`), made for this run
    root: RootKey = field(default_factory=lambda: _new_root())

    def __post_init__(self) -> None:
        _exit_cleanly_on_signals()

    def start_instance(self, name: str, config: InstanceConfig) -> Child:
        """Start one instance process with `config` (its port: any free one, reported
        through a file). The child receives the config as one JSON document in a file
        only we can read, and binds `config.host`; and, unless the config names one, a
        credential for its role, enrolled by this deployment's root (`root`), which
        stays in this process."""
        n = len(self.children)
        port_file = self._tmp / f"{name}-{n}.port"
        config_file = self._tmp / f"{name}-{n}.json"
        config = dataclasses.replace(config, port=0, port_file=str(port_file))
        if config.credential_file is None:
            credential_file = self._tmp / f"{name}-{n}.credential"
            self.root.enroll((config.connector_role,), name).save(credential_file)
            config = dataclasses.replace(config, credential_file=str(credential_file))
        doc = config.to_json()
        fd = os.open(config_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(doc)
        cmd = [sys.executable, "-m", "kvbridge.serve.instance_main", str(config_file)]
        proc = subprocess.Popen(cmd, process_group=0, stdin=subprocess.DEVNULL)
        child = Child(name, config.host, port_file, proc, config.scheme)
        self.children.append(child)
        atexit.register(self.stop)
        return child

    def wait_healthy(self, timeout_s: float, say: object = print) -> None:
        """Return once every child answers /health 200; raise LaunchError naming the one
        that exited or is still not up after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.children)
        last_note = 0.0
        while pending:
            for child in list(pending):
                code = child.proc.poll()
                if code is not None:
                    raise LaunchError(
                        f"{child.name} instance exited with status {code} while "
                        "starting; its output above says why"
                    )
                if not child.port_file.exists():
                    continue
                try:
                    health = httpx.get(
                        f"{child.url}/health", timeout=1.0, verify=self.verify or True
                    )
                    if health.status_code == 200:
                        pending.remove(child)
                        if callable(say):
                            say(f"{child.name} instance ready at {child.url}")
                except httpx.HTTPError:
                    pass
            now = time.monotonic()
            if pending and now > deadline:
                names = ", ".join(c.name for c in pending)
                raise LaunchError(f"{names} not healthy within {timeout_s:.0f} s")
            if pending and now - last_note > 15 and callable(say):
                say("waiting for " + ", ".join(c.name for c in pending) + " to load ...")
                last_note = now
            time.sleep(0.2)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM each instance (it stops its engine and tp workers itself), then SIGKILL
        the process group of any that is still there after `timeout_s`."""
        for child in self.children:
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.terminate()
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            remaining = max(0.1, deadline - time.monotonic())
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(remaining)
            # tp workers exit on their own when their driver goes; make sure of it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGKILL)
            child.proc.wait(5)
        self.children.clear()
        shutil.rmtree(self._tmp, ignore_errors=True)
