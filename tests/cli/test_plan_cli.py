"""`kvbridge plan` as a user runs it: a subprocess, its exit code, stdout and stderr."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def kvbridge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbridge.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_seed_scenario_json_contract():
    out = kvbridge(
        "plan",
        "--config",
        "llama-3.2-1b",
        "--prefill-tp",
        "8",
        "--decode-tp",
        "16",
        "--verify",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)  # exactly one object
    assert obj["supported"] is True and obj["error"] is None and obj["verified"] is True
    assert obj["model"] == {
        "num_layers": 16,
        "num_kv_heads": 8,
        "head_dim": 64,
        "attention": "gqa",
        "dtype": "bfloat16",
    }
    assert obj["prefill"] == {"tp": 8, "pp": 1, "block_size": 16, "layout": "BHLNC"}
    assert obj["decode"]["tp"] == 16
    assert len(obj["workers"]["prefill"]) == 8 and len(obj["workers"]["decode"]) == 16
    assert obj["workers"]["decode"][5] == {
        "rank": 5,
        "tp_rank": 5,
        "pp_rank": 0,
        "kv_heads": [2, 3],
        "layers": [0, 16],
    }
    assert obj["reads"][5] == {
        "decode_rank": 5,
        "prefill_rank": 2,
        "kv_heads": [2, 3],
        "layers": [0, 16],
        "bytes_per_token": 16 * 2 * 64 * 2,
    }
    assert obj["expected_notifications"] == [2] * 8


def test_table_output_and_verify():
    out = kvbridge(
        "plan",
        "--config",
        "smollm2-135m",
        "--prefill-tp",
        "9",
        "--decode-tp",
        "3",
        "--decode-layout",
        "NHD",
        "--decode-block-size",
        "32",
        "--verify",
    )
    assert out.returncode == 0, out.stderr
    assert "verified byte-exact" in out.stdout
    assert "unused replica" in out.stdout  # prefill tp 9 -> decode tp 3 leaves 6 idle


def test_mla_workers_hold_the_whole_latent():
    out = kvbridge(
        "plan",
        "--config",
        "deepseek-v2-lite",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "1",
        "--json",
        "--verify",
    )
    obj = json.loads(out.stdout)
    assert out.returncode == 0 and obj["model"]["attention"] == "mla"
    assert all(w["kv_heads"] == [0, 1] for w in obj["workers"]["prefill"])
    assert obj["reads"] == [
        {
            "decode_rank": 0,
            "prefill_rank": 0,
            "kv_heads": [0, 1],
            "layers": [0, 27],
            "bytes_per_token": 27 * 576 * 2,
        }
    ]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--decode-tp", "6"], "decode tp_size=6 does not divide num_attention_heads=32"),
        (["--prefill-tp", "abc"], "prefill tp_size='abc' must be a positive integer"),
        (["--decode-block-size", "0"], "decode block_size=0 must be a positive integer"),
        (
            ["--decode-layout", "XHD"],
            "decode cache layout='XHD' is not a valid axis order (letters other than BLKHNC); "
            "use HND, NHD, BHLNC, BLHNC, BLNHC, LBHNC, LBNHC",
        ),
        (["--prefill-layout", "BHLCN"], "C (channel) not innermost"),
        (["--decode-pp", "17"], "decode pp_size=17 exceeds num_layers=16"),
    ],
)
def test_unsupported_pairs_exit_2_with_reason(args, words):
    out = kvbridge("plan", "--config", "llama-3.2-1b", *args)
    assert out.returncode == 2
    assert words in out.stderr and "Traceback" not in out.stderr
    assert out.stdout == ""
    out = kvbridge("plan", "--config", "llama-3.2-1b", *args, "--json")
    assert out.returncode == 2
    obj = json.loads(out.stdout)
    assert obj["supported"] is False and words in obj["error"]


def test_bad_config_file(tmp_path: Path):
    bad = tmp_path / "config.json"
    bad.write_text('{"num_hidden_layers": 4,')
    out = kvbridge("plan", "--config", str(bad), "--json")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    obj = json.loads(out.stdout)
    assert obj["supported"] is False and "not valid JSON" in obj["error"]
    bad.write_text('{"num_hidden_layers": 4, "num_attention_heads": 8, "torch_dtype": "bfloat16"}')
    out = kvbridge("plan", "--config", str(bad))
    assert out.returncode == 2 and "hidden_size is missing" in out.stderr


def test_bench_plan_prints_figures():
    out = kvbridge("bench", "plan", "--tokens", "4096", "--repeat", "1")
    assert out.returncode == 0, out.stderr
    assert "merged == contiguous runs: yes" in out.stdout
    assert all(name in out.stdout for name in ("BHLNC", "LBHNC", "LBNHC"))
