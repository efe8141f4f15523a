"""What a KV export process may still do once its agent is up: a seccomp filter.

A peer holding the export process's NIXL metadata can write into its memory on the
software transports (UCX checks no bounds there), so it may crash the process or, in
principle, run code in it. The export process then must not be a way into its worker
or the host: once its agent is made (which loads NIXL's and UCX's libraries and reads
their files), `deny_escape()` installs a filter, on every thread of the process, that
refuses with EPERM every system call that opens a file (so also /proc/PID/mem), runs a
program, reads or writes another process's memory (ptrace, process_vm_readv/writev,
pidfd_getfd) or signals a process (kill). Its KV mapping is read-only from a read-only
file descriptor (`export.py`), so it cannot be made writable either. What stays allowed
is what serving READs needs: its pipes, sockets, memory, threads. (UCX over TCP opens
/sys/class/net/IF and /proc/net/route at each new connection to estimate the link's speed;
refused, it logs a warning and an error and falls back to its defaults; the export
process runs UCX with only fatal errors logged unless UCX_LOG_LEVEL is set.)

Linux on x86-64 and AArch64; elsewhere `deny_escape` returns False and the export
process runs without the filter (the caller logs it).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct

_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1
_RET_ALLOW = 0x7FFF0000
_RET_KILL_PROCESS = 0x80000000
_RET_EPERM = 0x00050000 | errno.EPERM
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06

#: machine -> (AUDIT_ARCH, seccomp syscall number, the denied system calls' numbers)
_ARCHES: dict[str, tuple[int, int, dict[str, int]]] = {
    "x86_64": (
        0xC000003E,
        317,
        {
            "open": 2,
            "creat": 85,
            "openat": 257,
            "openat2": 437,
            "name_to_handle_at": 303,
            "open_by_handle_at": 304,
            "execve": 59,
            "execveat": 322,
            "ptrace": 101,
            "process_vm_readv": 310,
            "process_vm_writev": 311,
            "pidfd_open": 434,
            "pidfd_getfd": 438,
            "process_madvise": 440,
            "kill": 62,
        },
    ),
    "aarch64": (
        0xC00000B7,
        277,
        {
            "openat": 56,
            "openat2": 437,
            "name_to_handle_at": 264,
            "open_by_handle_at": 265,
            "execve": 221,
            "execveat": 281,
            "ptrace": 117,
            "process_vm_readv": 270,
            "process_vm_writev": 271,
            "pidfd_open": 434,
            "pidfd_getfd": 438,
            "process_madvise": 440,
            "kill": 129,
        },
    ),
}
#: x86-64's x32 ABI numbers have this bit set: refused too
_X32_BIT = 0x40000000


def denied_calls() -> list[str]:
    """The system calls `deny_escape` refuses on this machine (empty: no filter here)."""
    arch = _ARCHES.get(platform.machine())
    return sorted(arch[2]) if arch else []


def _program(audit_arch: int, denied: list[int]) -> bytes:
    def insn(code: int, jt: int, jf: int, k: int) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    n = len(denied)
    out = [
        insn(_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        insn(_JEQ_K, 1, 0, audit_arch),
        insn(_RET_K, 0, 0, _RET_KILL_PROCESS),  # another ABI: nothing is allowed
        insn(_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        insn(_JGE_K, n + 1, 0, _X32_BIT),  # -> the EPERM below
    ]
    for i, nr in enumerate(denied):
        out.append(insn(_JEQ_K, n - i, 0, nr))  # -> the EPERM below
    out += [insn(_RET_K, 0, 0, _RET_ALLOW), insn(_RET_K, 0, 0, _RET_EPERM)]
    return b"".join(out)


def deny_escape() -> bool:
    """Install the filter on every thread of this process, for good; False where this
    machine has none (see the module docstring). Raises OSError if the kernel refuses."""
    arch = _ARCHES.get(platform.machine())
    if arch is None:
        return False
    audit_arch, seccomp_nr, calls = arch
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    prog = _program(audit_arch, sorted(calls.values()))
    buf = ctypes.create_string_buffer(prog, len(prog))

    class _Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = _Fprog(len(prog) // 8, ctypes.cast(buf, ctypes.c_void_p))
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    rc = syscall(
        ctypes.c_long(seccomp_nr),
        ctypes.c_long(_SECCOMP_SET_MODE_FILTER),
        ctypes.c_long(_SECCOMP_FILTER_FLAG_TSYNC),
        ctypes.byref(fprog),
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp filter refused: {os.strerror(err)} (thread {rc})")
    return True
