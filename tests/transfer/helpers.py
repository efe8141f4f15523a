"""Helpers the transfer tests (and the test hosts' tests) share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bench_transfer(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "kvbridge.cli.main", "bench", "transfer", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
