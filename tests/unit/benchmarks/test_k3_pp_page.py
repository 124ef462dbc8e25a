"""docs/results/k3_pp.md is benchmarks/k3_pp_page.py's output from the committed Kimi-K3 PP
records, and the page follows its records: a planted change shows on the page or is refused."""

from __future__ import annotations

import copy
import json

import pytest

from benchmarks import k3_pp_page


def test_the_committed_page_is_the_generators_output():
    assert k3_pp_page.PAGE.read_text() == k3_pp_page.markdown(k3_pp_page.load()), (
        "run: python -m benchmarks.k3_pp_page"
    )


def test_a_verdict_and_a_line_of_the_record_reach_the_page(tmp_path):
    for path in k3_pp_page.RESULTS.glob("k3_pp*gpu*.json"):
        (tmp_path / path.name).write_text(path.read_text())
    fix = json.loads((tmp_path / k3_pp_page.FIX).read_text())
    planted = copy.deepcopy(fix)
    run = planted["runs"][-1]
    test = next(iter(run["results"]))
    run["results"][test] = "FAILED"
    run["lines"].append("PLANTED LINE")
    (tmp_path / k3_pp_page.FIX).write_text(json.dumps(planted))
    page = k3_pp_page.markdown(k3_pp_page.load(tmp_path))
    assert f"| `{test.split('::', 1)[1]}` | FAILED |" in page
    assert "PLANTED LINE" in page
    assert page != k3_pp_page.markdown(k3_pp_page.load())


@pytest.mark.parametrize("drop", ["commit", "gpu", "command", "results"])
def test_a_run_without_what_the_page_needs_is_refused(tmp_path, drop):
    for path in k3_pp_page.RESULTS.glob("k3_pp*gpu*.json"):
        (tmp_path / path.name).write_text(path.read_text())
    fix = json.loads((tmp_path / k3_pp_page.FIX).read_text())
    del fix["runs"][0][drop]
    (tmp_path / k3_pp_page.FIX).write_text(json.dumps(fix))
    with pytest.raises(k3_pp_page.RecordError, match=drop):
        k3_pp_page.load(tmp_path)


def _copy_records(tmp_path):
    for path in k3_pp_page.RESULTS.glob("k3_pp*gpu*.json"):
        (tmp_path / path.name).write_text(path.read_text())
    group = sorted(tmp_path.glob(k3_pp_page.GROUP_RECORDS))
    assert group, "no dsv4k3_pp group record is committed"
    return group[-1]


def test_a_group_job_that_fails_its_check_or_raises_shows_failed(tmp_path):
    path = _copy_records(tmp_path)
    rec = json.loads(path.read_text())
    job = next(j for j, v in rec["verdicts"].items() if v["ok"])
    rec["verdicts"][job] = {"ok": False, "detail": "PLANTED DETAIL"}
    raised = next(j for j in rec["selected_jobs"].split(",") if j not in rec["verdicts"])
    rec["jobs"][raised] = {"error": "PLANTED ERROR"}
    path.write_text(json.dumps(rec))
    page = k3_pp_page.markdown(k3_pp_page.load(tmp_path))
    assert f"| `{job}` | FAILED |" in page and f"{job}: PLANTED DETAIL" in page
    assert f"| `{raised}` | FAILED |" in page and f"{raised}: PLANTED ERROR" in page


@pytest.mark.parametrize("drop", ["commit", "gpu", "command", "jobs"])
def test_a_group_record_without_what_the_page_needs_is_refused(tmp_path, drop):
    path = _copy_records(tmp_path)
    rec = json.loads(path.read_text())
    del rec[drop]
    path.write_text(json.dumps(rec))
    with pytest.raises(k3_pp_page.RecordError, match=drop):
        k3_pp_page.load(tmp_path)


def test_the_tp2pp2_record_is_a_run_with_its_failure_and_its_cause():
    name = "k3_tp2pp2_gpu_2026-12-06.json"
    page = k3_pp_page.markdown(k3_pp_page.load())
    assert name in [n for n, _ in k3_pp_page.load()]
    section = page.split(f"({name})", 1)[1]
    assert "| `k3_tp2pp2_graphs` | FAILED |" in section
    cause = "ValueError: Following weights were not initialized from checkpoint: "
    assert "k3_tp2pp2_graphs, further in its error: (Worker_PP1_TP0 pid=7767) " in section
    assert cause + "{'model.layers.2.self_attn.in_proj_qkvgfab.weight.6'}" in section


def _error_run(error: str) -> dict:
    rec = {k: "x" for k in ("commit", "date", "gpu", "command", "weights", "k")}
    rec.update(selected_jobs="j", jobs={"j": {"error": error}})
    return k3_pp_page._group_run("r.json", rec)


def test_an_error_adds_only_the_exception_lines_its_cut_leaves_out():
    short = _error_run("RuntimeError: early\nValueError: within the cut")
    assert short["lines"] == ["j: RuntimeError: early\nValueError: within the cut"]
    long = _error_run("RuntimeError: early\n" + "log line\n" * 60 + "ValueError: the cause\nend")
    assert long["results"] == {"j": "FAILED"}
    assert long["lines"][1:] == ["j, further in its error: ValueError: the cause"]
