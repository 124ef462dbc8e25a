"""The GPU groups of issues 26 and 40 run their wiring on CPU with fake engines (tests/support/
gpu_fake_engines.py): which engines each mode starts, with which arguments, and that their checks
pass on good counters and fail on bad ones. A GPU lease is short; a test module broken in a way the
CPU can see must not be found there. Each case is the plugin's own command in a child pytest."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parents[2]
DSV4K3 = ["tests/gpu/test_dsv4_k3_engine.py", "tests/gpu/test_dsv4_k3_pp.py"]
PD_PP = ["tests/gpu/test_pd_pp_producer.py"]
DSV41_PP = ["tests/gpu/test_dsv41_pp.py"]
TP_PP = ["tests/gpu/test_tp_pp_one_gpu.py"]
# every TP x PP job but the stock control (its fake would wait on a /health that never answers)
TP_PP_JOBS = ",".join(
    ["ref", "pp1_async", "pp1_sync", "tp2pp2_async", "tp2pp2_sync_eager", "tp2pp2_sync",
     "tp2pp2_eager", "tp2pp1_async", "tp1pp2_async"]
)  # fmt: skip


def _fake_run(modules: list[str], **env: str) -> dict[str, int]:
    child_env = {
        **os.environ,
        "DSPARK_FAKE_MODELS": str(REPO / "models"),
        "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("", "tests", "tests/gpu")),
        **env,
    }
    knobs = ("DSPARK_DSV4K3_WEIGHTS", "DSPARK_GPU_PD_PP_PAIR", "DSPARK_FAKE_MUTATION",
             "DSPARK_GPU_TP_PP_JOBS", "DSPARK_GPU_PD_PP_JOBS",
             "DSPARK_GPU_PD_TP_PP_OUT", "DSPARK_GPU_DSV41_PP_OUT")  # fmt: skip
    for knob in knobs:
        if not child_env.get(knob):
            child_env.pop(knob, None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["-p", "support.gpu_fake_engines", *modules],
        cwd=REPO,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", last)}
    counts["errors"] = counts.pop("error", 0) + counts.pop("errors", 0)
    counts["rc"] = proc.returncode
    counts["last"] = last  # type: ignore[assignment]
    return counts


@pytest.mark.parametrize(
    "modules, env",
    [
        (DSV4K3 + PD_PP, {}),  # dummy weights (k=4), the tiny pair's PD
        (DSV4K3 + PD_PP, {"DSPARK_DSV4K3_WEIGHTS": "trained", "DSPARK_GPU_PD_PP_PAIR": "dsv4"}),
        (PD_PP, {"DSPARK_GPU_PD_PP_PAIR": "k3"}),
        (PD_PP, {"DSPARK_GPU_PD_PP_PAIR": "dsv41"}),
    ],
    ids=["dummy", "trained-dsv4", "pd-pp-k3", "pd-pp-dsv41"],
)
def test_fake_engines_pass_the_gpu_groups_wiring(modules, env):
    got = _fake_run(modules, **env)
    assert got["rc"] == 0 and not got.get("failed") and not got["errors"], got["last"]
    assert got.get("passed", 0) > 0, got["last"]


def test_the_wiring_run_fails_when_a_draft_position_never_accepts():
    """The control: the fake counters with draft position 6 at 0 must fail the trained checks."""
    got = _fake_run(
        DSV4K3 + PD_PP,
        DSPARK_DSV4K3_WEIGHTS="trained",
        DSPARK_GPU_PD_PP_PAIR="dsv4",
        DSPARK_FAKE_MUTATION="pos6_zero",
    )
    assert got["rc"] != 0 and got.get("failed", 0) > 0, got["last"]


def _tp_pp_run(tmp_path, jobs: str | None, mutation: str = "") -> tuple[dict, dict]:
    out = tmp_path / "out"
    got = _fake_run(
        TP_PP,
        DSPARK_GPU_TP_PP_JOBS=jobs or "",
        DSPARK_FAKE_MUTATION=mutation,
        DSPARK_GPU_PP_LOGS=str(tmp_path / "logs"),
        DSPARK_GPU_TP_PP_OUT=str(out),
    )
    record = json.loads((out / "tp_pp.json").read_text())
    return got, record


@pytest.mark.parametrize("jobs", [None, TP_PP_JOBS], ids=["default-jobs", "all-but-stock"])
def test_fake_engines_pass_the_tp_pp_group_and_its_record_is_written(tmp_path, jobs):
    got, record = _tp_pp_run(tmp_path, jobs)
    assert got["rc"] == 0 and not got.get("failed") and not got["errors"], got["last"]
    served = ["tp2pp2_async", "tp2pp2_sync_eager"] if jobs is None else TP_PP_JOBS.split(",")[3:]
    checks = [f"{c}[{n}]" for n in served for c in ("greedy", "acceptance", "ranks")]
    assert set(checks) | {"abort", "nccl_stubs"} == set(record["verdicts"]), record["verdicts"]
    assert all(v["ok"] for v in record["verdicts"].values()), record["verdicts"]
    assert record["jobs"]["tp2pp2_async"]["shape"]["tp"] == 2 and record["commit"]
    assert record["jobs"]["tp2pp2_async"]["counters"]["num_drafts"] > 0


@pytest.mark.parametrize(
    "mutation, check", [("pp2_low", "acceptance"), ("rank_silent+digest_differs", "ranks")]
)
def test_the_tp_pp_checks_fail_on_low_acceptance_and_a_silent_rank(tmp_path, mutation, check):
    """The controls: lower counters at the last two draft positions fail the acceptance check of
    every served job; a launcher without vLLM's rank line fails the every-rank check, and so
    does (in the same run, named in the same verdict) a last rank that logged another drafts
    digest than the others (PP > 1 jobs only: TP=2 PP=1 has no exchange)."""
    got, record = _tp_pp_run(tmp_path, TP_PP_JOBS, mutation)
    assert got["rc"] != 0 and got.get("failed") == 6, got["last"]
    bad = sorted(k for k, v in record["verdicts"].items() if not v["ok"])
    assert bad == sorted(f"{check}[{n}]" for n in TP_PP_JOBS.split(",")[3:]), bad
    if "digest_differs" in mutation:
        for n in TP_PP_JOBS.split(",")[3:]:
            detail = record["verdicts"][f"ranks[{n}]"]["detail"]
            assert "rank lines per launcher" in detail, detail
            assert ("after 16 draft posts" in detail) == (n != "tp2pp1_async"), detail


# issue 40 item 2: PD with a TP=2 x PP=2 producer (test_pd_pp_producer.py's opt-in jobs)
PD_TP_GOOD = ["pd_tp2pp2_tp2", "pd_tp2pp2_tp1"]
PD_TP_JOBS = ",".join(
    ["pair_baseline", "pair_spec", *PD_TP_GOOD, "pd_tp2pp2_tp2_control", "pd_tp2pp2_tp2_subtle"]
)


def _pd_tp_run(tmp_path, mutation: str = "") -> tuple[dict, dict]:
    out = tmp_path / "out"
    got = _fake_run(
        PD_PP,
        DSPARK_GPU_PD_PP_JOBS=PD_TP_JOBS,
        DSPARK_FAKE_MUTATION=mutation,
        DSPARK_GPU_PD_TP_PP_OUT=str(out),
    )
    return got, json.loads((out / "pd_tp_pp.json").read_text())


def test_fake_engines_pass_the_pd_tp_pp_jobs_and_their_record_is_written(tmp_path):
    got, record = _pd_tp_run(tmp_path)
    assert got["rc"] == 0 and not got.get("failed") and not got["errors"], got["last"]
    checks = [f"{c}[{n}]" for n in PD_TP_GOOD for c in ("kv", "ranks", "greedy", "acceptance")]
    assert set(checks) | {"nan_control", "subtle_control"} == set(record["verdicts"])
    assert all(v["ok"] for v in record["verdicts"].values()), record["verdicts"]
    shapes = record["shapes"]
    assert shapes["pd_tp2pp2_tp2"]["label"] == "producer TP2xPP2 -> decoder TP2"
    assert shapes["pd_tp2pp2_tp1"]["label"] == "producer TP2xPP2 -> decoder TP1"
    assert (
        "producer TP2xPP2 -> decoder TP2"
        in record["verdicts"]["acceptance[pd_tp2pp2_tp2]"]["detail"]
    )
    assert record["commit"] and record["date"] and record["gpu"] and record["command"]
    assert record["jobs"]["pd_tp2pp2_tp2"]["decoder_spec"]["num_drafts"] > 0
    assert record["selected_jobs"] == sorted(PD_TP_JOBS.split(","))


@pytest.mark.parametrize(
    "mutation, bad",
    [
        ("pd_low", [f"acceptance[{n}]" for n in PD_TP_GOOD]),
        ("kv_recomputed", [f"kv[{n}]" for n in PD_TP_GOOD]),
        ("pd_one_stage", [f"ranks[{n}]" for n in PD_TP_GOOD]),
        ("nan_same", ["nan_control"]),
        ("subtle_same", ["subtle_control"]),
    ],
)
def test_the_pd_tp_pp_checks_fail_on_their_controls(tmp_path, mutation, bad):
    """The controls of the PD TP x PP checks: lower decoder counters fail the acceptance check,
    a decoder that prefilled the prompts itself fails the every-prompt KV check, producer
    launchers that ran no exchange fail the every-rank check, controls that accept like the
    good run fail the NaN-norm and the subtle control checks."""
    got, record = _pd_tp_run(tmp_path, mutation)
    assert got["rc"] != 0 and got.get("failed") == len(bad), got["last"]
    failed = sorted(k for k, v in record["verdicts"].items() if not v["ok"])
    assert failed == sorted(bad), failed


# issue 42: DeepSeek-V4.1 at PP=2 (group dsv41_pp, tests/gpu/test_dsv41_pp.py)
DSV41_SERVED = ["pp2_graphs", "pp2_eager", "pp2_sync_eager"]


def _dsv41_run(tmp_path, mutation: str = "") -> tuple[dict, dict]:
    out = tmp_path / "out"
    got = _fake_run(
        DSV41_PP,
        DSPARK_FAKE_MUTATION=mutation,
        DSPARK_GPU_PP_LOGS=str(tmp_path / "logs"),
        DSPARK_GPU_DSV41_PP_OUT=str(out),
    )
    return got, json.loads((out / "dsv41_pp.json").read_text())


def test_fake_engines_pass_the_dsv41_pp_group_and_its_record_is_written(tmp_path):
    """Every job of the group starts (PP=1 references, three PP=2 DSpark jobs, the stock control)
    and every check passes on good counters; the record holds the stock refusal's line."""
    got, record = _dsv41_run(tmp_path)
    assert got["rc"] == 0 and got.get("passed") == 5 and not got["errors"], got["last"]
    assert set(record["verdicts"]) == {"pp1", "stock_refuses", *DSV41_SERVED}, record["verdicts"]
    assert all(v["ok"] for v in record["verdicts"].values()), record["verdicts"]
    stock = record["jobs"]["stock_pp2"]
    assert stock["outcome"] == "REFUSED" and stock["mirrors"] == "pp2_eager"
    assert "does not support dspark with pipeline parallelism" in stock["line"]
    assert record["k"] == 7 and record["pair"] == "models/dsv41-pair/dsv41" and record["commit"]
    assert record["jobs"]["pp2_sync_eager"]["args"] == ["--no-async-scheduling"]


@pytest.mark.parametrize(
    "mutation, bad",
    [
        ("stock_serves", ["stock_refuses"]),
        ("pp2_low", DSV41_SERVED),
        ("pp_one_stage", DSV41_SERVED),
        ("pos6_zero", ["pp1"]),
    ],
)
def test_the_dsv41_pp_checks_fail_on_their_controls(tmp_path, mutation, bad):
    """Stock vLLM serving instead of refusing fails the control; PP=2 counters lower at the last
    two positions, or a launcher without the handshake and exchange lines, fail every PP=2 job;
    a draft position that never accepts fails the trained reference's bar."""
    got, record = _dsv41_run(tmp_path, mutation)
    assert got["rc"] != 0 and got.get("failed") == len(bad), got["last"]
    failed = sorted(k for k, v in record["verdicts"].items() if not v["ok"])
    assert failed == sorted(bad), failed


@pytest.mark.parametrize(
    "mutation, failing",
    [
        ("pd_low", ["test_pd_acceptance_equals_aggregated",
                    "test_pp1_producer_pd_greedy_and_acceptance_equal_aggregated"]),
        ("kv_recomputed", ["test_decoder_pulled_the_prompt_kv_over_mooncake",
                           "test_pp1_producer_pd_is_context_kv_only_and_pulled_over_mooncake"]),
        ("subtle_same", ["test_subtly_wrong_producer_draft_drops_the_decoder_acceptance"]),
    ],
)  # fmt: skip
def test_the_pd_pp_dsv41_checks_fail_on_their_controls(mutation, failing):
    """Group pd_pp_dsv41 (issue 42): its PP=1 producer job runs by default beside the PP=2 ones,
    and lower decoder counters, a decoder that pulled no prompt KV, or a subtle control accepting
    like the good run fail the PP=2 and the PP=1 producer's checks alike."""
    child_env = {
        **os.environ,
        "DSPARK_FAKE_MODELS": str(REPO / "models"),
        "DSPARK_GPU_PD_PP_PAIR": "dsv41",
        "DSPARK_FAKE_MUTATION": mutation,
        "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("", "tests", "tests/gpu")),
    }
    child_env.pop("DSPARK_GPU_PD_PP_JOBS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider",
         "-p", "support.gpu_fake_engines", *PD_PP],
        cwd=REPO, env=child_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    got = sorted(set(re.findall(r"^FAILED \S+::(\w+)", proc.stdout, re.M)))
    assert proc.returncode != 0 and got == sorted(failing), proc.stdout[-3000:]
