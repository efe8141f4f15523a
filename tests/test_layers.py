"""The layers import one way (docs/architecture.md): every module of kvbridge is parsed
with `ast` and each import, module-level or inside a function (lazy imports count), is
checked against its layer's rule. Nothing is imported, so the rule holds whichever
extras are installed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvbridge

ROOT = Path(kvbridge.__file__).parent

#: layer -> packages of kvbridge its modules must not import (`kvbridge.X`, X a
#: subpackage or a module of the top level)
FORBIDDEN: dict[str, frozenset[str]] = {
    "transfer": frozenset({"connector", "engine", "serve", "vllm", "bench", "cli"}),
    "connector": frozenset({"engine", "serve", "vllm", "bench", "cli"}),
    "engine": frozenset({"transfer", "serve", "vllm", "bench", "cli"}),
    "serve": frozenset({"transfer", "bench", "cli"}),
    # vLLM's adapter, beside serve: it hosts the connector (its launcher starts serve's
    # proxy)
    "vllm": frozenset({"transfer", "engine", "bench", "cli"}),
    # the Ray Serve LLM launcher, beside vllm's: it deploys vLLM with the connector
    "ray": frozenset({"transfer", "engine", "serve", "bench", "cli"}),
    "bench": frozenset({"cli"}),
}
#: plan imports nothing of kvbridge but these
PLAN_ALLOWED = frozenset({"plan", "errors"})


def _modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, the kvbridge package or top-level module named) of every import of kvbridge
    in the file: `import kvbridge.x.y`, `from kvbridge.x import y`, `from kvbridge import
    x` (x: the package imported), wherever the statement is (inside functions and
    `if TYPE_CHECKING:` blocks too)."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: a relative import; name kvbridge.*"
            base = node.module or ""
            names = [f"{base}.{a.name}" for a in node.names] if base == "kvbridge" else [base]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "kvbridge" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


def _layer(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else ""


def _violations() -> list[str]:
    out = []
    for path in _modules():
        layer = _layer(path)
        for line, target in _imported(path):
            if target == layer:
                continue
            if layer == "plan":
                bad = target not in PLAN_ALLOWED
            else:
                bad = target in FORBIDDEN.get(layer, frozenset())
            if bad:
                out.append(
                    f"{path.relative_to(ROOT.parent)}:{line}: {layer} imports kvbridge.{target}"
                )
    return out


def test_every_layer_imports_only_the_ones_below_it() -> None:
    assert _violations() == []


@pytest.mark.parametrize(
    "source, found",
    [
        ("import kvbridge.engine.llm_engine", ["engine"]),
        ("from kvbridge.transfer.config import TransferConfig", ["transfer"]),
        ("from kvbridge import errors, plan", ["errors", "plan"]),
        ("def f():\n    from kvbridge.cli import main\n", ["cli"]),
        ("if TYPE_CHECKING:\n    import kvbridge.serve as s\n", ["serve"]),
        ("import numpy\nfrom collections import deque", []),
    ],
)
def test_the_checker_sees_every_form_of_import(
    tmp_path: Path, source: str, found: list[str]
) -> None:
    path = tmp_path / "m.py"
    path.write_text(source)
    assert [target for _, target in _imported(path)] == found
