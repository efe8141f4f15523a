"""`kvbridge plan` as a user runs it: a subprocess, its exit code, stdout and stderr."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvbridge.cli.plan_report import format_bytes
from kvbridge.plan.geometry import load_model_spec
from kvbridge.plan.layout import InstanceLayout
from kvbridge.plan.planner import TransferPlan, make_plan


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


def test_vllm_cpu_pages_across_block_sizes_verify():
    """vLLM's CPU layout (K channel-major) by its name, blocks 64 -> 32."""
    out = kvbridge(
        "plan",
        "--config",
        "smollm2-135m",
        "--decode-tp",
        "3",
        "--prefill-layout",
        "LBHKNC:K=CN",
        "--prefill-block-size",
        "64",
        "--decode-layout",
        "lbhknc:k=cn",
        "--decode-block-size",
        "32",
        "--verify",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    assert obj["verified"] is True
    assert obj["prefill"]["layout"] == obj["decode"]["layout"] == "LBHKNC:K=CN"


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
        (["--decode-layout", "LBHKNC:K=XY"], "after the order write K=CN, V=CN or K=CN,V=CN"),
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
    out = kvbridge("bench", "plan", "--tokens", "1024", "--repeat", "1")
    assert out.returncode == 0, out.stderr
    assert "merged == contiguous runs: yes" in out.stdout
    assert all(name in out.stdout for name in ("BHLNC", "LBHNC", "LBNHC"))


SVG = "{http://www.w3.org/2000/svg}"


def _svg_texts(el: ET.Element) -> list[str]:
    """The strings of every <text> under `el` (one per line of a multi-line label)."""
    return [t.text or "" for t in el.iter(f"{SVG}text")]


def _plan(config: str, prefill: tuple[int, int], decode: tuple[int, int]) -> TransferPlan:
    return make_plan(
        load_model_spec(config),
        InstanceLayout(tp_size=prefill[0], pp_size=prefill[1]),
        InstanceLayout(tp_size=decode[0], pp_size=decode[1]),
    )


@pytest.mark.parametrize(
    "config, prefill, decode",
    [
        ("smollm2-135m", (3, 1), (9, 1)),  # the README picture: decode replicas
        ("llama-3.2-1b", (2, 2), (4, 1)),  # prefill pp stages, two reads per decode worker
        ("smollm2-135m", (9, 1), (3, 1)),  # prefill replicas, six of them unused
    ],
    ids=["tp3-tp9", "tp2pp2-tp4", "tp9-tp3"],
)
def test_svg_map_draws_every_worker_and_one_arrow_per_read(config, prefill, decode, tmp_path):
    plan = _plan(config, prefill, decode)
    path = tmp_path / "plan.svg"
    out = kvbridge(
        "plan",
        "--config",
        config,
        "--prefill-tp",
        str(prefill[0]),
        "--prefill-pp",
        str(prefill[1]),
        "--decode-tp",
        str(decode[0]),
        "--decode-pp",
        str(decode[1]),
        "--svg",
        str(path),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().endswith(f"map written to {path} ({len(plan.reads)} reads)")

    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    by_id = {el.get("id"): el for el in root.iter() if el.get("id")}
    arrows = sorted(i for i in by_id if i.startswith("read-"))
    assert arrows == sorted(f"read-{i}" for i in range(len(plan.reads)))
    for i in arrows:  # each arrow is drawn: a stroked line and its head
        assert "stroke:" in by_id[i].find(f"{SVG}path").get("style", "")

    for side, letter, workers in (
        ("prefill", "P", plan.prefill_workers),
        ("decode", "D", plan.decode_workers),
    ):
        for w in workers:
            assert f"{side}-{w.rank}" in by_id  # the box
            assert _svg_texts(by_id[f"{side}-{w.rank}-name"]) == [
                f"{letter}{w.rank} tp{w.tp_rank}/pp{w.pp_rank}"
            ]
            details = _svg_texts(by_id[f"{side}-{w.rank}-text"])
            head, tail = w.kv_heads, w.layers
            assert details[0] == f"heads [{head[0]},{head[1]})  layers [{tail[0]},{tail[1]})"

    texts = _svg_texts(root)
    labels = [
        f"heads [{r.kv_heads[0]},{r.kv_heads[1]}) L[{r.layers[0]},{r.layers[1]}) "
        f"{format_bytes(r.bytes_per_token)}/tok"
        for r in plan.reads
    ]
    assert sorted(t for t in texts if t.endswith("/tok") and "L[" in t) == sorted(labels)
    assert any(plan.prefill.describe() in t and plan.decode.describe() in t for t in texts)


def test_svg_map_marks_stages_and_replicas(tmp_path):
    path = tmp_path / "pp.svg"
    args = ["plan", "--config", "llama-3.2-1b", "--prefill-tp", "2", "--prefill-pp", "2"]
    out = kvbridge(*args, "--decode-tp", "4", "--svg", str(path))
    assert out.returncode == 0, out.stderr
    texts = _svg_texts(ET.parse(path).getroot())
    # a band per prefill stage; none for decode's single stage
    assert [t for t in texts if t.startswith("pp")] == ["pp0 · layers [0,8)", "pp1 · layers [8,16)"]

    plan = _plan("smollm2-135m", (9, 1), (3, 1))
    path = tmp_path / "replicas.svg"
    args = ["plan", "--config", "smollm2-135m", "--prefill-tp", "9", "--decode-tp", "3"]
    out = kvbridge(*args, "--svg", str(path))
    assert out.returncode == 0, out.stderr
    by_id = {el.get("id"): el for el in ET.parse(path).getroot().iter() if el.get("id")}
    unused = [w.rank for w in plan.prefill_workers if plan.expected_notifications[w.rank] == 0]
    assert len(unused) == 6
    for w in plan.prefill_workers:
        status = _svg_texts(by_id[f"prefill-{w.rank}-text"])[1]
        assert status.startswith("unused replica") == (w.rank in unused), status
        assert status.startswith("replica") == (w.rank not in unused), status
        # every prefill worker shares its head with two others: a dashed edge
        assert "stroke-dasharray" in by_id[f"prefill-{w.rank}"].find(f"{SVG}path").get("style")
    for d in plan.decode_workers:  # decode tp 3 = num_kv_heads: no replicas
        assert "stroke-dasharray" not in by_id[f"decode-{d.rank}"].find(f"{SVG}path").get("style")
        assert "replica" not in " ".join(_svg_texts(by_id[f"decode-{d.rank}-text"]))


def test_svg_map_with_json_keeps_stdout_one_object(tmp_path):
    path = tmp_path / "plan.svg"
    args = ["plan", "--config", "smollm2-135m", "--prefill-tp", "3", "--decode-tp", "9"]
    out = kvbridge(*args, "--verify", "--json", "--svg", str(path))
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)  # exactly one object, nothing else
    assert obj["verified"] is True and len(obj["reads"]) == 9
    assert f"map written to {path} (9 reads)" in out.stderr
    assert ET.parse(path).getroot().tag == f"{SVG}svg"


def test_svg_map_errors_exit_2(tmp_path):
    # without matplotlib: `kvbridge plan` still runs, --svg says what to install
    no_matplotlib = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from kvbridge.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    plan = ["plan", "--config", "smollm2-135m", "--json"]
    run = [sys.executable, "-c", no_matplotlib, *plan]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and json.loads(out.stdout)["supported"] is True, out.stderr
    path = tmp_path / "plan.svg"
    out = subprocess.run([*run, "--svg", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert "--svg needs matplotlib; pip install 'kvbridge[map]'" in out.stderr
    assert "Traceback" not in out.stderr and not path.exists()

    out = kvbridge(*plan, "--svg", str(tmp_path / "missing" / "plan.svg"))
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    assert f"cannot write --svg {tmp_path / 'missing' / 'plan.svg'}" in out.stderr


@pytest.mark.parametrize(
    "config, decode_tp, before", [("smollm2-135m", 9, 3.0), ("deepseek-v2-lite", 8, 8.0)]
)
def test_json_shows_link_and_local_bytes_with_and_without_the_fan_out(config, decode_tp, before):
    """Prefill and decode on different hosts: every decode worker reading its bytes
    would move 3x the distinct KV over the link for SmolLM2 tp 3 -> 9, 8x for MLA at
    decode tp 8; the fan-out the runtime does reads each byte once per decode host and
    copies the rest there."""
    out = kvbridge(
        "plan",
        "--config",
        config,
        "--prefill-tp",
        "3" if config == "smollm2-135m" else "1",
        "--decode-tp",
        str(decode_tp),
        "--verify",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    distinct = obj["distinct_bytes_per_token"]
    assert obj["link_bytes_per_token_without_fan_out"] == before * distinct
    assert obj["link_bytes_per_token"] == distinct
    assert obj["local_bytes_per_token"] == (before - 1) * distinct
    fan = obj["fan_out"]
    assert fan["executed_by_runtime"] is True and fan["verified"] is True
    assert fan["link_bytes_per_token"] == distinct
    assert fan["local_bytes_per_token"] == (before - 1) * distinct
    assert len(fan["local_copies"]) == decode_tp - decode_tp / before
    # on as many hosts as replicas, every worker reads its own bytes again
    out = kvbridge(
        "plan",
        "--config",
        config,
        "--decode-tp",
        str(decode_tp),
        "--decode-hosts",
        str(decode_tp),
        "--json",
    )
    fan = json.loads(out.stdout)["fan_out"]
    assert fan["local_copies"] == [] and fan["link_bytes_per_token"] == before * distinct


def test_a_bad_decode_hosts_count_is_refused_with_what_works():
    out = kvbridge("plan", "--config", "smollm2-135m", "--decode-tp", "9", "--decode-hosts", "10")
    assert out.returncode == 2
    assert "--decode-hosts=10 must be an integer in [1, 9]" in out.stderr
