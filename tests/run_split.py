"""`make unit`: the suite in two lanes at once, each a few pytest processes one after
the other, since one process uses about 85 % of one core of two (its tests wait on
processes starting, links, leases and timeouts).

Two packages hold most of the memory: the serve package's shared instances (about 10 GB)
and the engine package's oracle and engines (about 9 GB); side by side they reached 21
GB of the machine's 24 GiB. So the engine package starts only once the serve package has
ended, and each of them runs beside lighter work: the first lane runs the serve package,
then the test hosts' three-host deployment (about 4 GB) and the parallel package; the
second runs every other package and file, starting with those that start no process (the planner's, the contract's: the two cores go to the
serve package's two dozen workers starting meanwhile), then makes the engine tests'
oracle (transformers' conversion of the GGUF, 20-40 s of CPU on a machine that has none
saved: `tests/engine/oracle.py`) while the serve package ends, then the engine package
and the GPU suite's collection checks. The split keeps the two lanes' ends within a
minute of each other (docs/benchmarks.md).

The steps run with `OMP_NUM_THREADS=1` unless it is set: every engine then computes with
one torch thread (`EngineConfig.torch_threads`). OpenMP's threads spin while they wait,
so an engine's two threads beside the other lane's processes made its steps 2-4x slower
than one thread (docs/benchmarks.md, "Measurements behind the defaults").

Each step's output is printed whole once all end (Ctrl-C or SIGTERM stops the running
steps and starts no other; what they wrote is still printed); the exit status is the
first failure's (a step that collected no test is none). Options after the script's
name go to every pytest step.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: pytest's exit status when it collected no test (e.g. `-k` matched only other steps').
NO_TESTS = 5
#: How often the lanes are looked at (a step ended, the next one may start).
POLL_S = 0.5


@dataclass(frozen=True)
class Step:
    """One pytest process: `paths` (none: every package and test file under tests/ that
    no other step names, those in `EARLY` first), or with `module` that module run alone
    (`python -m`; the options are pytest's, not its); started once its lane's previous
    step and every step in `after` have ended."""

    name: str
    paths: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    module: str = ""


#: The packages the "others" step runs first (they start no process).
EARLY = ("tests/plan", "tests/connector")
LANES: tuple[tuple[Step, ...], ...] = (
    (
        Step("serve", ("tests/serve",)),
        Step("hosts", ("tests/hosts", "tests/parallel")),
    ),
    (
        Step("others"),
        Step("oracle", module="tests.engine.oracle"),
        Step("engine", ("tests/engine",), after=("serve",)),
        Step("gpu-suite", ("tests/test_gpu_suite.py",)),
    ),
)


def others() -> list[str]:
    """Every package and test file under tests/ that no step names, `EARLY` first."""
    named = {path for lane in LANES for step in lane for path in step.paths}
    found = sorted(
        f"tests/{p.name}"
        for p in Path(ROOT, "tests").iterdir()
        if (p.is_dir() and (p / "__init__.py").exists())
        or (p.name.startswith("test_") and p.suffix == ".py")
    )
    rest = [p for p in found if p not in named]
    return [p for p in EARLY if p in rest] + [p for p in rest if p not in EARLY]


def command(step: Step, extra: list[str]) -> list[str]:
    if step.module:
        return [sys.executable, "-m", step.module]
    return [sys.executable, "-m", "pytest", *extra, *(step.paths or others())]


@dataclass
class _Run:
    step: Step
    cmd: list[str]
    proc: subprocess.Popen[bytes]
    log: Path
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None


def main(argv: list[str]) -> int:
    started = time.monotonic()
    runs: dict[str, _Run] = {}
    stopping: list[int] = []

    def stop(signum: int, frame: object) -> None:  # Ctrl-C, a CI timeout: all stop
        stopping.append(signum)
        for run in runs.values():
            if run.proc.poll() is None:
                run.proc.send_signal(signum)

    def ended(name: str) -> bool:
        run = runs.get(name)
        return run is not None and run.ended is not None

    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", "1")
    tmp = Path(tempfile.mkdtemp(prefix="kvbridge-suite-"))
    print(f"===== {len(LANES)} lanes of pytest processes; their output is in {tmp}", flush=True)
    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stopping:
            for run in runs.values():
                if run.ended is None and run.proc.poll() is not None:
                    run.ended = time.monotonic()
            busy = False
            for lane in LANES:
                todo = [s for s in lane if s.name not in runs]
                running = [s for s in lane if s.name in runs and not ended(s.name)]
                if running or todo:
                    busy = True
                if running or not todo or not all(ended(a) for a in todo[0].after):
                    continue
                step = todo[0]
                cmd = command(step, argv)
                log = Path(tmp, f"{step.name}.log")
                with open(log, "wb") as out:
                    proc = subprocess.Popen(
                        cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
                    )
                runs[step.name] = _Run(step, cmd, proc, log)
            if not busy:
                break
            time.sleep(POLL_S)
        for run in runs.values():
            run.proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for run in runs.values():
            took = (run.ended or time.monotonic()) - run.started
            print(
                f"===== {run.step.name} ({run.started - started:.0f} s after the start, "
                f"{took:.0f} s): {' '.join(run.cmd[1:])}: exit {run.proc.poll()}"
            )
            sys.stdout.flush()
            sys.stdout.buffer.write(run.log.read_bytes())
            sys.stdout.flush()
        shutil.rmtree(tmp, ignore_errors=True)
    codes = [run.proc.returncode for run in runs.values()]
    print(f"===== every pytest process done in {time.monotonic() - started:.0f} s: exit {codes}")
    if stopping:
        return 128 + stopping[0]
    # 5 (no test collected) from one step is not a failure when another ran tests
    failed = [c for c in codes if c not in (0, NO_TESTS)]
    if failed:
        return failed[0]
    return NO_TESTS if codes and all(c == NO_TESTS for c in codes) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
