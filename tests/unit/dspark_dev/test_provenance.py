"""dspark_dev/provenance.py: the commit a GPU record names."""

from __future__ import annotations

import subprocess
from pathlib import Path

from dspark_dev import provenance

REPO = Path(__file__).resolve().parents[3]


def test_the_variable_wins_over_the_checkout(monkeypatch):
    monkeypatch.setenv(provenance.COMMIT_ENV, "abc1234")
    assert provenance.record_commit(REPO) == "abc1234"


def test_without_the_variable_the_checkouts_head(monkeypatch):
    monkeypatch.delenv(provenance.COMMIT_ENV, raising=False)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    assert provenance.record_commit(REPO) == head


def test_a_folder_without_git_says_unknown_and_how_to_set_it(monkeypatch, tmp_path):
    monkeypatch.delenv(provenance.COMMIT_ENV, raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    got = provenance.record_commit(tmp_path)
    assert got.startswith("unknown") and provenance.COMMIT_ENV in got
