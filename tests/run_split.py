"""`make unit`: the suite as two pytest processes at once, since one uses about 85 % of
one core of two (its tests wait on processes starting, links, leases and timeouts).

The first process runs the packages that hold the most memory, one after the other (the
serve package's shared instances, about 10 GB; the engine package's oracle and tp 9
engines, about 9 GB); the second runs every other package (the test hosts' three-host
deployment, about 4 GB, among them), so the two never add up to the machine's 24 GiB.
Each process's output is printed whole once it ends, in order; the exit status is the
first non-zero one. Arguments after the script's name go to both processes.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The first process's packages, in order; the second runs all the others.
HEAVY = ("tests/serve", "tests/engine")


def commands(extra: list[str]) -> list[list[str]]:
    pytest = [sys.executable, "-m", "pytest", *extra]
    rest = [arg for package in HEAVY for arg in ("--ignore", package)]
    return [[*pytest, *HEAVY], [*pytest, "tests", *rest]]


def main(argv: list[str]) -> int:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvbridge-suite-") as tmp:
        runs = []
        for i, cmd in enumerate(commands(argv)):
            log = open(Path(tmp, f"{i}.log"), "w+b")  # noqa: SIM115 (closed below)
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            runs.append((cmd, proc, log))
        codes = []
        for cmd, proc, log in runs:
            codes.append(proc.wait())
            log.seek(0)
            print(f"===== {' '.join(cmd[1:])}: exit {codes[-1]}", flush=True)
            sys.stdout.buffer.write(log.read())
            sys.stdout.flush()
            log.close()
    print(f"===== both pytest processes done in {time.monotonic() - started:.0f} s: exit {codes}")
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
