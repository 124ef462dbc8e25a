"""No tracked text file keeps a merge-conflict marker (one reached docs/results/gpu.md through a
merge on 2026-12-05 and was found by reading the page)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
MARKER = re.compile(r"^(<{7} |>{7} |={7}$)", re.M)


def marker_lines(text: str) -> list[int]:
    """1-based numbers of the lines that open, split or close a conflict."""
    return [text.count("\n", 0, m.start()) + 1 for m in MARKER.finditer(text)]


def test_no_tracked_file_has_a_conflict_marker():
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    found = {}
    for name in filter(None, files):
        path = REPO / name
        if path.suffix in {".safetensors", ".bin", ".png", ".pt"} or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if lines := marker_lines(text):
            found[name] = lines
    assert not found, f"merge-conflict markers (file: lines): {found}"


def test_the_check_sees_each_marker_and_not_lookalikes():
    planted = "a\n<<<<<<< HEAD\nb\n=======\nc\n>>>>>>> branch\nd\n"
    assert marker_lines(planted) == [2, 4, 6]
    assert marker_lines("======= not a marker\n<<<<<<<x\n| === |\n") == []
