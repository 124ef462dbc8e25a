"""One GPU, several ranks: DSpark on a TP=2 x PP=2 target through real NCCL (issue 40).

Every rank is its own vLLM launcher (``vllm serve -tp 2 -pp 2 --nnodes 4 --node-rank R``, node R
> 0 headless; dspark_dev/pp_launch.py): vLLM puts ``world_size / nnodes`` = 1 rank on each, and
launcher R holds global rank R = ``pp_rank * 2 + tp_rank``. By default all four share GPU 0, each
with its own ``NCCL_HOSTID`` (NCCL joins them over loopback sockets) and
``--disable-custom-all-reduce`` (vLLM's custom all-reduce indexes this process's visible devices by
TP rank: every rank but 0 died at start without it); ``DSPARK_GPU_PP_LAYOUT=per-stage`` puts
launcher R on GPU R. Model: the trained tiny pair (models/tiny-pair, k=7) in bf16
(``DSPARK_GPU_TP_PP_DTYPE``), three waves of 3, 5 and 7 held-out prompts, CUDA graphs (decode
graphs for 4 and 8 requests) unless a job says eager. The helpers are test_pp_one_gpu.py's (the
PP tier of issue 25): the same launcher settings, waves, abort and stock control.

Jobs, all started at once (``DSPARK_GPU_TP_PP_JOBS=a,b`` selects, ``all`` runs every one; the
default is :data:`DEFAULT_JOBS`, sized for one 540 s call on one H100/H200):

* ``ref``: PP=1 without speculation, eager, top-2 logprobs (the parity reference; default);
* ``pp1_async`` (default) / ``pp1_sync``: PP=1 DSpark with CUDA graphs (the acceptance
  references; a served job compares with the one of its scheduling when it ran, else the other);
* ``tp2pp2_async`` (default): TP=2 x PP=2, CUDA graphs, async scheduling; then a client abort
  mid-stream and the first wave again;
* ``tp2pp2_sync_eager`` (default): TP=2 x PP=2, eager, synchronous scheduling;
* ``tp2pp2_sync`` (graphs, sync), ``tp2pp2_eager`` (eager, async): the other two corners;
* ``tp2pp1_async`` / ``tp1pp2_async``: TP=2 alone and PP=2 alone (graphs, async), to locate a
  TP x PP failure;
* ``tp2pp2_fixed8``: ``tp2pp2_async`` with the fixed DSpark graph batch of 8 requests
  (``dspark_pp_fixed_graph_batch``): also checked, both last-stage TP ranks log pinned drafter
  dispatches (at least 10) and stage 0 none;
* ``stock_async`` / ``stock_sync_eager``: ``tp2pp2_async`` / ``tp2pp2_sync_eager`` with the plugin
  left out (``VLLM_PLUGINS``): what stock vLLM 0.34.0 does is recorded (answers and how well,
  crashes, or hangs: then every process's stacks, via faulthandler).

Checks: greedy tokens equal PP=1 no-spec under the bf16 near-tie rule (dspark_dev/parity.py);
spec-decode counters within 2 points of PP=1 DSpark's, per position included; every launcher's log
holds vLLM's ``rank R in world size 4 is assigned as ... PP rank R // 2 ... TP rank R % 2`` line,
NCCL communicators of the TP and PP group sizes in every launcher's log (``NCCL_DEBUG=INFO``), the
plugin's handshake line (``PP handshake: N ranks agree``, N the PP size or TP x PP) and its exchange
line ``over nccl``; no stubbed NCCL symbol of the kit was called (recording stub preloaded). A JSON
record (commit, date, GPU, command, shapes, per-job counters and evidence, per-check verdicts) goes
to ``$DSPARK_GPU_TP_PP_OUT`` (run_groups.sh: ``OUTDIR/tp_pp/tp_pp.json``), else
``$DSPARK_GPU_ARTIFACTS``, else the launcher log folder.

    source /tmp/site/env.sh && DSPARK_GPU_GROUPS_BUDGET_S=540 \\
        bash tools/gpu/run_groups.sh $OUT tp_pp
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
from gpu_common import (
    DRYRUN_CPU,
    GRAPH_COMPILATION_CONFIG,
    GpuRecord,
    Jobs,
    job_summary,
    select_jobs,
)
from support import tiny_pair
from test_pp_one_gpu import (
    LOG_DIR,
    MAX_TOKENS,
    WAVE_SIZES,
    _guard_and_waves,
    _llm,
    _result_summary,
    _served,
    _stock,
    _sum,
)

from dspark_dev import pp_launch
from dspark_dev.parity import compare_tokens, counters_close
from vllm_dspark_pp.protocol import draft_digest, graph_batch

pytestmark = pytest.mark.gpu  # the time limit: run_groups.sh --timeout (its budget)

REPO = Path(__file__).resolve().parents[2]
DTYPE = "float32" if DRYRUN_CPU else os.environ.get("DSPARK_GPU_TP_PP_DTYPE", "bfloat16")
JOBS_ENV = "DSPARK_GPU_TP_PP_JOBS"
# name: (tp, pp, async scheduling, eager)
SERVED = {
    "tp2pp2_async": (2, 2, True, False),
    "tp2pp2_sync_eager": (2, 2, False, True),
    "tp2pp2_sync": (2, 2, False, False),
    "tp2pp2_eager": (2, 2, True, True),
    "tp2pp1_async": (2, 1, True, False),
    "tp1pp2_async": (1, 2, True, False),
    "tp2pp2_fixed8": (2, 2, True, False),
}
#: served jobs with the fixed DSpark graph batch (``dspark_pp_fixed_graph_batch``): requests
FIXED = {"tp2pp2_fixed8": 8}
ABORT_JOB = "tp2pp2_async"
# name: the served job whose deployment it repeats without the plugin
STOCK = {"stock_async": "tp2pp2_async", "stock_sync_eager": "tp2pp2_sync_eager"}
REFS = ("ref", "pp1_async", "pp1_sync")
ALL_JOBS = (*REFS, *SERVED, *STOCK)
DEFAULT_JOBS = ("ref", "pp1_async", "tp2pp2_async", "tp2pp2_sync_eager")
#: every rank logs a digest of the drafts it posts or receives every N draft posts
#: (protocol/draft_digest.py): the direct evidence that all TP x PP ranks saw the same drafts
DIGEST_ENV, DIGEST_EVERY = "VLLM_DSPARK_PP_DRAFT_DIGEST", 16
REQUEST_TIMEOUT_S = 1200  # how long a test waits for its job (the group's --timeout ends it first)


ONLY = select_jobs(os.environ.get(JOBS_ENV, ""), JOBS_ENV, ALL_JOBS, DEFAULT_JOBS)
RECORD = GpuRecord("tp_pp.json")


def _shape(name: str) -> dict:
    if name in STOCK:
        return {**_shape(STOCK[name]), "plugin": False}
    if name in SERVED:
        tp, pp, flag, eager = SERVED[name]
    else:
        tp, pp, flag, eager = 1, 1, name != "pp1_sync", name == "ref"
    scheduling = "vLLM's default" if name == "ref" else "async" if flag else "sync"
    return {
        "tp": tp, "pp": pp, "scheduling": scheduling,
        "cuda_graphs": not (eager or DRYRUN_CPU), "dtype": DTYPE,
        "speculation": name != "ref", "plugin": True,
        "fixed_graph_batch": FIXED.get(name),
    }  # fmt: skip


def _verdict(check: str, ok: bool, detail: str) -> None:
    """The check's outcome for the JSON record (set before the test asserts it)."""
    RECORD.verdict(check, ok, detail)


def _job_summary(jobs: Jobs, name: str) -> dict:
    return job_summary(
        jobs, name, selected=name in ONLY, shape=_shape(name),
        summarize=lambda res: _result_summary(res, counters=name != "ref"),
    )  # fmt: skip


def _write_record(jobs: Jobs) -> Path:
    fields = {
        "issue": 40,
        "layout": pp_launch.layout(),
        "selected_jobs": sorted(ONLY),
        "waves": list(WAVE_SIZES),
        "max_tokens": MAX_TOKENS,
        "spec": tiny_pair.spec_config(),
        "graph_config": GRAPH_COMPILATION_CONFIG,
        "jobs": {name: _job_summary(jobs, name) for name in ALL_JOBS},
        "log_dir": str(LOG_DIR),
    }
    sources = ("dspark_dev/pp_launch.py", "tests/gpu/test_pp_one_gpu.py")
    path = RECORD.write(
        REPO, "tests/gpu/test_tp_pp_one_gpu.py", fields,
        out=os.environ.get("DSPARK_GPU_TP_PP_OUT"), fallback=LOG_DIR, sources=sources,
    )  # fmt: skip
    print(f"TP x PP record: {path}")
    return path


@pytest.fixture(scope="module")
def tp_pp_jobs():
    guard, waves = _guard_and_waves("nccl-guard-tp-pp")
    jobs = Jobs(only=ONLY, max_workers=16, knob=JOBS_ENV)
    graphs = {"compilation_config": GRAPH_COMPILATION_CONFIG}
    jobs.submit("ref", _llm, "tp_pp_ref", {"enforce_eager": True}, waves, logprobs=2, dtype=DTYPE)
    for mode, flag in (("async", True), ("sync", False)):
        cfg = {**graphs, "speculative_config": tiny_pair.spec_config(), "async_scheduling": flag}
        jobs.submit(f"pp1_{mode}", _llm, f"tp_pp_pp1_{mode}", cfg, waves, dtype=DTYPE)
    for name, (tp, pp, flag, eager) in SERVED.items():
        extra = {graph_batch.KEY: FIXED[name]} if name in FIXED else {}
        jobs.submit(
            name, _served, name, pp, flag, extra, waves, guard,
            abort=name == ABORT_JOB, tp=tp, eager=eager, dtype=DTYPE,
            env={DIGEST_ENV: str(DIGEST_EVERY)},
        )  # fmt: skip
    for name, like in STOCK.items():
        tp, pp, flag, eager = SERVED[like]
        jobs.submit(
            name, _stock, f"tp_pp_{name}", flag, waves, guard,
            pp=pp, tp=tp, eager=eager, dtype=DTYPE,
        )  # fmt: skip
    yield jobs, waves, guard
    try:
        _write_record(jobs)
    finally:
        jobs.shutdown()


def _ref(jobs: Jobs):
    return jobs.result("ref", timeout=REQUEST_TIMEOUT_S)


def _acceptance_ref(jobs: Jobs, async_scheduling: bool) -> tuple[str, object]:
    """PP=1 DSpark of the same scheduling when it ran, else of the other."""
    first = "pp1_async" if async_scheduling else "pp1_sync"
    other = "pp1_sync" if async_scheduling else "pp1_async"
    name = first if first in ONLY else other
    return name, jobs.result(name, timeout=REQUEST_TIMEOUT_S)


@pytest.mark.parametrize("name", list(SERVED))
def test_tp_pp_dspark_greedy_equals_pp1_without_speculation(tp_pp_jobs, name):
    jobs, _, _ = tp_pp_jobs
    got = jobs.result(name, timeout=REQUEST_TIMEOUT_S)
    ref = _ref(jobs)
    rep = compare_tokens(ref.tokens, got["tokens"], ref.logprobs)
    shape = _shape(name)
    desc = (
        f"{name} (TP={shape['tp']} x PP={shape['pp']}, {shape['scheduling']}, "
        f"{'graphs' if shape['cuda_graphs'] else 'eager'}, ready in {got['ready_s']} s) vs PP=1 "
        f"no-spec: {rep.describe()}"
    )
    problems = [] if got["alive_after"] else [f"{name}: a launcher died while serving"]
    if got["leftover_pids"]:
        problems.append(f"{name}: processes left behind {got['leftover_pids']}")
    _verdict(f"greedy[{name}]", rep.ok and not problems, "; ".join([desc, *problems]))
    print(desc)
    assert rep.ok, rep.describe()
    assert not problems, problems


@pytest.mark.parametrize("name", list(SERVED))
def test_tp_pp_dspark_acceptance_within_2_points_of_pp1_dspark(tp_pp_jobs, name):
    jobs, _, _ = tp_pp_jobs
    got = jobs.result(name, timeout=REQUEST_TIMEOUT_S)
    shape = _shape(name)
    ref_name, ref = _acceptance_ref(jobs, shape["scheduling"] == "async")
    mine, theirs = _sum(got["per_wave"]), ref.metrics()
    ok, desc = counters_close(mine, theirs)
    engaged = (
        bool(theirs["num_drafts"]) and 1 + theirs["num_accepted_tokens"] / theirs["num_drafts"] >= 3
    )
    line = (
        f"TP x PP acceptance: {name} (TP={shape['tp']} x PP={shape['pp']}) "
        f"{mine['num_accepted_tokens']}/{mine['num_draft_tokens']} vs {ref_name} "
        f"{theirs['num_accepted_tokens']}/{theirs['num_draft_tokens']}, "
        f"{datetime.date.today().isoformat()}: {desc}"
    )
    _verdict(f"acceptance[{name}]", ok and engaged, line)
    print(line)
    assert engaged, f"the PP=1 DSpark reference accepted too little to compare with: {theirs}"
    assert ok, desc


def _rank_problems(ev: dict, tp: int, pp: int) -> list[str]:
    world = tp * pp
    want = [[(r, world, r // tp, r % tp)] for r in range(world)]
    if ev["ranks"] != want:
        return [f"vLLM's rank lines per launcher {ev['ranks']}, want {want}"]
    return []


def _nccl_problems(ev: dict, tp: int, pp: int) -> list[str]:
    shared = pp_launch.layout() == pp_launch.SHARED
    problems = []
    for size in sorted({s for s in (tp, pp) if s > 1}):
        want = (str(size), str(size) if shared else "1")
        if want not in ev["nccl_comms"]:
            problems.append(
                f"no NCCL communicator of {size} ranks on {want[1]} 'nodes': {ev['nccl_comms']}"
            )
    silent = [r for r, comms in enumerate(ev["nccl_comms_per_log"]) if not comms]
    if silent:
        problems.append(f"launchers {silent} logged no NCCL communicator")
    if shared and not ev["nccl_socket"]:
        problems.append("NCCL did not report its socket transport (NET/Socket)")
    return problems


def _plugin_problems(ev: dict, tp: int, pp: int) -> list[str]:
    if pp == 1:  # no PP group: neither the handshake nor the exchange runs
        return []
    problems = []
    if not ev["handshake"]:
        problems.append(
            f"no 'PP handshake: N ranks agree' line with N in {{{pp}, {tp * pp}}}: "
            f"{ev['handshake_sizes']}"
        )
    # every rank (TP ranks included) runs the exchange and names its backend
    want = "gloo" if DRYRUN_CPU else "nccl"
    if ev["exchange_backends"] != [[want]] * (tp * pp):
        problems.append(
            f"the exchange's backend per launcher {ev['exchange_backends']}, want {want} on each"
        )
    # every TP rank of the last stage drafted, and every other rank received, the same drafts
    # (the control that this comparison can fail: tests/unit/protocol/test_draft_digest.py)
    digests = ev.get("draft_digests") or {}
    if len(digests) != tp * pp:
        problems.append(f"{len(digests)} ranks logged a drafts digest, want {tp * pp}")
    else:
        problems += draft_digest.disagreements(digests)
    return problems


@pytest.mark.parametrize("name", list(SERVED))
def test_every_rank_joined_and_talked_over_nccl(tp_pp_jobs, name):
    jobs, _, _ = tp_pp_jobs
    got = jobs.result(name, timeout=REQUEST_TIMEOUT_S)
    ev, tp, pp = got["evidence"], got["tp"], got["pp"]
    print(f"{name} evidence: {json.dumps(ev, default=str)}")
    problems = _rank_problems(ev, tp, pp) + _plugin_problems(ev, tp, pp)
    if not DRYRUN_CPU:
        problems += _nccl_problems(ev, tp, pp)
    _verdict(f"ranks[{name}]", not problems, "; ".join(problems) or json.dumps(ev, default=str))
    assert not problems, "\n".join(problems)


def test_fixed_graph_batch_pins_the_drafter_on_every_last_stage_rank(tp_pp_jobs):
    """``tp2pp2_fixed8``: with ``dspark_pp_fixed_graph_batch`` 8 each TP rank of the last stage
    (launchers 2 and 3) logs at least 10 drafter dispatches pinned to the fixed batch, and no
    rank of stage 0 (no drafter there) logs one; its greedy, acceptance and every-rank checks
    are the parametrized tests above. Control: a job without the setting logs none
    (tests/unit/support/test_gpu_fake_wiring.py, and every other served job's record)."""
    jobs, _, _ = tp_pp_jobs
    got = jobs.result("tp2pp2_fixed8", timeout=REQUEST_TIMEOUT_S)
    tp, pp = got["tp"], got["pp"]
    per_log = got["evidence"]["pinned_per_log"]
    last = range((pp - 1) * tp, pp * tp)
    problems = [f"launcher {r} (last stage) logged {per_log[r]}" for r in last
                if not per_log[r] or max(per_log[r]) < 10]  # fmt: skip
    problems += [f"launcher {r} (stage {r // tp}) logged {per_log[r]}"
                 for r in range(len(per_log)) if r not in last and per_log[r]]  # fmt: skip
    detail = f"pinned dispatch counts per launcher: {per_log}"
    _verdict("pinned[tp2pp2_fixed8]", not problems, "; ".join([detail, *problems]))
    print(detail)
    assert len(per_log) == tp * pp, detail
    assert not problems, problems


def test_abort_mid_stream_frees_the_request_and_serving_continues(tp_pp_jobs):
    jobs, waves, _ = tp_pp_jobs
    got = jobs.result(ABORT_JOB, timeout=REQUEST_TIMEOUT_S)
    ab = got["abort"]
    ref = _ref(jobs)
    n = len(waves[0])
    rep = compare_tokens(ref.tokens[:n], got["after_abort_tokens"], ref.logprobs[:n])
    ok = ab["chunks_read"] >= 1 and ab["running"] == 0 and rep.ok
    _verdict("abort", ok, f"{ab}; first wave again: {rep.describe()}")
    print(f"abort: {ab}; first wave again after the abort: {rep.describe()}")
    assert ab["chunks_read"] >= 1, "the stream sent nothing before the client left"
    assert ab["running"] == 0, f"the aborted request still runs {ab['running_after_s']} s later"
    assert rep.ok, rep.describe()


@pytest.mark.parametrize("name", list(STOCK))
def test_stock_vllm_tp2_pp2_is_recorded(tp_pp_jobs, name):
    """The control: stock vLLM 0.34.0 (plugin left out), the same four launchers. Its outcome is a
    record (works / fails / hangs), not a verdict on stock; the test fails only when no outcome
    could be determined."""
    jobs, _, _ = tp_pp_jobs
    rec = jobs.result(name, timeout=REQUEST_TIMEOUT_S)
    verdict = rec.get("outcome", "")
    if verdict == "ANSWERED":
        ref = _ref(jobs)
        rep = compare_tokens(ref.tokens, rec["tokens"], ref.logprobs)
        works = "WORKS" if rep.ok else "WRONG TOKENS"
        verdict = f"ANSWERED ({works}): {rep.describe().splitlines()[0]}; counters {rec['metrics']}"
    shape = _shape(STOCK[name])
    line = (
        f"STOCK vLLM 0.34.0, TP=2 x PP=2 DSpark, four launchers on one GPU, {shape['scheduling']} "
        f"scheduling, {'graphs' if shape['cuda_graphs'] else 'eager'}: {verdict}"
    )
    RECORD.verdict(f"stock[{name}]", None, line)
    print(line)
    for log_line in rec.get("log_excerpt", [])[:40]:
        print(f"  stock log: {log_line}")
    assert verdict and not verdict.startswith("UNDETERMINED"), (
        f"the stock control reached no verdict: {verdict}; give it a longer start-up deadline "
        "(DSPARK_GPU_PP_STOCK_READY_S)"
    )


def test_no_run_reaches_the_kit_nccl_stubs(tp_pp_jobs):
    jobs, _, guard = tp_pp_jobs
    for name in SERVED:
        if name in ONLY:
            try:
                jobs.result(name, timeout=REQUEST_TIMEOUT_S)
            except BaseException:  # noqa: BLE001 - their own tests report them
                pass
    if DRYRUN_CPU:
        pytest.skip("CPU dry run: no NCCL")
    assert guard.so is not None, f"the recording NCCL stub was not built: {guard.problem}"
    called = guard.calls()
    _verdict("nccl_stubs", not called, f"{len(guard.symbols)} stubbed symbols; called: {called}")
    print(f"{len(guard.symbols)} stubbed NCCL symbols; called: {called}")
    assert not called, f"stubbed NCCL functions were called: {called}"
