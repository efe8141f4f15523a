"""`pip install kvbridge` with no extras: the planner and its CLI work; commands that need
an extra say which one, instead of crashing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with kvbridge installed, no extras: pip (this one's, run for the
    venv's interpreter: ensurepip would install pip into it first, the slow part of
    making it) installs only what kvbridge itself requires."""
    venv = tmp_path_factory.mktemp("base") / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    out = subprocess.run(
        [*pip, "install", "-q", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    return venv


def run(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]], capture_output=True, text=True, timeout=120
    )


def test_base_install_has_no_heavy_dependencies(base_venv: Path) -> None:
    code = "import importlib.util as u; print([m for m in {} if u.find_spec(m)])".format(
        ["torch", "msgspec", "zmq", "nixl_cu12", "fastapi", "matplotlib"]
    )
    out = run(base_venv, "python", "-c", code)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_base_install_plans_and_verifies(base_venv: Path) -> None:
    out = run(
        base_venv, "kvbridge", "plan", "--config", "llama-3.2-1b", "--prefill-tp", "8",
        "--decode-tp", "16", "--verify",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "verified byte-exact" in out.stdout
    code = (
        "import kvbridge\n"
        "m = kvbridge.load_model_spec('smollm2-135m')\n"
        "p = kvbridge.make_plan(m, kvbridge.InstanceLayout(3), kvbridge.InstanceLayout(9))\n"
        "lists = kvbridge.copy_lists(p, 0, [4, 1], [2, 0], 20)\n"
        "print(kvbridge.verify_plan(p, 20).bytes_copied == 20 * p.bytes_per_token, len(lists))\n"
    )
    out = run(base_venv, "python", "-c", code)
    assert out.returncode == 0 and out.stdout.split() == ["True", "1"], out.stderr


@pytest.mark.parametrize(
    "args, extra",
    [
        (["serve"], "serve"),
        (["generate", "hi"], "engine"),
        (["transfer-check"], "transfer"),
        (["bench", "transfer"], "transfer"),
        (["plan", "--config", "smollm2-135m", "--svg", "map.svg"], "map"),
    ],
)
def test_a_command_without_its_extra_names_the_extra(
    base_venv: Path, args: list[str], extra: str
) -> None:
    out = run(base_venv, "kvbridge", *args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"pip install 'kvbridge[{extra}]'" in out.stderr
    assert run(base_venv, "kvbridge", args[0], "--help").returncode == 0
