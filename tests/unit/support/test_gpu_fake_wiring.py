"""The GPU groups of issues 26, 40 and 42 run their wiring on CPU with fake engines
(tests/support/gpu_fake_engines.py): which engines each mode starts, with which arguments, and
that their checks pass on good counters and fail on bad ones. A GPU lease is short; a test module
broken in a way the CPU can see must not be found there. Each case is the plugin's own command in
a child pytest.

The child runs are named in :data:`RUNS`; every test takes the name of its run as the ``run``
parameter. The first test of the module starts the runs of every selected test of this module in
a pool (``DSPARK_FAKE_WIRING_PARALLEL`` at once, default 2: the children are CPU-bound and
independent), so each test then waits for its own run's result; a run nobody selected never
starts."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parents[3]
DSV4K3 = ["tests/gpu/test_dsv4_k3_engine.py", "tests/gpu/test_dsv4_k3_pp.py"]
PD_PP = ["tests/gpu/test_pd_pp_producer.py"]
DSV41_PP = ["tests/gpu/test_dsv41_pp.py"]
TP_PP = ["tests/gpu/test_tp_pp_one_gpu.py"]
# issue 25's pp group: every job but the stock controls and ``fault`` (not faked)
PP = ["tests/gpu/test_pp_one_gpu.py"]
PP_SERVED = ["pp2_async", "pp2_sync", "pp3_async", "pp3_sync", "pp2_fixed8"]
PP_JOBS = ",".join(["ref", "pp1_async", "pp1_sync", *PP_SERVED])
# issue 44 item 4: group tap_partials (test_pp_one_gpu.py's opt-in jobs)
TAP_SERVED = ["pp3_async", "pp3_taps_dict", "pp3_taps_side"]
TAP_JOBS = ",".join(["ref", "pp1_async", *TAP_SERVED, "pp3_taps_wrong"])
# every TP x PP job but the stock control (its fake would wait on a /health that never answers)
TP_PP_JOBS = ",".join(
    ["ref", "pp1_async", "pp1_sync", "tp2pp2_async", "tp2pp2_sync_eager", "tp2pp2_sync",
     "tp2pp2_eager", "tp2pp1_async", "tp1pp2_async", "tp2pp2_fixed8"]
)  # fmt: skip
# issue 40 item 2: PD with a TP=2 x PP=2 producer (test_pd_pp_producer.py's opt-in jobs)
PD_TP_GOOD = ["pd_tp2pp2_tp2", "pd_tp2pp2_tp1"]
PD_TP_JOBS = ",".join(
    ["pair_baseline", "pair_spec", *PD_TP_GOOD, "pd_tp2pp2_tp2_control", "pd_tp2pp2_tp2_subtle"]
)
# issue 40 item 6: PD with a PP=2 producer under synchronous scheduling (opt-in job)
PD_SYNC_JOBS = "pair_baseline,pair_spec,pd_pp2_sync"
# issue 42: DeepSeek-V4.1 at PP=2 (group dsv41_pp, tests/gpu/test_dsv41_pp.py)
DSV41_SERVED = ["pp2_graphs", "pp2_eager", "pp2_sync_eager"]
TRAINED_DSV4 = {"DSPARK_DSV4K3_WEIGHTS": "trained", "DSPARK_GPU_PD_PP_PAIR": "dsv4"}

#: name: (test modules, environment of the child run)
RUNS: dict[str, tuple[list[str], dict[str, str]]] = {
    "dummy": (DSV4K3 + PD_PP, {}),  # dummy weights (k=4), the tiny pair's PD
    "trained-dsv4": (DSV4K3 + PD_PP, TRAINED_DSV4),
    "pd-pp-k3": (PD_PP, {"DSPARK_GPU_PD_PP_PAIR": "k3"}),
    "pd-pp-dsv41": (PD_PP, {"DSPARK_GPU_PD_PP_PAIR": "dsv41"}),
    "trained-dsv4-pos6_zero": (
        DSV4K3 + PD_PP,
        {**TRAINED_DSV4, "DSPARK_FAKE_MUTATION": "pos6_zero"},
    ),
    "pp": (PP, {"DSPARK_GPU_PP_JOBS": PP_JOBS}),
    "pp-pp2_low": (PP, {"DSPARK_GPU_PP_JOBS": PP_JOBS, "DSPARK_FAKE_MUTATION": "pp2_low"}),
    "pp-taps": (PP, {"DSPARK_GPU_PP_JOBS": TAP_JOBS}),
    "pp-taps-taps_in_dict": (
        PP,
        {"DSPARK_GPU_PP_JOBS": TAP_JOBS, "DSPARK_FAKE_MUTATION": "taps_in_dict"},
    ),
    "pp-taps-side_unconnected": (
        PP,
        {"DSPARK_GPU_PP_JOBS": TAP_JOBS, "DSPARK_FAKE_MUTATION": "side_unconnected"},
    ),
    "pp-taps-taps_wrong_unseen": (
        PP,
        {"DSPARK_GPU_PP_JOBS": TAP_JOBS, "DSPARK_FAKE_MUTATION": "taps_wrong_unseen"},
    ),
    "tp_pp-default-jobs": (TP_PP, {}),
    "tp_pp-all-but-stock": (TP_PP, {"DSPARK_GPU_TP_PP_JOBS": TP_PP_JOBS}),
    **{
        f"tp_pp-{m}": (TP_PP, {"DSPARK_GPU_TP_PP_JOBS": TP_PP_JOBS, "DSPARK_FAKE_MUTATION": m})
        for m in ("pp2_low", "rank_silent+digest_differs")
    },
    **{
        f"pd_tp_pp{'-' + m if m else ''}": (
            PD_PP,
            {"DSPARK_GPU_PD_PP_JOBS": PD_TP_JOBS, "DSPARK_FAKE_MUTATION": m},
        )
        for m in ("", "pd_low", "kv_recomputed", "pd_one_stage", "nan_same", "subtle_same")
    },
    **{
        f"pd_pp_sync{'-' + m if m else ''}": (
            PD_PP,
            {"DSPARK_GPU_PD_PP_JOBS": PD_SYNC_JOBS, "DSPARK_FAKE_MUTATION": m},
        )
        for m in ("", "pd_low", "kv_recomputed")
    },
    **{
        f"dsv41_pp{'-' + m if m else ''}": (DSV41_PP, {"DSPARK_FAKE_MUTATION": m})
        for m in ("", "stock_serves", "pp2_low", "pp_one_stage", "pos6_zero")
    },
    **{
        f"pd-pp-dsv41-{m}": (PD_PP, {"DSPARK_GPU_PD_PP_PAIR": "dsv41", "DSPARK_FAKE_MUTATION": m})
        for m in ("pd_low", "kv_recomputed", "subtle_same")
    },
}
#: the knobs a child run must not inherit from this process unless its run sets them
CHILD_KNOBS = ("DSPARK_DSV4K3_WEIGHTS", "DSPARK_GPU_PD_PP_PAIR", "DSPARK_FAKE_MUTATION",
               "DSPARK_GPU_TP_PP_JOBS", "DSPARK_GPU_PD_PP_JOBS", "DSPARK_GPU_PD_TP_PP_OUT",
               "DSPARK_GPU_DSV41_PP_OUT", "DSPARK_GPU_TP_PP_OUT", "DSPARK_GPU_PP_LOGS",
               "DSPARK_FAKE_CALLS",
               "DSPARK_GPU_PP_JOBS", "DSPARK_GPU_PP_OUT", "DSPARK_GPU_PD_PP_OUT")  # fmt: skip
OUT_ROOT = Path(tempfile.mkdtemp(prefix="dspark-fake-wiring-"))


def _fake_run_now(name: str) -> dict:
    """Run ``RUNS[name]`` in a child pytest: its counts, return code, last line, the names of
    its failed tests, and the folder its records went to."""
    modules, env = RUNS[name]
    out = OUT_ROOT / hashlib.sha1(name.encode()).hexdigest()[:12]
    child_env = {k: v for k, v in os.environ.items() if k not in CHILD_KNOBS}
    child_env.update(
        DSPARK_FAKE_MODELS=str(REPO / "models"),
        PYTHONPATH=os.pathsep.join(str(REPO / p) for p in ("", "tests", "tests/gpu")),
        DSPARK_GPU_PP_LOGS=str(out / "logs"),
        DSPARK_GPU_TP_PP_OUT=str(out),
        DSPARK_GPU_PD_TP_PP_OUT=str(out),
        DSPARK_GPU_DSV41_PP_OUT=str(out),
        DSPARK_GPU_PP_OUT=str(out),
        DSPARK_GPU_PD_PP_OUT=str(out),
        DSPARK_FAKE_CALLS=str(out / "calls.json"),
    )
    child_env.update({k: v for k, v in env.items() if v})
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider"]
        + ["-p", "support.gpu_fake_engines", *modules],
        cwd=REPO,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
    counts: dict = {
        k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", last)
    }
    counts["errors"] = counts.pop("error", 0) + counts.pop("errors", 0)
    counts["rc"] = proc.returncode
    counts["last"] = last
    counts["failed_tests"] = sorted(set(re.findall(r"^FAILED \S+::(\w+)", proc.stdout, re.M)))
    counts["stdout_tail"] = proc.stdout[-3000:]
    counts["out"] = out
    return counts


@pytest.fixture(scope="module")
def fake_runs(request):
    """Starts the runs of this module's selected tests, in their order, a few at once; returns
    ``get(name)``, which waits for one."""
    names = []
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is request.module and params.get("run") in RUNS:
            names.append(params["run"])
    workers = max(1, int(os.environ.get("DSPARK_FAKE_WIRING_PARALLEL", "2")))
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fake-run")
    futures: dict[str, Future] = {n: pool.submit(_fake_run_now, n) for n in dict.fromkeys(names)}

    def get(name: str) -> dict:
        if name not in futures:
            futures[name] = pool.submit(_fake_run_now, name)
        return futures[name].result(timeout=600)

    yield get
    pool.shutdown(wait=True, cancel_futures=True)


def _record(got: dict, file: str) -> dict:
    return json.loads((got["out"] / file).read_text())


def _pd_pp_checks(pair: str) -> set[str]:
    """The verdicts of pd_pp.json for a pair's default jobs."""
    checks = {f"{c}[pd_pp2]" for c in ("proxy", "producer", "kv", "greedy", "acceptance")}
    checks |= {"nan_control", "nccl_stubs"}
    if pair != "tiny":  # the subtle control is the trained MLA pairs'
        checks.add("subtle_control")
    if pair == "dsv41":  # its PD with a PP=1 producer
        checks |= {"producer_kv[pd_pp1]", "greedy[pd_pp1]", "acceptance[pd_pp1]"}
    return checks


@pytest.mark.parametrize(
    "run, pair", [("dummy", "tiny"), ("trained-dsv4", "dsv4"), ("pd-pp-k3", "k3"),
                  ("pd-pp-dsv41", "dsv41")]
)  # fmt: skip
def test_fake_engines_pass_the_gpu_groups_wiring(fake_runs, run, pair):
    """Every check passes on good counters, and the PD-with-PP-producer jobs' record pd_pp.json
    holds every check's verdict (all ok), the ``PD acceptance:`` line and the decoder's counters
    per position."""
    got = fake_runs(run)
    assert got["rc"] == 0 and not got.get("failed") and not got["errors"], got["last"]
    assert got.get("passed", 0) > 0, got["last"]
    record = _record(got, "pd_pp.json")
    assert set(record["verdicts"]) == _pd_pp_checks(pair), record["verdicts"]
    assert all(v["ok"] for v in record["verdicts"].values()), record["verdicts"]
    assert record["pair"] == pair and record["commit"] and record["source_sha256"]
    assert record["verdicts"]["acceptance[pd_pp2]"]["detail"].startswith("PD acceptance: ")
    pd = record["jobs"]["pd_pp2"]
    assert pd["shape"]["label"] == "producer TP1xPP2 -> decoder TP1", pd["shape"]
    assert len(pd["decoder_spec"]["accepted_per_pos"]) == record["k"], pd
    assert pd["producer_evidence"]["producer_built_drafter"] == [False, True], pd
    assert record["jobs"]["pd_pp2_control"]["shape"]["producer_draft"] == "nan"


@pytest.mark.parametrize("run", ["trained-dsv4-pos6_zero"])
def test_the_wiring_run_fails_when_a_draft_position_never_accepts(fake_runs, run):
    """The control: the fake counters with draft position 6 at 0 must fail the trained checks."""
    got = fake_runs(run)
    assert got["rc"] != 0 and got.get("failed", 0) > 0, got["last"]


@pytest.mark.parametrize("run", ["pp"])
def test_fake_engines_pass_the_pp_group_and_its_record_is_written(fake_runs, run):
    """Group pp (issue 25): every job but the stock controls and ``fault``; pp.json holds each
    served job's greedy, acceptance and NCCL verdicts, the pinned dispatch, the abort and the
    NCCL stubs, all ok, with each job's shape, counters, tokens, ready time and evidence."""
    got = fake_runs(run)
    record = _record(got, "pp.json")
    assert got["rc"] == 0 and not got.get("failed") and not got["errors"], got["last"]
    checks = {f"{c}[{n}]" for n in PP_SERVED for c in ("greedy", "acceptance", "nccl")}
    assert checks | {"pinned", "abort", "nccl_stubs"} == set(record["verdicts"])
    assert all(v["ok"] for v in record["verdicts"].values()), record["verdicts"]
    assert record["selected_jobs"] == sorted(PP_JOBS.split(","))
    assert record["commit"] and record["source_sha256"] and record["date"] and record["command"]
    jobs = record["jobs"]
    assert jobs["pp3_sync"]["shape"] == {
        "pp": 3, "scheduling": "sync", "cuda_graphs": True, "dtype": "float32",
        "speculation": True, "plugin": True,
    }  # fmt: skip
    assert jobs["stock_async"]["shape"]["plugin"] is False and not jobs["stock_async"]["selected"]
    assert jobs["pp3_async"]["counters"]["num_drafts"] > 0 and jobs["pp3_async"]["num_tokens"]
    assert jobs["pp3_async"]["ready_s"] is not None
    assert jobs["pp3_async"]["evidence"]["handshake_sizes"] == [3, 3, 3]
    assert jobs["pp2_fixed8"]["evidence"]["pinned"] == [1, 10, 100]
    assert jobs["ref"]["counters"] is None and jobs["pp1_sync"]["counters"]["num_drafts"] > 0


@pytest.mark.parametrize("run", ["pp-pp2_low"])
def test_the_pp_acceptance_verdicts_fail_on_low_acceptance(fake_runs, run):
    """The control: served counters lower at the last two draft positions fail the acceptance
    check of every served job, and pp.json records exactly those verdicts as failed."""
    got = fake_runs(run)
    record = _record(got, "pp.json")
    assert got["rc"] != 0 and got.get("failed") == len(PP_SERVED), got["last"]
    bad = sorted(k for k, v in record["verdicts"].items() if not v["ok"])
    assert bad == sorted(f"acceptance[{n}]" for n in PP_SERVED), bad
    assert "PP acceptance: PP=3 pp3_sync" in record["verdicts"]["acceptance[pp3_sync]"]["detail"]


@pytest.mark.parametrize("run", ["pp-taps"])
def test_fake_engines_pass_the_tap_partials_group(fake_runs, run):
    """Group tap_partials (issue 44 item 4): PP=3 with raw taps, the partial in the intermediate
    tensors and on the side channel; each served job's greedy, acceptance and NCCL verdicts and
    the two tap jobs' key checks, all ok, with the mode in each tap job's shape."""
    got = fake_runs(run)
    record = _record(got, "pp.json")
    assert got["rc"] == 0 and not got.get("failed") and not got["errors"], got["last"]
    checks = {f"{c}[{n}]" for n in TAP_SERVED for c in ("greedy", "acceptance", "nccl")}
    taps = {"tap_partials[pp3_taps_dict]", "tap_partials[pp3_taps_side]"}
    taps.add("tap_control[pp3_taps_wrong]")
    assert checks | taps | {"nccl_stubs"} == set(record["verdicts"]), record["verdicts"]
    assert all(v["ok"] for v in record["verdicts"].values()), record["verdicts"]
    jobs = record["jobs"]
    assert jobs["pp3_taps_wrong"]["shape"]["probe"] == "DSPARK_TEST_TAP_WRONG_BLOCK=1"
    assert "must differ" in record["verdicts"]["tap_control[pp3_taps_wrong]"]["detail"]
    assert jobs["pp3_taps_side"]["shape"]["tap_partials"] == "side"
    assert jobs["pp3_taps_side"]["evidence"]["tap_side"] == {
        "0": {"dspark_tap_partial": 512}, "1": {"dspark_tap_partial": 512}
    }  # fmt: skip
    assert "tap_partials" not in jobs["pp3_async"]["shape"]


@pytest.mark.parametrize(
    ("run", "detail"),
    [
        # the side-channel job's stages still send the partial to the next stage
        ("pp-taps-taps_in_dict", "dspark_tap_partial"),
        # it serves, but its launchers logged no start-up link (TapSideChannel.connect not
        # called: the state of commit 91ad093, whose side channel never became ready on an H200)
        ("pp-taps-side_unconnected", "side channel connect lines []"),
    ],
)
def test_the_side_channel_check_fails_on_its_controls(fake_runs, run, detail):
    """The controls of the side-channel job: only its key check fails, naming what is wrong."""
    got = fake_runs(run)
    record = _record(got, "pp.json")
    assert got["rc"] != 0 and got.get("failed") == 1, got["last"]
    bad = sorted(k for k, v in record["verdicts"].items() if not v["ok"])
    assert bad == ["tap_partials[pp3_taps_side]"], bad
    assert detail in record["verdicts"][bad[0]]["detail"]


@pytest.mark.parametrize("run", ["pp-taps-taps_wrong_unseen"])
def test_the_tap_control_fails_when_the_wrong_partial_goes_unseen(fake_runs, run):
    """The control of the control: the probed job accepts as much as PP=1 (as if the acceptance
    check could not see a wrong partial); only the control's test fails."""
    got = fake_runs(run)
    record = _record(got, "pp.json")
    assert got["rc"] != 0 and got.get("failed") == 1, got["last"]
    assert got["failed_tests"] == ["test_control_a_wrong_tap_partial_fails_the_acceptance_check"]
    bad = sorted(k for k, v in record["verdicts"].items() if not v["ok"])
    assert bad == ["tap_control[pp3_taps_wrong]"], bad


@pytest.mark.parametrize("run", ["tp_pp-default-jobs", "tp_pp-all-but-stock"])
def test_fake_engines_pass_the_tp_pp_group_and_its_record_is_written(fake_runs, run):
    got = fake_runs(run)
    record = _record(got, "tp_pp.json")
    assert got["rc"] == 0 and not got.get("failed") and not got["errors"], got["last"]
    all_jobs = run == "tp_pp-all-but-stock"
    served = TP_PP_JOBS.split(",")[3:] if all_jobs else ["tp2pp2_async", "tp2pp2_sync_eager"]
    checks = [f"{c}[{n}]" for n in served for c in ("greedy", "acceptance", "ranks")]
    checks += ["pinned[tp2pp2_fixed8]"] if all_jobs else []
    assert set(checks) | {"abort", "nccl_stubs"} == set(record["verdicts"]), record["verdicts"]
    assert all(v["ok"] for v in record["verdicts"].values()), record["verdicts"]
    if all_jobs:  # both last-stage TP ranks pinned, stage 0 not; no other job pinned anything
        detail = record["verdicts"]["pinned[tp2pp2_fixed8]"]["detail"]
        assert "[[], [], [1, 10, 100], [1, 10, 100]]" in detail, detail
        assert record["jobs"]["tp2pp2_fixed8"]["shape"]["fixed_graph_batch"] == 8
        assert record["jobs"]["tp2pp2_async"]["evidence"]["pinned"] == []
    assert record["jobs"]["tp2pp2_async"]["shape"]["tp"] == 2 and record["commit"]
    assert record["jobs"]["tp2pp2_async"]["counters"]["num_drafts"] > 0


@pytest.mark.parametrize(
    "run, check", [("tp_pp-pp2_low", "acceptance"), ("tp_pp-rank_silent+digest_differs", "ranks")]
)
def test_the_tp_pp_checks_fail_on_low_acceptance_and_a_silent_rank(fake_runs, run, check):
    """The controls: lower counters at the last two draft positions fail the acceptance check of
    every served job; a launcher without vLLM's rank line fails the every-rank check, and so
    does (in the same run, named in the same verdict) a last rank that logged another drafts
    digest than the others (PP > 1 jobs only: TP=2 PP=1 has no exchange)."""
    got = fake_runs(run)
    record = _record(got, "tp_pp.json")
    assert got["rc"] != 0 and got.get("failed") == 7, got["last"]
    bad = sorted(k for k, v in record["verdicts"].items() if not v["ok"])
    assert bad == sorted(f"{check}[{n}]" for n in TP_PP_JOBS.split(",")[3:]), bad
    if "digest_differs" in run:
        for n in TP_PP_JOBS.split(",")[3:]:
            detail = record["verdicts"][f"ranks[{n}]"]["detail"]
            assert "rank lines per launcher" in detail, detail
            assert ("after 16 draft posts" in detail) == (n != "tp2pp1_async"), detail


@pytest.mark.parametrize("run", ["pd_tp_pp"])
def test_fake_engines_pass_the_pd_tp_pp_jobs_and_their_record_is_written(fake_runs, run):
    got = fake_runs(run)
    record = _record(got, "pd_tp_pp.json")
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
    assert not (got["out"] / "pd_pp.json").exists(), "no PP=2 / PP=1 producer job was selected"


@pytest.mark.parametrize("run", ["pd_pp_sync"])
def test_fake_engines_pass_the_sync_pd_pp2_job_with_sync_launchers(fake_runs, run):
    """Job pd_pp2_sync (issue 40 item 6): every PD launcher gets ``--no-async-scheduling`` and
    none ``--async-scheduling``; its three checks pass and pd_pp.json records them."""
    got = fake_runs(run)
    record = _record(got, "pd_pp.json")
    assert got["rc"] == 0 and not got.get("failed") and not got["errors"], got["last"]
    checks = {f"{c}[pd_pp2_sync]" for c in ("producer_kv", "greedy", "acceptance")}
    assert set(record["verdicts"]) == checks | {"nccl_stubs"}, record["verdicts"]
    assert all(v["ok"] for v in record["verdicts"].values()), record["verdicts"]
    assert record["shapes"]["pd_pp2_sync"]["scheduling"] == "sync"
    assert "sync scheduling" in record["verdicts"]["acceptance[pd_pp2_sync]"]["detail"]
    pd_calls = [c for c in json.loads((got["out"] / "calls.json").read_text()) if c[0] == "pd"]
    assert len(pd_calls) == 1, pd_calls
    common = pd_calls[0][4]["common_args"]  # every PD launcher's arguments
    assert "--no-async-scheduling" in common and "--async-scheduling" not in common, common


@pytest.mark.parametrize(
    "run, bad",
    [("pd_pp_sync-pd_low", ["acceptance[pd_pp2_sync]"]),
     ("pd_pp_sync-kv_recomputed", ["producer_kv[pd_pp2_sync]"])],
)  # fmt: skip
def test_the_sync_pd_pp2_checks_fail_on_their_controls(fake_runs, run, bad):
    """Lower decoder counters fail the sync job's acceptance check, a decoder that prefilled the
    prompts itself its KV check; nothing else fails."""
    got = fake_runs(run)
    record = _record(got, "pd_pp.json")
    assert got["rc"] != 0, got["last"]
    assert sorted(k for k, v in record["verdicts"].items() if not v["ok"]) == bad


@pytest.mark.parametrize(
    "run, bad",
    [
        ("pd_tp_pp-pd_low", [f"acceptance[{n}]" for n in PD_TP_GOOD]),
        ("pd_tp_pp-kv_recomputed", [f"kv[{n}]" for n in PD_TP_GOOD]),
        ("pd_tp_pp-pd_one_stage", [f"ranks[{n}]" for n in PD_TP_GOOD]),
        ("pd_tp_pp-nan_same", ["nan_control"]),
        ("pd_tp_pp-subtle_same", ["subtle_control"]),
    ],
)
def test_the_pd_tp_pp_checks_fail_on_their_controls(fake_runs, run, bad):
    """The controls of the PD TP x PP checks: lower decoder counters fail the acceptance check,
    a decoder that prefilled the prompts itself fails the every-prompt KV check, producer
    launchers that ran no exchange fail the every-rank check, controls that accept like the
    good run fail the NaN-norm and the subtle control checks."""
    got = fake_runs(run)
    record = _record(got, "pd_tp_pp.json")
    assert got["rc"] != 0 and got.get("failed") == len(bad), got["last"]
    failed = sorted(k for k, v in record["verdicts"].items() if not v["ok"])
    assert failed == sorted(bad), failed


@pytest.mark.parametrize("run", ["dsv41_pp"])
def test_fake_engines_pass_the_dsv41_pp_group_and_its_record_is_written(fake_runs, run):
    """Every job of the group starts (PP=1 references, three PP=2 DSpark jobs, the stock control)
    and every check passes on good counters; the record holds the stock refusal's line."""
    got = fake_runs(run)
    record = _record(got, "dsv41_pp.json")
    assert got["rc"] == 0 and got.get("passed") == 5 and not got["errors"], got["last"]
    assert set(record["verdicts"]) == {"pp1", "stock_refuses", *DSV41_SERVED}, record["verdicts"]
    assert all(v["ok"] for v in record["verdicts"].values()), record["verdicts"]
    stock = record["jobs"]["stock_pp2"]
    assert stock["outcome"] == "REFUSED" and stock["mirrors"] == "pp2_eager"
    assert "does not support dspark with pipeline parallelism" in stock["line"]
    assert record["k"] == 7 and record["pair"] == "models/dsv41-pair/dsv41" and record["commit"]
    assert record["jobs"]["pp2_sync_eager"]["args"] == ["--no-async-scheduling"]


@pytest.mark.parametrize(
    "run, bad",
    [
        ("dsv41_pp-stock_serves", ["stock_refuses"]),
        ("dsv41_pp-pp2_low", DSV41_SERVED),
        ("dsv41_pp-pp_one_stage", DSV41_SERVED),
        ("dsv41_pp-pos6_zero", ["pp1"]),
    ],
)
def test_the_dsv41_pp_checks_fail_on_their_controls(fake_runs, run, bad):
    """Stock vLLM serving instead of refusing fails the control; PP=2 counters lower at the last
    two positions, or a launcher without the handshake and exchange lines, fail every PP=2 job;
    a draft position that never accepts fails the trained reference's bar."""
    got = fake_runs(run)
    record = _record(got, "dsv41_pp.json")
    assert got["rc"] != 0 and got.get("failed") == len(bad), got["last"]
    failed = sorted(k for k, v in record["verdicts"].items() if not v["ok"])
    assert failed == sorted(bad), failed


@pytest.mark.parametrize(
    "run, failing, bad",
    [
        ("pd-pp-dsv41-pd_low", ["test_pd_acceptance_equals_aggregated",
                                "test_pp1_producer_pd_greedy_and_acceptance_equal_aggregated"],
         ["acceptance[pd_pp1]", "acceptance[pd_pp2]"]),
        ("pd-pp-dsv41-kv_recomputed", [
            "test_decoder_pulled_the_prompt_kv_over_mooncake",
            "test_pp1_producer_pd_is_context_kv_only_and_pulled_over_mooncake"],
         ["kv[pd_pp2]", "producer_kv[pd_pp1]"]),
        ("pd-pp-dsv41-subtle_same",
         ["test_subtly_wrong_producer_draft_drops_the_decoder_acceptance"], ["subtle_control"]),
    ],
)  # fmt: skip
def test_the_pd_pp_dsv41_checks_fail_on_their_controls(fake_runs, run, failing, bad):
    """Group pd_pp_dsv41 (issue 42): its PP=1 producer job runs by default beside the PP=2 ones,
    and lower decoder counters, a decoder that pulled no prompt KV, or a subtle control accepting
    like the good run fail the PP=2 and the PP=1 producer's checks alike; pd_pp.json records
    exactly those verdicts as failed."""
    got = fake_runs(run)
    assert got["rc"] != 0 and got["failed_tests"] == sorted(failing), got["stdout_tail"]
    record = _record(got, "pd_pp.json")
    failed = sorted(k for k, v in record["verdicts"].items() if not v["ok"])
    assert failed == sorted(bad), failed
