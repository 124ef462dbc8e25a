"""docs/results/gsm8k.md's GPU tables are benchmarks/gsm8k_page.py's output from the committed
``gsm8k_gpu*.json`` records, judged against the YAML thresholds of today; ``--add`` re-scores a
run's reports and counts completions equal to the no-speculation arm."""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks import gsm8k_page


def test_the_committed_page_is_the_generators_output():
    text = gsm8k_page.PAGE.read_text()
    assert text == gsm8k_page.page(text), "run: python -m benchmarks.gsm8k_page"
    assert gsm8k_page.main(["--check"]) == 0


def _configs(tmp_path):
    dst = tmp_path / "configs"
    shutil.copytree(gsm8k_page.CONFIGS, dst)
    return dst


def test_a_raised_threshold_turns_the_row_into_a_failure(tmp_path):
    """The control: the same record against a YAML whose acceptance bound the run misses."""
    configs = _configs(tmp_path)
    yaml = configs / "dsv41-pp2-dspark.yaml"
    text = yaml.read_text()
    assert "acceptance_length_min: 4.36" in text
    yaml.write_text(text.replace("acceptance_length_min: 4.36", "acceptance_length_min: 9.0"))
    table = gsm8k_page.tables(configs=configs)
    row = next(line for line in table.splitlines() if line.startswith("| dsv41-pp2-dspark |"))
    assert "| NO: mean acceptance length 4.419 < acceptance_length_min 9.0 |" in row, row
    assert table != gsm8k_page.tables()


def _reports():
    rec = json.loads((gsm8k_page.RESULTS / "gsm8k_gpu_dsv41.json").read_text())
    return [dict(r) for r in rec["reports"].values()]


META = {"commit": "abc1234", "date": "2026-12-06 10:39 UTC", "gpu": "planted", "command": "x"}


def test_add_rescores_counts_equal_completions_and_drops_them():
    reports = _reports()
    by = {r["name"]: r for r in reports}
    by["dsv41-pp1-nospec"]["completions"] = ["#### 1", "#### 2", "#### 3"]
    by["dsv41-pp1-dspark"]["completions"] = ["#### 1", "#### 2", "#### 3"]
    by["dsv41-pp2-dspark"]["completions"] = ["#### 1", "#### 9", "#### 3"]  # one differs
    for r in reports:
        r["tokens"] = [[1, 2]]
        r["passed"], r["failures"] = False, ["planted: as the run printed it"]
    rec = gsm8k_page.build_record(reports, META)
    assert rec["meta"] == META
    out = rec["reports"]
    assert out["dsv41-pp1-dspark"]["completions_identical_to_nospec"] == [3, 3]
    assert out["dsv41-pp2-dspark"]["completions_identical_to_nospec"] == [2, 3]
    assert "completions_identical_to_nospec" not in out["dsv41-pp1-nospec"]
    for r in out.values():
        assert "completions" not in r and "tokens" not in r
        assert r["passed"] and r["failures"] == []  # re-scored against the filled YAMLs


def test_add_refuses_a_run_without_its_meta_or_a_report_field():
    with pytest.raises(gsm8k_page.RecordError, match="needs gpu"):
        gsm8k_page.build_record(_reports(), {**META, "gpu": ""})
    reports = _reports()
    del reports[0]["num_drafts"]
    with pytest.raises(gsm8k_page.RecordError, match="has no 'num_drafts'"):
        gsm8k_page.build_record(reports, META)
    stray = _reports()
    stray[0]["name"] = "no-such-config"
    with pytest.raises(gsm8k_page.RecordError, match="no config"):
        gsm8k_page.build_record(stray, META)


def test_a_record_and_a_page_the_generator_cannot_read_are_refused(tmp_path):
    rec = json.loads((gsm8k_page.RESULTS / "gsm8k_gpu_dsv41.json").read_text())
    del rec["meta"]["commit"]
    (tmp_path / "gsm8k_gpu_x.json").write_text(json.dumps(rec))
    with pytest.raises(gsm8k_page.RecordError, match="meta has no commit"):
        gsm8k_page.tables(results=tmp_path)
    with pytest.raises(gsm8k_page.RecordError, match="markers"):
        gsm8k_page.page("no markers here")
