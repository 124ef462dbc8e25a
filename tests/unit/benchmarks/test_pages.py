"""benchmarks/pages.py: the generated pages' shared command line writes, and --check fails on a
stale page and passes on a fresh one."""

from __future__ import annotations

from benchmarks.pages import page_main


def test_write_then_check_then_stale(tmp_path, capsys):
    page = tmp_path / "p.md"
    assert page_main(page, lambda: "one\n", "d", ["--check"]) == 1  # missing page is stale
    assert page_main(page, lambda: "one\n", "d", []) == 0
    assert page.read_text() == "one\n"
    assert page_main(page, lambda: "one\n", "d", ["--check"]) == 0
    assert page_main(page, lambda: "two\n", "d", ["--check"]) == 1
    assert page.read_text() == "one\n"  # --check never writes
    assert "stale" in capsys.readouterr().out
