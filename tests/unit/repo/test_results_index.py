"""docs/results/README.md is the index of the results: every file of docs/results is a link of
it, and every file it links exists (the docs-path test checks the links too)."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"
INDEX = RESULTS / "README.md"
_ROW_LINK = re.compile(r"^\| \[([^\]]+)\]\(([^)\s]+)\) \|", re.M)


def indexed(text: str) -> dict[str, str]:
    """Link target -> link text of each table row of the index that starts with a link."""
    return {target: name for name, target in _ROW_LINK.findall(text)}


def unlisted(folder: Path, text: str) -> list[str]:
    """The files of ``folder`` (the index itself aside) that no row of ``text`` links."""
    rows = indexed(text)
    return sorted(
        p.name for p in folder.iterdir() if p.is_file() and p != INDEX and p.name not in rows
    )


def test_every_result_file_is_listed_in_the_index():
    missing = unlisted(RESULTS, INDEX.read_text())
    assert not missing, f"add a row for each to docs/results/README.md: {missing}"


def test_every_row_links_an_existing_file_under_its_own_name():
    rows = indexed(INDEX.read_text())
    assert len(rows) >= 50  # the rows are read at all
    assert not [t for t in rows if not (RESULTS / t).is_file()]
    assert not {t: n for t, n in rows.items() if t != n}


def test_a_result_file_missing_from_the_index_is_named(tmp_path):
    (tmp_path / "listed.json").write_text("{}")
    (tmp_path / "new_run.json").write_text("{}")
    text = "| file | what |\n|---|---|\n| [listed.json](listed.json) | a run |\n"
    assert unlisted(tmp_path, text) == ["new_run.json"]
