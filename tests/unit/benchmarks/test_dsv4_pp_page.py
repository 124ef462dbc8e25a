"""docs/results/dsv4_pp_gpu.md is benchmarks/dsv4_pp_page.py's output from the committed
DeepSeek-V4 PP records, and the page follows its records: a planted change shows on the page or
is refused."""

from __future__ import annotations

import json

import pytest

from benchmarks import dsv4_pp_page, k3_pp_page


def test_the_committed_page_is_the_generators_output():
    assert dsv4_pp_page.PAGE.read_text() == dsv4_pp_page.markdown(dsv4_pp_page.load()), (
        "run: python -m benchmarks.dsv4_pp_page"
    )


def _a_record(tmp_path):
    """A record of the group's shape in tmp_path: the newest committed DeepSeek-V4 one, else the
    K3 TP=2 x PP=2 record (the same test writes both)."""
    mine = sorted(dsv4_pp_page.RESULTS.glob(dsv4_pp_page.PATTERN))
    src = mine[-1] if mine else k3_pp_page.RESULTS / "k3_tp2pp2_gpu_2026-12-06_run2.json"
    path = tmp_path / "dsv4_pp_gpu_planted.json"
    path.write_text(src.read_text())
    return path


def test_every_selected_job_gets_a_row_and_a_failed_check_shows(tmp_path):
    path = _a_record(tmp_path)
    rec = json.loads(path.read_text())
    page = dsv4_pp_page.markdown(dsv4_pp_page.load(tmp_path))
    for job in rec["selected_jobs"].split(","):
        if job in rec["verdicts"] or "error" in rec["jobs"].get(job, {}):
            assert f"| `{job}` |" in page
    job = next(j for j, v in rec["verdicts"].items() if v["ok"])
    rec["verdicts"][job] = {"ok": False, "detail": "PLANTED DETAIL"}
    path.write_text(json.dumps(rec))
    page = dsv4_pp_page.markdown(dsv4_pp_page.load(tmp_path))
    assert f"| `{job}` | FAILED |" in page and f"{job}: PLANTED DETAIL" in page


@pytest.mark.parametrize("drop", ["commit", "gpu", "command", "jobs"])
def test_a_record_without_what_the_page_needs_is_refused(tmp_path, drop):
    path = _a_record(tmp_path)
    rec = json.loads(path.read_text())
    del rec[drop]
    path.write_text(json.dumps(rec))
    with pytest.raises(k3_pp_page.RecordError, match=drop):
        dsv4_pp_page.load(tmp_path)
