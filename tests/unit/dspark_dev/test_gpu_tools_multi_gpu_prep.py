"""CPU checks of the prepared several-GPU scripts: tables, the NCCL stub guard, the mismatch
hook."""

from __future__ import annotations

import ctypes
import json
import shutil
from pathlib import Path

import pytest
from support.scripts import load_script

from benchmarks import plot_serve
from dspark_dev import multi_gpu as mg_common

ROOT = Path(__file__).resolve().parents[3]


def test_report_prints_the_table_last_and_fails_on_any_failure(tmp_path, capsys):
    rep = mg_common.Report("demo", tmp_path / "x.log")
    rep.add("random: pp2 DSpark greedy = PP=1 plain", "PASS", "7 requests, 336 tokens: identical")
    rep.add("PP=2 x TP=2", "SKIP", "needs 4 GPUs, found 2")
    rep.add(
        "no run reaches the kit's NCCL stubs",
        "FAIL",
        "stubbed functions called: ['ncclCommShrink']",
    )
    rc = rep.finish()
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 1
    assert out[-1].startswith("TOTAL pass 1 fail 1 skip 1")
    assert any(line.startswith("FAIL    no run reaches the kit's NCCL stubs") for line in out)
    assert "== demo ==" in (tmp_path / "x.log").read_text()


def test_report_all_skipped_is_not_a_pass(tmp_path):
    rep = mg_common.Report("demo", tmp_path / "y.log")
    rep.add("x", "SKIP", "why")
    assert rep.finish() == 1


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed here")
def test_loud_nccl_stub_records_every_call(tmp_path, monkeypatch):
    guard = mg_common.NcclStubGuard(tmp_path)
    monkeypatch.setattr(guard, "_symbols", lambda: ["ncclFakeOne", "ncclFakeTwo"])
    guard.build()
    assert guard.problem is None and guard.so is not None
    env = guard.env()
    assert env["LD_PRELOAD"].split(":")[0] == str(guard.so)
    monkeypatch.setenv("DSPARK_NCCL_STUB_LOG", env["DSPARK_NCCL_STUB_LOG"])
    lib = ctypes.CDLL(str(guard.so))
    assert lib.ncclFakeTwo() == 5  # ncclInvalidUsage, as the kit's stub returns
    assert guard.calls() == ["ncclFakeTwo"]
    rep = mg_common.Report("g", tmp_path / "g.log")
    guard.check(rep, ["all good"])
    assert rep.rows[-1].outcome == "FAIL" and "ncclFakeTwo" in rep.rows[-1].detail


def test_guard_passes_when_nothing_was_called_and_flags_nccl_errors_in_logs(tmp_path, monkeypatch):
    guard = mg_common.NcclStubGuard(tmp_path)
    guard.symbols, guard.so = ["ncclX"], tmp_path / "lib.so"
    guard.log.write_text("")
    rep = mg_common.Report("g", tmp_path / "g.log")
    guard.check(rep, ["INFO nothing"])
    assert rep.rows[-1].outcome == "PASS"
    guard.check(rep, ["RuntimeError: NCCL error in: ..., invalid usage"])
    assert rep.rows[-1].outcome == "FAIL"


def test_mismatch_hook_compiles():
    r = load_script("tools/gpu/run_pp2_aggregated.py")

    compile(r.SITECUSTOMIZE, "sitecustomize.py", "exec")


def test_serving_tables(tmp_path, capsys):
    from benchmarks import serve_pp

    rows = [
        {"config": "pp2_dspark", "model_size": "tiny", "concurrency": c,
         "output_throughput": 100.0 * c, "mean_tpot_ms": 5.0, "median_tpot_ms": 4.5,
         "mean_ttft_ms": 20.0, "acceptance_pct": 41.2}
        for c in (1, 4)
    ] + [
        {"config": "pp2_plain", "model_size": "tiny", "concurrency": 1, "output_throughput": 80.0,
         "mean_tpot_ms": 6.0, "median_tpot_ms": 6.0, "mean_ttft_ms": 18.0, "acceptance_pct": None}
    ]  # fmt: skip
    text = serve_pp.bench_rows_table(rows)
    assert "pp2_dspark" in text and "41.2" in text and text.splitlines()[-1].rstrip().endswith("-")
    f = tmp_path / "serve_x.json"
    f.write_text(json.dumps(rows))
    md = tmp_path / "t.md"
    assert plot_serve.main([str(f), "--md", str(md)]) == 0
    lines = md.read_text().strip().splitlines()
    assert lines[0].startswith("| config | model | concurrency")
    assert lines[2] == "| pp2_dspark | tiny | 1 | 100.0 | 5.00 | 4.50 | 20.0 | 41.2 |"
    assert lines[-1].endswith("| - |")


def test_guarded_env_turns_multicast_off_and_preloads_the_loud_stub(monkeypatch):
    monkeypatch.setattr(mg_common.NcclStubGuard, "_symbols", lambda self: [])
    guard, env = mg_common.guarded_env()
    assert guard.problem and guard.so is None  # nothing to guard outside the GPU kit
    assert (
        env
        == mg_common.NO_MULTICAST_ENV
        == {
            "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1",
        }
    )
    if shutil.which("gcc") is not None:
        monkeypatch.setattr(mg_common.NcclStubGuard, "_symbols", lambda self: ["ncclFakeOne"])
        guard, env = mg_common.guarded_env()
        assert env["LD_PRELOAD"].split(":")[0] == str(guard.so)
        assert env["NCCL_NVLS_ENABLE"] == "0"
