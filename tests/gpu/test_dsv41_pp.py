"""DeepSeek-V4.1 DSpark on a PP=2 target, on one GPU (issue 42; group ``dsv41_pp``).

vLLM 0.34.0 refuses DSpark over PP for ``DeepseekV41ForCausalLM`` when its last stage loads the
model; the plugin's patch ``models_deepseek_v41_nvidia_model`` relays the draft's aux taps over
the stages and builds the embedding on the last stage (docs/results/deepseek_v41.md, checked on
CPU only). vLLM has no CPU implementation of V4.1, so this module is the first engine run of it.

The pair: the bundled trained tiny V4.1 pair (``support.mla_pairs``, ``models/dsv41-pair/dsv41``:
target and its ``mtp.*`` draft in one checkpoint; 2 target layers, the draft reading the streams
entering layers 1 and 2, so a tap crosses the stage boundary at PP=2), bf16, k=7, the 15 held-out
corpus prompts of ``mla_pairs.heldout_waves`` in waves of 3, 5 and 7 (decode graphs of 4 and 8:
padded batches), stopping at EOS (at most 64 tokens). Engine settings are test_dsv4_k3_pp.py's
(max model length 256, 256 MiB of KV per engine, memory share 0.05, vLLM's default block size and
KV-cache dtype: ``auto`` resolves to V4.1's packed ``fp8_ds_mla`` record as for V4).

Jobs (``DSPARK_DSV41_PP_JOBS=a,b`` selects; empty: all but ``tp2pp2_graphs``; ``all``: every
one):

* ``base``: PP=1 without speculation, eager, top-2 logprobs (the parity reference);
* ``pp1``: PP=1 DSpark with CUDA graphs (the acceptance reference);
* ``pp2_graphs`` / ``pp2_eager``: PP=2 DSpark, two launchers on GPU 0 (dspark_dev/pp_launch.py;
  ``DSPARK_GPU_PP_LAYOUT=per-stage`` for one GPU per stage), vLLM's default (async) scheduling;
* ``pp2_sync_eager``: the same, eager, ``--no-async-scheduling``;
* ``tp2pp2_graphs`` (only when named): TP=2 x PP=2 with CUDA graphs, four launchers, one rank
  each, its handshake over 4 ranks;
* ``stock_pp2``, the control: ``pp2_eager``'s launchers with the plugin left out
  (``VLLM_PLUGINS=no-such-plugin``).

Checked: every PP=2 job's greedy output equals PP=1 no-spec (the bf16 near-tie rule of
dspark_dev/parity.py), its drafts, acceptance and per-position counters are within 2 points of PP=1
DSpark, one handshake over 2 ranks and the exchange over NCCL on both launchers, no process left;
PP=1 DSpark's greedy equals PP=1 no-spec and it accepts like a trained pair (mean acceptance
length >= 3.0, an accepted token at every draft position: issue 42's bar, so the 2-point rule
compares real acceptance); and stock vLLM must REFUSE at start with vLLM's ``does not support
dspark with pipeline parallelism`` (``support.pp_refusal``) while the plugin's ``pp2_eager``
serves. A JSON record (commit from ``DSPARK_GPU_COMMIT``, date, GPU, command, every job's summary
or failure, each check's verdict, the stock control's message) goes to
``$DSPARK_GPU_DSV41_PP_OUT/dsv41_pp.json`` (else ``$DSPARK_GPU_ARTIFACTS``, else the log folder).

    source /tmp/site/env.sh && DSPARK_GPU_GROUPS_BUDGET_S=540 \\
        bash tools/gpu/run_groups.sh $OUT dsv41_pp

The kit needs its ``mla`` group (TileLang: V4.1's mHC kernels, as V4's). On CPU the wiring runs
with fake engines (tests/unit/support/test_gpu_fake_wiring.py); collected without CUDA, every
test skips.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from gpu_common import (
    GRAPH_COMPILATION_CONFIG,
    GpuRecord,
    Jobs,
    llm_result_summary,
    recorded_result,
    require_cuda,
    select_jobs,
)
from support import mla_pairs, pp_refusal

from dspark_dev import pp_launch
from dspark_dev.parity import compare_tokens, counters_close
from dspark_dev.serve import GPU_CHILD_ENV

pytestmark = pytest.mark.gpu  # the time limit: run_groups.sh --timeout (its budget)

FAM = "dsv41"
K = mla_pairs.TRAINED_K
MAX_TOKENS = 64  # the held-out answers stop at EOS before that
READY_S = float(os.environ.get("DSPARK_GPU_PP_READY_S", "330"))
STOCK_READY_S = float(os.environ.get("DSPARK_GPU_PP_STOCK_READY_S", "420"))
#: ``language_model_only`` (mla_pairs.ENGINE_KWARGS): the tiny V4.1 pair is text only; without it
#: vLLM profiles V4.1's image encoder at start and needs an image token the tiny tokenizer lacks
LLM_BASE = {
    "max_model_len": 256,
    "gpu_memory_utilization": 0.05,
    "kv_cache_memory_bytes": 256 << 20,
    **mla_pairs.engine_kwargs(FAM),
}
BASE_ARGS = [
    "--dtype", "bfloat16", "--max-model-len", "256", "--max-num-seqs", "8", "--seed", "0",
    "--gpu-memory-utilization", "0.05", "--kv-cache-memory-bytes", str(256 << 20),
    *mla_pairs.serve_args(FAM),
]  # fmt: skip
#: the PP=2 DSpark jobs: name -> (eager, extra launcher arguments, TP size); TP=2 x PP=2 is four
#: launchers, one rank each (dspark_dev/pp_launch.py), and runs only when named (beside the
#: others its start-up would crowd the one GPU)
SERVED = {
    "pp2_graphs": (False, [], 1),
    "pp2_eager": (True, [], 1),
    "pp2_sync_eager": (True, ["--no-async-scheduling"], 1),
    "tp2pp2_graphs": (False, [], 2),
}
#: the stock control runs this job's launchers with the plugin left out
STOCK_OF = "pp2_eager"
JOBS_ENV = "DSPARK_DSV41_PP_JOBS"
ALL_JOBS = ("base", "pp1", *SERVED, "stock_pp2")
DEFAULT_JOBS = tuple(n for n in ALL_JOBS if n != "tp2pp2_graphs")
ONLY = select_jobs(os.environ.get(JOBS_ENV, ""), JOBS_ENV, ALL_JOBS, DEFAULT_JOBS)
LOG_DIR = Path(os.environ.get("DSPARK_GPU_PP_LOGS") or tempfile.mkdtemp(prefix="dspark-dsv41-pp-"))
REPO = Path(__file__).resolve().parents[2]
#: the run's JSON record, written when the module's jobs shut down: every job that ran, what it
#: gave or how it failed, and every check's verdict (docs/results pages quote this file)
RECORD: dict = {"jobs": {}}
VERDICTS = GpuRecord("dsv41_pp.json")  # every check's verdict, set before it asserts


def _sum(per_wave: list[dict]) -> dict:
    from dspark_dev.metrics import EMPTY, counter_sum

    out = dict(EMPTY, accepted_per_pos=[])
    for m in per_wave:
        out = counter_sum(out, m)
    return out


def _launch_mode(eager: bool) -> list[str]:
    if eager:
        return ["--enforce-eager"]
    return ["--compilation-config", json.dumps(GRAPH_COMPILATION_CONFIG)]


def _served(name: str, pair, waves, eager: bool, extra: list[str], tp: int = 1) -> dict:
    """PP=2 DSpark served by one launcher per rank (two, or four at TP=2) on GPU 0; the
    launchers' handshake and exchange lines read back from their logs. At TP=2 the pair's copy
    with two attention output groups (``mla_pairs.tp_pair``: vLLM builds no one-group V4.1
    attention at TP=2, tests/unit/producer/test_dsv4_tp_weight_tracking.py)."""
    pair = mla_pairs.tp_pair(FAM, pair, tp, LOG_DIR)
    env = {**GPU_CHILD_ENV, "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"}
    dep = pp_launch.deployment(
        f"dsv41_{name}", pair.target, pp=2, tp=tp, spec=pair.speculative_config(K),
        log_dir=LOG_DIR, device="gpu", base_args=[*BASE_ARGS, *_launch_mode(eager), *extra],
        env=env,
    )  # fmt: skip
    out: dict = {"name": name, "args": extra, "eager": eager, "tp": tp}
    error: Exception | None = None
    try:
        dep.start()
        out["ready_s"] = round(dep.wait_ready(READY_S), 1)
        out["tokens"], out["per_wave"] = pp_launch.serve_waves(
            dep.url, pair.target, waves, MAX_TOKENS, ignore_eos=False
        )
    except Exception as e:  # noqa: BLE001 - raised below, after the logs are read
        error = e
    finally:
        out["leftover_pids"] = dep.stop()
        logs = [n.log_tail(10**8) for n in dep.nodes]
        out["handshake"] = any(f"PP handshake: {2 * tp} ranks agree" in x for x in logs)
        out["backends"] = [
            x.split("DSpark PP exchange:")[1].splitlines()[0].rsplit(" ", 1)[-1]
            if "DSpark PP exchange:" in x
            else None
            for x in logs
        ]
    if error is not None:
        raise RuntimeError(f"[dsv41 {name}] {type(error).__name__}: {error}") from error
    return out


def _stock(pair) -> dict:
    """``STOCK_OF``'s launchers with the plugin left out: what their start gives
    (``pp_refusal.read_start``). Node 0 serves the API; vLLM's refusal comes when a stage loads
    the model, and the launcher that raised it exits."""
    eager, extra, _ = SERVED[STOCK_OF]
    env = {**GPU_CHILD_ENV, "VLLM_PLUGINS": "no-such-plugin", "PYTHONFAULTHANDLER": "1"}
    dep = pp_launch.deployment(
        "dsv41_stock_pp2", pair.target, pp=2, spec=pair.speculative_config(K), log_dir=LOG_DIR,
        device="gpu", base_args=[*BASE_ARGS, *_launch_mode(eager), *extra], env=env,
    )  # fmt: skip
    ready, exited, wait_error = False, [], None
    try:
        dep.start()
        try:
            dep.wait_ready(STOCK_READY_S)
            ready = True
        except Exception as e:  # noqa: BLE001 - a refusal ends the wait: recorded, read below
            wait_error = f"{type(e).__name__}: {str(e)[:1500]}"
        exited = dep.dead_nodes()  # before stop(): which launcher the start itself ended
    finally:
        leftover = dep.stop(grace_s=5)
        logs = [n.log_tail(10**8) for n in dep.nodes]
    out = pp_refusal.read_start(ready=ready, exited=exited, logs=logs)
    out.update(name="stock_pp2", mirrors=STOCK_OF, wait_error=wait_error, leftover_pids=leftover)
    return out


def _job_summary(res) -> dict:
    if isinstance(res, dict):  # a served PP=2 deployment or the stock control
        out = {k: v for k, v in res.items() if k not in ("tokens", "per_wave")}
        if "tokens" in res:
            out["num_tokens"] = sum(len(t) for t in res["tokens"])
        if "per_wave" in res:
            out["counters"] = _sum(res["per_wave"])
        return out
    return llm_result_summary(res)  # an LLMResult (the PP=1 references)


def _job(jobs: Jobs, name: str):
    """``jobs.result(name)``, what it gave (or its failure) kept for the record."""
    return recorded_result(jobs, name, RECORD["jobs"], _job_summary)


def _verdict(check: str, ok: bool, detail: str) -> None:
    """A check's outcome for the record (set before the test asserts it)."""
    VERDICTS.verdict(check, ok, detail)


def _write_record() -> Path:
    return VERDICTS.write(
        REPO,
        "tests/gpu/test_dsv41_pp.py",
        {
            "issue": 42,
            "pair": "models/dsv41-pair/dsv41",
            "k": K,
            "max_tokens": MAX_TOKENS,
            "base_args": BASE_ARGS,
            "layout": pp_launch.layout(),
            "selected_jobs": sorted(ONLY),
            "jobs": RECORD["jobs"],
        },
        out=os.environ.get("DSPARK_GPU_DSV41_PP_OUT"),  # run_groups.sh: OUTDIR/<group>
        fallback=LOG_DIR,
    )


@pytest.fixture(scope="module")
def dsv41_jobs():
    require_cuda()
    from support.gpu import run_llm

    pair, why = mla_pairs.trained_pair(FAM)
    if pair is None:
        pytest.skip(why)
    trained_k = mla_pairs.block_size(pair, FAM)
    if trained_k != K:
        pytest.fail(f"the bundled dsv41 pair was trained for block {trained_k}, not {K}")
    waves = mla_pairs.heldout_waves(pair)
    sampling = {"max_tokens": MAX_TOKENS, "ignore_eos": False}
    jobs = Jobs(only=ONLY, max_workers=len(ALL_JOBS), knob=JOBS_ENV)
    jobs.submit(
        "base", run_llm, "dsv41_pp_base", {**LLM_BASE, "model": pair.target, "enforce_eager": True},
        waves, timeout_s=READY_S + 60, sampling=sampling, logprobs=2,
    )  # fmt: skip
    jobs.submit(
        "pp1", run_llm, "dsv41_pp1_graphs",
        {**LLM_BASE, "model": pair.target, "speculative_config": pair.speculative_config(K),
         "compilation_config": GRAPH_COMPILATION_CONFIG}, waves,
        timeout_s=READY_S + 60, sampling=sampling,
    )  # fmt: skip
    for name, (eager, extra, tp) in SERVED.items():
        jobs.submit(name, _served, name, pair, waves, eager, extra, tp)
    jobs.submit("stock_pp2", _stock, pair)
    yield jobs
    jobs.shutdown()
    _write_record()


def test_pp1_dspark_is_lossless_and_accepts_like_a_trained_pair(dsv41_jobs):
    """The references: PP=1 DSpark's greedy equals PP=1 no-spec (near-tie rule), and it reaches
    issue 42's bar (mean acceptance length >= 3.0, every draft position accepted), so the 2-point
    rule of the PP=2 checks compares real acceptance."""
    base, pp1 = _job(dsv41_jobs, "base"), _job(dsv41_jobs, "pp1")
    rep = compare_tokens(base.tokens, pp1.tokens, base.logprobs)
    ref = pp1.metrics()
    problems = mla_pairs.trained_acceptance_problems(ref, K)
    length = mla_pairs.acceptance_length(ref)
    detail = (
        f"vs PP=1 no-spec: {rep.describe()}; acceptance length {length:.3f}, per position "
        f"{ref.get('accepted_per_pos')} of {ref.get('num_drafts')} drafts"
    )
    print(f"[dsv41 PP=1 DSpark graphs] {detail}")
    _verdict("pp1", rep.ok and not problems, detail + "".join(f"; {p}" for p in problems))
    assert rep.ok, rep.describe()
    assert not problems, f"PP=1 DSpark reference: {'; '.join(problems)} ({ref})"


@pytest.mark.parametrize("job", list(SERVED))
def test_pp2_greedy_parity_and_acceptance(dsv41_jobs, job):
    """A PP=2 DSpark job against the references: greedy equal to PP=1 no-spec, counters within 2
    points of PP=1 DSpark per position, one handshake over every rank (2, or 4 at TP=2), the
    exchange over NCCL on every launcher, no process left."""
    base, pp1 = _job(dsv41_jobs, "base"), _job(dsv41_jobs, "pp1")
    got = _job(dsv41_jobs, job)
    rep = compare_tokens(base.tokens, got["tokens"], base.logprobs)
    mine, ref = _sum(got["per_wave"]), pp1.metrics()
    ok, desc = counters_close(mine, ref)
    wired = got["handshake"] and got["backends"] == ["nccl"] * (2 * got.get("tp", 1))
    print(f"[dsv41 {job}] ready {got['ready_s']} s; vs PP=1 no-spec: {rep.describe()}")
    print(
        f"PP acceptance: dsv41 {job} {mine['num_accepted_tokens']}/{mine['num_draft_tokens']} "
        f"(length {mla_pairs.acceptance_length(mine):.3f}, per position "
        f"{mine.get('accepted_per_pos')}) vs PP=1 DSpark {ref['num_accepted_tokens']}/"
        f"{ref['num_draft_tokens']} (length {mla_pairs.acceptance_length(ref):.3f}): {desc}"
    )
    print(f"[dsv41 {job}] handshake {got['handshake']}, exchange over {got['backends']}")
    _verdict(job, rep.ok and ok and wired, f"{rep.describe()}; {desc}; {got['backends']}")
    assert rep.ok, rep.describe()
    assert ok, desc
    assert wired, (got["handshake"], got["backends"])
    assert not got["leftover_pids"], got["leftover_pids"]


def test_stock_vllm_refuses_what_the_plugin_serves(dsv41_jobs):
    """The control: stock vLLM 0.34.0 (plugin left out) under ``STOCK_OF``'s launchers must
    refuse at start naming vLLM's refusal, while the plugin's ``STOCK_OF`` served."""
    stock = _job(dsv41_jobs, "stock_pp2")
    line = (
        f"STOCK vLLM 0.34.0, DeepSeek-V4.1 PP=2 DSpark ({STOCK_OF}'s launchers): "
        f"{stock['outcome']}: {stock['line'] or stock['evidence']}"
    )
    print(line)
    served = _job(dsv41_jobs, STOCK_OF)
    plugin_served = bool(served.get("tokens")) and all(served["tokens"])
    _verdict("stock_refuses", stock["outcome"] == pp_refusal.REFUSED and plugin_served, line)
    assert stock["outcome"] == pp_refusal.REFUSED, line
    assert not stock["leftover_pids"], stock["leftover_pids"]
    assert plugin_served, f"the plugin's {STOCK_OF} answered no tokens: {served.get('tokens')}"
