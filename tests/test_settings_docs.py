"""The settings tables in docs/ are the settings themselves: each is rendered from the
fields that declare them (`kvbridge.settings`), so a flag, default or help text changed
in the code and not in the docs fails here. To bring the docs up to date, run
``python -m tests.test_settings_docs`` from the repository root: it rewrites each table
between its markers."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from kvbridge.cli.serve_cmd import SETTINGS
from kvbridge.connector.settings import SETTINGS as CONNECTOR_SETTINGS
from kvbridge.settings import settings_table

ROOT = Path(__file__).resolve().parents[1]

#: (document, the table's name in its markers, the table rendered from the fields)
TABLES: list[tuple[str, str, Callable[[], str]]] = [
    (
        "docs/serving.md",
        "kvbridge serve",
        lambda: settings_table(SETTINGS, ("flag", "env", "default", "meaning")),
    ),
    (
        "docs/vllm.md",
        "kv_connector_extra_config",
        lambda: settings_table(CONNECTOR_SETTINGS, ("key", "default", "meaning")),
    ),
]


def _markers(name: str) -> re.Pattern[str]:
    """The table between ``<!-- settings: NAME ... -->`` and ``<!-- end of settings -->``."""
    return re.compile(
        rf"(<!-- settings: {re.escape(name)}\b[^\n]*-->\n)(.*?)(<!-- end of settings -->)", re.S
    )


def documented(doc: str, name: str) -> str:
    text = (ROOT / doc).read_text()
    found = _markers(name).search(text)
    assert found, f"{doc} has no table marked <!-- settings: {name} ... -->"
    return found.group(2).strip("\n") + "\n"  # blank lines around it: it is a block of its own


@pytest.mark.parametrize(("doc", "name", "render"), TABLES, ids=[t[1] for t in TABLES])
def test_the_docs_table_is_the_one_the_fields_render(
    doc: str, name: str, render: Callable[[], str]
) -> None:
    assert documented(doc, name) == render(), (
        f"{doc}'s table of {name} settings differs from the fields' declarations: "
        "run `python -m tests.test_settings_docs` to rewrite it"
    )


def write() -> None:
    """Rewrite every table from the fields."""
    for doc, name, render in TABLES:
        path = ROOT / doc
        table = render()
        new, count = _markers(name).subn(
            lambda m: f"{m.group(1)}\n{table}\n{m.group(3)}",  # noqa: B023 (used at once)
            path.read_text(),
        )
        assert count == 1, f"{doc}: {count} tables marked {name}"
        path.write_text(new)
        print(f"{doc}: {name}")


if __name__ == "__main__":
    write()
