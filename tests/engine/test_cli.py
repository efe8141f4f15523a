"""`kvbridge generate` in-process, and the same command under torchrun at tp 3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.cli import generate_cmd

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_generate_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = generate_cmd.main(
        ["--json", "--quiet", "--max-tokens", "4", "--num-blocks", "16", "The capital of France is"]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"].startswith(" Paris")
    assert out["token_ids"][0] == 7042 and len(out["token_ids"]) == 4
    assert out["prompt_ids"] == [504, 3575, 282, 4649, 314]
    assert out["timings"]["ttft_s"] > 0


def test_generate_streams_text(capsys: pytest.CaptureFixture[str]) -> None:
    rc = generate_cmd.main(
        [
            "--quiet",
            "--max-tokens",
            "3",
            "--num-blocks",
            "16",
            "--chat",
            "What is the capital of France?",
        ]
    )
    assert rc == 0
    assert capsys.readouterr().out.strip()


def test_generate_refuses_bad_tp(capsys: pytest.CaptureFixture[str]) -> None:
    assert generate_cmd.main(["--tp", "2", "hello"]) == 2
    assert "tp_size=2 does not divide num_attention_heads=9" in capsys.readouterr().err


def test_generate_under_torchrun_tp3() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "3",
        "-m",
        "kvbridge.cli.generate_cmd",
        "--tp",
        "3",
        "--json",
        "--quiet",
        "--max-tokens",
        "4",
        "--num-blocks",
        "16",
        "The capital of France is",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1  # only rank 0 prints
    out = json.loads(lines[0])
    assert out["token_ids"] == [7042, 30, 198, 198] and out["tp_size"] == 3


def test_bench_engine_prints_the_no_communication_floor() -> None:
    args = [
        "--tp-sizes",
        "1,3",
        "--floor",
        "--no-transformers",
        "--prompt-tokens",
        "32",
        "--repeat",
        "1",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "kvbridge.bench.engine", *args, "--decode-tokens", "3"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0] + line.split()[1]: line.split() for line in out.stdout.splitlines()}
    for row in ("enginetp1", "enginetp3", "floortp3", "switchtp3"):
        assert row in rows, out.stdout
    # the floor rows carry a step time and its ratio to tp 1 (ms/tok, tok/s, step vs tp1)
    ms, per_s, vs_tp1 = (float(v) for v in rows["floortp3"][2:5])
    assert ms > 0 and abs(per_s - 1e3 / ms) < 0.2 and vs_tp1 > 0


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"], ["demo"]])
def test_bad_cache_layout_exits_2_naming_the_value_and_the_names(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvbridge.cli.main import main

    flag = "--cache-layout" if command[0] == "generate" else "--decode-layout"
    with pytest.raises(SystemExit) as exit_:
        main([*command, flag, "BHNLK"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "cache layout='BHNLK' is not a valid axis order (axes missing: C)" in err
    assert "use HND, NHD, BHLNC, BLHNC, BLNHC, LBHNC, LBNHC" in err
