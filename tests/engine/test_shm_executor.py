"""The multi-process executor (ShmExecutor): failures in workers reach the driver with
their reason, promptly."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from kvbridge.engine.config import EngineConfig
from kvbridge.engine.errors import WorkerError
from kvbridge.engine.shm_executor import ShmExecutor
from kvbridge.engine.step import StepBatch
from tests.engine.helpers import save_model

pytestmark = pytest.mark.slow


def test_worker_load_failure_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(WorkerError, match=r"tp workers failed to start: (?s:.*)not a GGUF file"):
        ShmExecutor(bad, EngineConfig(tp_size=3, num_blocks=4, worker_timeout_s=120))


def test_dead_worker_fails_the_step_not_hangs(tmp_path: Path) -> None:
    save_model("llama", tmp_path)
    ex = ShmExecutor(tmp_path, EngineConfig(tp_size=2, num_blocks=4, worker_timeout_s=120))
    batch = StepBatch(
        input_ids=[1, 2, 3],
        positions=[0, 1, 2],
        slot_mapping=[0, 1, 2],
        query_lens=[3],
        context_lens=[3],
        block_tables=[[0]],
        want_logits=[True],
    )
    assert ex.execute(batch).shape == (1, 49152)
    os.kill(ex.group.pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"tp step failed: (?s:.*)rank 1(?s:.*)-9"):
        ex.execute(batch)
    assert time.monotonic() - t0 < 30
    ex.close()
