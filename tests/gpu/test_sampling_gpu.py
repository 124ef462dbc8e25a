"""Sampling is exact under PP on the GPU, with power against temperature 0.8 (issue 28 case 4;
group ``sampling``; the CPU hand run and the method: docs/results/reliability.md, "Case 4").

Two engines start together on GPU 0:

* ``pp2``: PP=2 DSpark (trained tiny pair, models/tiny-pair, k=7) through two launchers: node 0 is
  ``vllm.LLM`` (dspark_dev/engine_worker.py, stepped by hand so every request's token count after
  each engine step is known) with ``nnodes=2, node_rank=0``; node 1 is ``vllm serve --headless``
  (dspark_dev/pp_launch.py, rank 1). Each launcher has its own ``NCCL_HOSTID`` and NCCL joins them
  over loopback sockets, as in the other PP groups. Three waves of the same 2,048 seeded
  requests (64 held-out questions cut after 3 tokens, 32 seeds each, 17 tokens, ``ignore_eos``;
  ``support.reliability`` says why this size): temperature 1.0, then the controls 0.8 and 0.5.
  (Through ``vllm serve`` the per-step token counts are not visible: vLLM merges a stream's
  deltas when the client falls behind, so tokens right after an accepted draft could not be found.)
* ``pp1``: PP=1 DSpark (``vllm.LLM``), the temperature-1 wave only: seeded requests must give
  the same tokens and the same verification steps at PP=2 (case 4').
* ``ref``: PP=1 without speculation, 64 seeded temperature-1 requests (one per prefix) with every
  token's raw logprob: vLLM's served distribution, against which the transformers reference's
  distance is measured (below).

Float32, eager, synchronous scheduling, 256 sequences a step. The reference distribution is the
target run by ``transformers`` in float32 with a float64 softmax (vLLM not involved), as on CPU.
The served target is float32 too, with vLLM's float32 matmul precision "highest" (pinned: no
TF32), so the two differ by float32 rounding, relative 1e-6 or so. Why that cannot make the
test reject: draws from a served distribution p mapped through a reference p' land in each PIT
bin with a probability within sum |p - p'| = 2d of 1/5 (d the total variation distance), so the
statistic's expected excess is at most n x 5 bins x (2d)^2 / (1/5) = 100 n d^2: 0.002 at
n = 2,048 and d = 1e-4 (a hundred times float32 rounding), against a gap of 14.5 between the
statistic's mean (4) and the critical value (18.5). (bfloat16 would differ by about 1e-2, a
possible excess of 20: not used here for that reason.) The ``ref`` job measures d on 1,088
contexts and the test asserts 100 n d^2 < 0.5 at the larger n. The first tokens and the tokens
sampled right after an accepted draft token of the same verification step are mapped through it
by the randomized PIT; Pearson's chi-square over 5 equiprobable bins, alpha 1e-3. Asserted:
temperature 1 not rejected, both controls rejected, the exact power against temperature 0.8 at
the sampled contexts and the realized n at least 0.9, the bookkeeping (verification steps =
vLLM's ``num_drafts``), the reference's measured distance, PP=2 = PP=1.

    source /tmp/site/env.sh && bash tools/gpu/run_groups.sh $OUT sampling

``$OUT/sampling/sampling.json``: statistics, p-values, n, bins, noncentralities, powers,
counters, start-up and wave times, and the PP=1 / PP=2 comparison.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path

import pytest
import torch
from gpu_common import CPU_DRYRUN_ENV, DRYRUN_CPU, Jobs, require_cuda
from support import tiny_pair
from support.reliability import (
    GPU_SAMPLING_MAX_TOKENS,
    GPU_SAMPLING_PER_PROMPT,
    GPU_SAMPLING_REQUESTS,
    SAMPLING_ALPHA,
    SAMPLING_BINS,
    SAMPLING_POWER,
    continuation_probs,
    critical_value,
    pit_noncentrality_per_sample,
    pit_of_wave,
    pit_power,
    seeded_sampling_wave,
    target_next_token_probs,
    uniformity_chi_square,
)

from dspark_dev import pp_launch
from dspark_dev.engine import child_env, run_engine
from dspark_dev.serve import GPU_CHILD_ENV, Server, free_port

pytestmark = pytest.mark.gpu

REQUESTS = int(
    os.environ.get("DSPARK_GPU_SAMPLING_REQUESTS") or (64 if DRYRUN_CPU else GPU_SAMPLING_REQUESTS)
)
PER_PROMPT = 8 if DRYRUN_CPU else GPU_SAMPLING_PER_PROMPT
MAX_TOKENS = 9 if DRYRUN_CPU else GPU_SAMPLING_MAX_TOKENS
TEMPERATURES = (1.0, 0.8, 0.5)  # the first is the test, the others the controls
SEED0 = 2_800_000
BUDGET_S = float(os.environ.get("DSPARK_GPU_SAMPLING_BUDGET_S", "1500" if DRYRUN_CPU else "500"))
OUT_DIR = Path(os.environ.get("DSPARK_GPU_SAMPLING_OUT") or tempfile.mkdtemp(prefix="sampling-"))
# the engines' logs (run_groups.sh: its artifacts.tgz, so that few files come back from the GPU)
LOG_DIR = Path(os.environ.get("DSPARK_GPU_SAMPLING_LOGS") or OUT_DIR)
KV_BYTES = 1 << 30
VOCAB = 448  # the pair's vocabulary: the ref job asks for every token's logprob
REF_REQUESTS = 8 if DRYRUN_CPU else 64
ENGINE = {  # node 0's vllm.LLM and node 1's `vllm serve` must agree on these
    "dtype": "float32",  # the reference's numerics (module docstring); not PAIR_DTYPE
    "max_model_len": 512,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 4096,
    "seed": 0,
    "enforce_eager": True,
}
if not DRYRUN_CPU:
    ENGINE.update(gpu_memory_utilization=0.05, kv_cache_memory_bytes=KV_BYTES)


def _cli(engine: dict) -> list[str]:
    argv = []
    for k, v in engine.items():
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [flag, str(v)]
    return [*argv, "--no-async-scheduling"]


def _env(rank: int) -> dict:
    if DRYRUN_CPU:
        return dict(CPU_DRYRUN_ENV)
    return {
        **GPU_CHILD_ENV,
        **pp_launch.stage_env(rank, device="gpu", tag="sampling"),
        "VLLM_FLOAT32_MATMUL_PRECISION": "highest",  # vLLM's default, pinned: no TF32
    }


def _waves() -> list[dict]:
    return [
        seeded_sampling_wave(
            REQUESTS, MAX_TOKENS, temperature=t, seed0=SEED0, per_prompt=PER_PROMPT
        )
        for t in TEMPERATURES
    ]


def _engine_spec(name: str, llm: dict, waves: list[dict]) -> dict:
    return {
        "name": name,
        "llm": {"distributed_executor_backend": "mp", "async_scheduling": False, **ENGINE, **llm},
        "waves": [w["prompts"] for w in waves],
        "wave_sampling": [w["sampling"] for w in waves],
        "sampling": {"max_tokens": MAX_TOKENS},
    }


def _check(run, name: str) -> dict:
    if not run.ok:
        raise AssertionError(
            f"{name}: engine failed in phase {run.phase!r} (timed out: {run.timed_out}): "
            f"{run.result.get('error')}\n{run.log_text[-6000:]}"
        )
    return run.result


def _pp2(waves: list[dict]) -> dict:
    """Node 1 headless first, then node 0's ``vllm.LLM`` runs every wave; node 1 is stopped at
    the end whatever happened (a lost peer ends node 0 with vLLM's error, never a hang: the
    engine run has a hard deadline)."""
    master = free_port()
    spec = tiny_pair.spec_config()
    argv = pp_launch.launcher_argv(
        tiny_pair.TARGET, pp=2, rank=1, master_port=master, api_port=None, spec=spec,
        base_args=_cli(ENGINE),
    )  # fmt: skip
    cache = Path(tempfile.mkdtemp(prefix="sampling-cache-"))
    node1 = Server(
        argv, LOG_DIR / "pp2_node1.log", env={**_env(1), "VLLM_CACHE_ROOT": str(cache / "node1")},
        name="pp2 node 1 (headless)", cpu=DRYRUN_CPU,
    )  # fmt: skip
    llm = {
        "model": tiny_pair.TARGET, "pipeline_parallel_size": 2, "speculative_config": spec,
        "nnodes": 2, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": master,
    }  # fmt: skip
    try:
        node1.start()
        run = run_engine(
            _engine_spec("pp2", llm, waves), timeout_s=BUDGET_S - 40, name="sampling-pp2",
            env=child_env({**_env(0), "VLLM_CACHE_ROOT": str(cache / "node0")}),
        )  # fmt: skip
        Path(LOG_DIR, "pp2_node0.log").write_text(run.log_text[-400_000:])
        return _check(run, "PP=2 DSpark")
    finally:
        node1.stop(grace_s=5.0)


def _pp1(waves: list[dict]) -> dict:
    llm = {"model": tiny_pair.TARGET, "speculative_config": tiny_pair.spec_config()}
    run = run_engine(
        _engine_spec("pp1", llm, waves[:1]), timeout_s=BUDGET_S - 40, name="sampling-pp1",
        env=child_env(_env(0)), own_cache=True,
    )  # fmt: skip
    Path(LOG_DIR, "pp1.log").write_text(run.log_text[-200_000:])
    return _check(run, "PP=1 DSpark")


def _ref(waves: list[dict]) -> dict:
    """PP=1 without speculation, the full next-token distribution (raw logprobs, every token of
    the vocabulary) along REF_REQUESTS seeded temperature-1 requests: vLLM's own numbers for the
    served target, to measure how far the transformers reference is from them."""
    w = waves[0]
    idx = list(range(0, REQUESTS, PER_PROMPT))[:REF_REQUESTS]  # one request per prefix
    one = {"prompts": [w["prompts"][i] for i in idx], "sampling": [
        {**w["sampling"][i], "logprobs": VOCAB} for i in idx]}  # fmt: skip
    llm = {"model": tiny_pair.TARGET, "max_logprobs": VOCAB}
    run = run_engine(
        _engine_spec("ref", llm, [one]), timeout_s=BUDGET_S - 40, name="sampling-ref",
        env=child_env(_env(0)), own_cache=True,
    )  # fmt: skip
    Path(LOG_DIR, "ref.log").write_text(run.log_text[-200_000:])
    res = _check(run, "PP=1 without speculation (reference logprobs)")
    got = res["waves"][0]
    return {"prompts": one["prompts"], "tokens": got["tokens"], "logprobs": got["logprobs"]}


def _reference_distance(ref: dict) -> dict:
    """Total variation distance between vLLM's served distribution (the ``ref`` job) and the
    transformers reference at the same contexts, and the largest excess it could add to the
    statistic (module docstring: 100 n d^2, computed by the caller at the larger n)."""
    tv = []
    for prompt, toks, lps in zip(ref["prompts"], ref["tokens"], ref["logprobs"], strict=True):
        mine = continuation_probs(prompt, [toks])[0]  # [M, vocab]
        for j, pos in enumerate(lps):
            served = torch.zeros(mine.shape[-1], dtype=torch.float64)
            for t, lp in pos.items():
                served[int(t)] = math.exp(lp)
            tv.append(0.5 * float((served - mine[j]).abs().sum()))
    return {"contexts": len(tv), "max_tv": max(tv), "mean_tv": sum(tv) / len(tv)}


def _group_report(u: torch.Tensor) -> dict:
    res = uniformity_chi_square(u, SAMPLING_BINS)
    out = {"n": res["n"], "stat": round(res["stat"], 2), "p": res["p_value"]}
    out["observed"] = res["observed"]
    return out


def _report(waves: list[dict], pp2: dict) -> dict:
    runs = [{**w, **r} for w, r in zip(waves, pp2["waves"], strict=True)]
    pits = [pit_of_wave(r, seed=17) for r in runs]
    exact = pits[0]
    report: dict = {
        "requests": REQUESTS,
        "max_tokens": MAX_TOKENS,
        "prefixes": REQUESTS // PER_PROMPT,
        "alpha": SAMPLING_ALPHA,
        "bins": SAMPLING_BINS,
        "critical": round(critical_value(SAMPLING_BINS - 1, SAMPLING_ALPHA), 2),
        "verification_steps": exact["verification_steps"],
        "accepted_in_output": exact["accepted_in_output"],
        "metrics": [r["metrics"] for r in runs],
        "wave_s": [r["wall_s"] for r in runs],
        "startup_s": pp2.get("startup_s"),
        "config": pp2.get("config"),
        "reference": "transformers float32 on CPU, float64 softmax; served target "
        f"{ENGINE['dtype']} (vLLM, eager); distance measured: reference_distance",
    }
    for name in ("first", "after_accepted"):
        g: dict = {}
        for t, pit in zip(TEMPERATURES, pits, strict=True):
            g[f"T={t}"] = _group_report(pit["u"][name])
        ctx = exact["contexts"][name]
        n = g["T=1.0"]["n"]
        g["noncentrality_per_sample"] = {
            str(t): pit_noncentrality_per_sample(ctx, t, SAMPLING_BINS) for t in TEMPERATURES[1:]
        }
        g["power_at_n"] = {
            t: pit_power(n, per, SAMPLING_BINS, SAMPLING_ALPHA)
            for t, per in g["noncentrality_per_sample"].items()
        }
        report[name] = g
    return report


def _first_difference(a: list[int], b: list[int], prompt: list[int]) -> dict:
    """Where two seeded outputs part, and the target's probabilities of both tokens there (a
    near-tie shows as close probabilities)."""
    j = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    p = target_next_token_probs([prompt + a[:j]])[0]
    top2 = torch.topk(p, 2).values.tolist()
    return {"position": j, "tokens": [a[j], b[j]], "p": [float(p[a[j]]), float(p[b[j]])],
            "top2_gap": top2[0] - top2[1]}  # fmt: skip


@pytest.fixture(scope="module")
def sampling():
    require_cuda()
    ok, why = tiny_pair.available()
    assert ok, why
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    waves = _waves()
    jobs = Jobs(max_workers=3)
    t0 = time.monotonic()
    try:
        jobs.submit("pp2", _pp2, waves)
        jobs.submit("pp1", _pp1, waves)
        jobs.submit("ref", _ref, waves)
        pp2 = jobs.result("pp2", timeout=BUDGET_S)
        pp1 = jobs.result("pp1", timeout=BUDGET_S)
        ref = jobs.result("ref", timeout=BUDGET_S)
    finally:
        jobs.shutdown()
    engines_s = round(time.monotonic() - t0, 1)
    report = _report(waves, pp2)
    dist = _reference_distance(ref)
    n_max = max(report[g]["T=1.0"]["n"] for g in ("first", "after_accepted"))
    dist["max_excess_at_n"] = 100 * n_max * dist["max_tv"] ** 2
    report["reference_distance"] = dist
    report["engines_s"] = engines_s
    report["analysis_s"] = round(time.monotonic() - t0 - engines_s, 1)
    mine, ref = pp2["waves"][0], pp1["waves"][0]
    diff = [i for i, t in enumerate(ref["tokens"]) if mine["tokens"][i] != t]
    report["pp2_vs_pp1"] = {
        "requests": REQUESTS,
        "differing": len(diff),
        "first_differences": [
            _first_difference(ref["tokens"][i], mine["tokens"][i], waves[0]["prompts"][i])
            for i in diff[:10]
        ],
        "same_step_lengths": mine["step_lengths"] == ref["step_lengths"],
        "pp1_metrics": ref["metrics"],
        "pp2_metrics": mine["metrics"],
        "pp1_startup_s": pp1.get("startup_s"),
    }
    (OUT_DIR / "sampling.json").write_text(json.dumps(report, indent=1))
    print("SAMPLING RESULT " + json.dumps(report))
    return report


@pytest.mark.parametrize("group", ["first", "after_accepted"])
def test_pp2_dspark_samples_the_targets_distribution_and_rejects_the_controls(sampling, group):
    r = sampling[group]
    exact, c08, c05 = (r[f"T={t}"] for t in TEMPERATURES)
    print(
        f"sampling {group}: n={exact['n']} T=1 p={exact['p']:.3g} | T=0.8 p={c08['p']:.3g} | "
        f"T=0.5 p={c05['p']:.3g} | power vs 0.8 at n: {r['power_at_n']['0.8']:.4f}"
    )
    assert r["power_at_n"]["0.8"] >= SAMPLING_POWER, (
        f"{group}: too few samples for power {SAMPLING_POWER} against temperature 0.8: {r}"
    )
    assert exact["p"] > SAMPLING_ALPHA, f"{group} tokens are not the target's distribution: {r}"
    assert c08["p"] < SAMPLING_ALPHA, f"{group}: the temperature-0.8 control was not rejected: {r}"
    assert c05["p"] < SAMPLING_ALPHA, f"{group}: the temperature-0.5 control was not rejected: {r}"


def test_the_reference_is_the_served_targets_distribution(sampling):
    """vLLM's served distribution (PP=1, no speculation, every token's raw logprob) against the
    transformers reference at the same contexts: the largest excess their distance could add
    to the statistic at this n must be far below the gap between its mean and the critical
    value (14.5)."""
    d = sampling["reference_distance"]
    print(f"sampling reference: {d}")
    assert d["contexts"] >= REF_REQUESTS * MAX_TOKENS, d
    assert d["max_excess_at_n"] < 0.5, f"the reference is not the served target's: {d}"


def test_the_selection_reads_every_verification_step(sampling):
    """One output per verification step: the steps read from the outputs equal vLLM's
    ``num_drafts``; accepted tokens cut by ``max_tokens`` are counted by vLLM, not emitted."""
    m = sampling["metrics"][0]
    assert sampling["verification_steps"] == m["num_drafts"], sampling
    assert 0 < sampling["accepted_in_output"] <= m["num_accepted_tokens"], sampling


def test_seeded_requests_give_pp1_dsparks_tokens_at_pp2(sampling):
    cmp = sampling["pp2_vs_pp1"]
    print(f"PP=2 vs PP=1 DSpark, seeded: {cmp['differing']}/{cmp['requests']} differ")
    assert cmp["differing"] == 0, f"seeded requests differ at PP=2: {cmp['first_differences']}"
    assert cmp["same_step_lengths"], "same tokens, other verification steps"
    assert cmp["pp1_metrics"] == cmp["pp2_metrics"], cmp
