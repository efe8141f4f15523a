"""`make unit`: the suite as two pytest processes at once, since one uses about 85 % of
one core of two (its tests wait on processes starting, links, leases and timeouts).

The first process runs the packages that hold the most memory, one after the other (the
serve package's shared instances, about 10 GB; the engine package's oracle and tp 9
engines, about 9 GB), then the parallel package (worker groups of up to nine processes,
after the engine package let go of its engines) and the GPU suite's collection checks
(pytest in subprocesses), so that both processes end near the same time; the second runs
every other package (the test hosts' three-host deployment, about 4 GB, among them), so
the two never add up to the machine's 24 GiB. The second starts with the packages that
start no process (the planner's, the contract's), while the first starts the serve
package's two dozen workers: the two cores go to that start rather than to another.
Each process's output is printed whole once both end (Ctrl-C or SIGTERM stops both,
and what they wrote is still printed); the exit status is the first failure's (a half
that collected no test is none). Options after the script's name go to both processes.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: pytest's exit status when it collected no test (e.g. `-k` matched only the other half).
NO_TESTS = 5
#: The first process's packages and files, in order; the second runs all the others.
FIRST = ("tests/serve", "tests/engine", "tests/parallel", "tests/test_gpu_suite.py")
#: The second process's first packages (they start no process), then the others by name.
SECOND_EARLY = ("tests/plan", "tests/connector")


def second() -> list[str]:
    """The second process's packages and test files: `SECOND_EARLY`, then every other
    one under tests/ that `FIRST` does not hold."""
    found = sorted(
        f"tests/{p.name}"
        for p in Path(ROOT, "tests").iterdir()
        if (p.is_dir() and (p / "__init__.py").exists())
        or (p.name.startswith("test_") and p.suffix == ".py")
    )
    return [*SECOND_EARLY, *(p for p in found if p not in FIRST + SECOND_EARLY)]


def commands(extra: list[str]) -> list[list[str]]:
    pytest = [sys.executable, "-m", "pytest", *extra]
    return [[*pytest, *FIRST], [*pytest, *second()]]


def main(argv: list[str]) -> int:
    started = time.monotonic()
    runs: list[tuple[list[str], subprocess.Popen[bytes], Path]] = []

    def stop(signum: int, frame: object) -> None:  # Ctrl-C, a CI timeout: both stop
        for _, proc, _ in runs:
            proc.send_signal(signum)

    tmp = Path(tempfile.mkdtemp(prefix="kvbridge-suite-"))
    print(f"===== two pytest processes; their output is in {tmp} until both end", flush=True)
    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for i, cmd in enumerate(commands(argv)):
            log = Path(tmp, f"{i}.log")
            with open(log, "wb") as out:
                proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
            runs.append((cmd, proc, log))
        for _, proc, _ in runs:
            proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for cmd, proc, log in runs:
            print(f"===== {' '.join(cmd[1:])}: exit {proc.poll()}")
            sys.stdout.flush()
            sys.stdout.buffer.write(log.read_bytes())
            sys.stdout.flush()
        shutil.rmtree(tmp, ignore_errors=True)
    codes = [proc.returncode for _, proc, _ in runs]
    print(f"===== both pytest processes done in {time.monotonic() - started:.0f} s: exit {codes}")
    # 5 (no test collected) from one half is not a failure when the other ran tests
    failed = [c for c in codes if c not in (0, NO_TESTS)]
    if failed:
        return failed[0]
    return NO_TESTS if codes and all(c == NO_TESTS for c in codes) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
