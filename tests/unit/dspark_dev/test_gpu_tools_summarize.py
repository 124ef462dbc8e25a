"""dspark_dev.gpu_summary turns a junit file (or, failing that, a pytest log) into the GPU
table."""

from __future__ import annotations

from dspark_dev import gpu_summary as summarize

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="4" time="12.5">
<testcase classname="tests.gpu.test_gpu_00_environment" name="test_environment_facts" time="3.25"/>
<testcase classname="tests.gpu.test_gpu_30_e2e_parity" name="test_dspark_eager_matches_plain_greedy" time="61.0">
  <failure message="AssertionError: spec_eager: greedy output differs&#10;second line">trace</failure></testcase>
<testcase classname="tests.gpu.test_gpu_20_project_kernels" name="test_kernel[&lt;none&gt;]" time="0.01">
  <skipped type="pytest.skip" message="no project Triton kernels at this commit">tests/gpu/x.py:10: no project Triton kernels</skipped></testcase>
<testcase classname="tests.gpu.test_gpu_40_pd_mooncake" name="test_pd" time="0.5">
  <error message="failed on setup with GPUCaseFailure: PD run failed at step 'start servers'">x</error></testcase>
</testsuite></testsuites>
"""  # noqa: E501 - a junit file as pytest writes it


def test_table_from_junit_lists_every_outcome_and_exits_nonzero(tmp_path, capsys):
    j = tmp_path / "junit.xml"
    j.write_text(JUNIT)
    out = tmp_path / "summary.txt"
    rc = summarize.main(["--junit", str(j), "--wall", "98", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 1
    assert out.read_text().strip() == text.strip()
    lines = text.strip().splitlines()
    assert (
        lines[-1]
        == "TOTAL 4 tests: failed 1 error 1 passed 1 skipped 1, wall 98 s (from junit.xml)"
    )
    # failures first, with the first line of their message
    assert (
        lines[2].startswith("FAILED")
        and "greedy output differs" in lines[2]
        and "second line" not in lines[2]
    )
    assert lines[3].startswith("ERROR") and "start servers" in lines[3]
    assert (
        lines[4].startswith("PASSED") and "test_environment_facts" in lines[4] and "3.2" in lines[4]
    )
    assert lines[5].startswith("SKIPPED") and "no project Triton kernels" in lines[5]


def test_all_skipped_is_not_a_pass(tmp_path):
    j = tmp_path / "junit.xml"
    j.write_text(
        '<testsuite><testcase classname="a.b" name="t" time="0"><skipped message="no '
        'GPU"/></testcase></testsuite>'
    )
    assert summarize.main(["--junit", str(j)]) == 1


def test_all_passed_exits_zero(tmp_path):
    j = tmp_path / "junit.xml"
    j.write_text('<testsuite><testcase classname="a.b" name="t" time="1.5"/></testsuite>')
    assert summarize.main(["--junit", str(j)]) == 0


def test_log_fallback_when_pytest_was_killed_before_writing_junit(tmp_path, capsys):
    log = tmp_path / "gpu_suite.log"
    log.write_text(
        "tests/gpu/test_gpu_00_environment.py::test_environment_facts PASSED [  4%]\n"
        "tests/gpu/test_gpu_30_e2e_parity.py::test_dspark_eager_matches_plain_greedy FAILED [ "
        "50%]\n"
        "SKIPPED [1] tests/gpu/test_gpu_20_project_kernels.py:70: no kernels\n"
    )
    rc = summarize.main(["--junit", str(tmp_path / "missing.xml"), "--log", str(log)])
    text = capsys.readouterr().out
    assert rc == 1
    assert "pytest wrote no junit" in text
    assert "TOTAL 2 tests: failed 1 error 0 passed 1 skipped 0" in text


def test_nothing_to_read(tmp_path):
    assert summarize.main(["--junit", str(tmp_path / "none.xml")]) == 2
