"""Multi-process executor: failures in workers reach the driver with their reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.engine.config import EngineConfig
from kvbridge.engine.errors import WorkerError
from kvbridge.engine.step import StepBatch
from kvbridge.engine.tp_launcher import ProcessExecutor

from .test_hf_dir import _save_model

pytestmark = pytest.mark.slow


def test_worker_load_failure_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(WorkerError, match=r"failed during start: .*not a GGUF file"):
        ProcessExecutor(bad, EngineConfig(tp_size=3, num_blocks=4, worker_timeout_s=120))


def test_dead_worker_fails_the_step_not_hangs(tmp_path: Path) -> None:
    _save_model("llama", tmp_path)
    ex = ProcessExecutor(tmp_path, EngineConfig(tp_size=2, num_blocks=4, worker_timeout_s=120))
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
    ex._procs[1].kill()
    ex._procs[1].wait(timeout=10)
    with pytest.raises(WorkerError, match=r"tp worker 1 died \(exit code -9"):
        ex.execute(batch)
    ex.close()
