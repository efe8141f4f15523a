"""The KV export process's seccomp filter (`kvbridge.transfer.sandbox`), tried from a
process of its own as code running in a taken-over export process would: every way out
is refused, serving (pipes, sockets, memory, threads) still works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kvbridge.transfer.sandbox import denied_calls

PROBE = textwrap.dedent(
    """
    import ctypes, json, os, socket, subprocess, sys, threading
    from kvbridge.transfer.sandbox import deny_escape

    parent = os.getppid()
    r, w = os.pipe()
    from_before = []

    def before():  # a thread started before the filter, trying once it is installed
        os.read(r, 1)
        try:
            open("/etc/hostname", "rb")
            from_before.append("allowed")
        except OSError as exc:
            from_before.append(exc.errno)

    earlier = threading.Thread(target=before)
    earlier.start()
    assert deny_escape()
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(8)
    iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)

    def vm_read():
        if libc.syscall(310, parent, iov, 1, iov, 1, 0) < 0:  # process_vm_readv
            raise OSError(ctypes.get_errno(), "process_vm_readv")

    def ptrace():
        if libc.ptrace(16, parent, 0, 0) < 0:  # PTRACE_ATTACH
            raise OSError(ctypes.get_errno(), "ptrace")

    out = {}
    tries = {
        "open a file": lambda: open("/etc/hostname", "rb"),
        "open the worker's memory": lambda: open(f"/proc/{parent}/mem", "rb"),
        "run a program": lambda: subprocess.run(["true"]),
        "signal the worker": lambda: os.kill(parent, 0),
        "read the worker's memory": vm_read,
        "attach to the worker": ptrace,
    }
    for what, attempt in tries.items():
        try:
            attempt()
            out[what] = "allowed"
        except OSError as exc:
            out[what] = exc.errno
    seen = []
    t = threading.Thread(target=lambda: seen.append(os.read(r, 1)))
    t.start()
    os.write(w, b"xy")  # pipes and threads work
    t.join(); earlier.join()
    a, b = socket.socketpair()  # sockets work
    a.send(b"ok")
    out["serving"] = b.recv(2).decode() + str(len(seen))
    out["open in a thread from before"] = from_before[0]
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the probe's numbers are x86-64's")
def test_a_taken_over_export_process_cannot_open_run_or_reach_another_process() -> None:
    assert {"openat", "execve", "ptrace", "process_vm_readv", "kill"} <= set(denied_calls())
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    serving = out.pop("serving")
    assert serving == "ok1"
    assert len(out) == 7 and set(out.values()) == {1}, out  # EPERM, every one
