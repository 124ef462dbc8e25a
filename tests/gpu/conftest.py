"""Fixtures of the one-GPU tier (tests/gpu).

Every engine the tier needs is started ONCE, concurrently, by the session fixture ``gpu_jobs``
(the whole suite must fit one 10-minute command on the GPU machine, and one engine start costs
30-90 s there): each job is a subprocess (or a pair of servers) with its own hard deadline, run
from a thread pool, and the tests only read the results. The first test to ask for
``gpu_jobs`` launches everything; tests that do not need engines (kernels) run meanwhile.

Jobs (``max_num_seqs=8``; the first four: bf16, random-weight tiny Qwen3 target + tiny DSpark
draft):

* ``baseline``  no speculation, eager, top-2 logprobs (evidence for near-ties), plugin probe in
  the worker;
* ``spec_graphs`` DSpark with CUDA graphs on (vLLM's default mode) and decode graphs captured
  for 4 and 8 requests, so waves of 3, 5 and 7 requests replay padded graphs;
* ``spec_eager`` DSpark with ``enforce_eager``;
* ``spec_graphs_fixed8`` as ``spec_graphs`` plus the plugin's fixed DSpark graph batch of 8
  (only when ``vllm_dspark_pp.protocol.graph_batch`` exists);
* ``pair_baseline`` / ``pair_spec``  the trained tiny pair (models/tiny-pair, k=7, float32 by
  default: ``DSPARK_GPU_PAIR_DTYPE``) on 7 held-out prompts, stopping at EOS: no speculation with
  top-2 logprobs, and aggregated DSpark in the PD servers' mode (CUDA graphs, or eager with
  ``DSPARK_GPU_PD_EAGER=1``): the references of the PD job;
* ``pd``  prefiller + decoder over MooncakeConnector/TCP with the trained pair on the same 7
  prompts (the random pair accepts only at draft position 0, so the decoder's acceptance would
  not depend on the draft context it receives).

Environment knobs: ``DSPARK_GPU_JOBS`` (comma-separated job names: start only these; the tests
of the others are skipped with that reason, e.g. ``pair_baseline,pair_spec,pair_spec_sync,pd`` for
the PD tests alone), ``DSPARK_GPU_ARTIFACTS`` (where failing jobs leave logs),
``DSPARK_GPU_PD_EAGER=1`` (PD servers eager instead of CUDA graphs), ``DSPARK_GPU_NEAR_TIE``.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from gpu_common import (  # tests/gpu is on sys.path (pytest's rootdir-less conftest import)
    CPU_DRYRUN_ENV,
    CPU_DRYRUN_LLM,
    DRYRUN_CPU,
    GRAPH_COMPILATION_CONFIG,
    MAX_TOKENS,
    ONLY_JOBS,
    PAIR_DTYPE,
    PAIR_MAX_TOKENS,
    PAIR_SAMPLING,
    PD_EAGER,
    TIMEOUTS,
    Jobs,
    fixed_graph_batch_key,
    make_prompts,
    pair_prompts,
    require_cuda,
    spec_config,
)

#: Runs first in a GPU session: a kit without CUDA, vLLM or the plugin's entry point says so
#: before any engine starts (the files are named for what they check, not numbered for order).
FIRST = "test_environment_gpu.py"


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name != FIRST)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def gpu_models(tmp_path_factory):
    """The tiny pair in bf16 with head_dim 64 (a FlashAttention-3 head size)."""
    require_cuda()
    if importlib.util.find_spec("vllm_dspark_pp.tiny_models") is None:
        pytest.skip("vllm_dspark_pp.tiny_models is missing (branch e2e not merged): no tiny models")
    from vllm_dspark_pp.tiny_models import make_tiny_models

    if DRYRUN_CPU:
        return make_tiny_models(tmp_path_factory.mktemp("gpu_tiny_models"), seed=0)
    return make_tiny_models(
        tmp_path_factory.mktemp("gpu_tiny_models"),
        seed=0,
        dtype="bfloat16",
        hidden_size=128,
        intermediate_size=256,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
    )


@pytest.fixture(scope="session")
def gpu_waves():
    return make_prompts()


@pytest.fixture(scope="session")
def gpu_jobs(gpu_models, gpu_waves):
    from support.gpu import run_llm as _run_llm
    from support.pd_run import run_pd

    def run_llm(name, cfg, waves, **kw):
        if DRYRUN_CPU:
            cfg = {**cfg, **CPU_DRYRUN_LLM}
            kw["env"] = {**CPU_DRYRUN_ENV, **(kw.get("env") or {})}
        return _run_llm(name, cfg, waves, **kw)

    jobs = Jobs(only=ONLY_JOBS)
    target = gpu_models.target
    sampling = {"max_tokens": MAX_TOKENS}
    jobs.submit(
        "baseline",
        run_llm,
        "baseline",
        {"model": target, "enforce_eager": True},
        gpu_waves,
        timeout_s=TIMEOUTS["eager"],
        sampling=sampling,
        logprobs=2,
        probe=True,
    )
    jobs.submit(
        "spec_graphs",
        run_llm,
        "spec_graphs",
        {
            "model": target,
            "speculative_config": spec_config(gpu_models),
            "compilation_config": GRAPH_COMPILATION_CONFIG,
        },
        gpu_waves,
        timeout_s=TIMEOUTS["graphs"],
        sampling=sampling,
    )
    jobs.submit(
        "spec_eager",
        run_llm,
        "spec_eager",
        {"model": target, "speculative_config": spec_config(gpu_models), "enforce_eager": True},
        gpu_waves,
        timeout_s=TIMEOUTS["eager"],
        sampling=sampling,
    )
    key = fixed_graph_batch_key()
    if key is None:
        jobs.skip(
            "spec_graphs_fixed8",
            "vllm_dspark_pp.protocol.graph_batch is missing (protocol branch not merged): no "
            "fixed DSpark graph batch",
        )
    else:
        jobs.submit(
            "spec_graphs_fixed8",
            run_llm,
            "spec_graphs_fixed8",
            {
                "model": target,
                "speculative_config": spec_config(gpu_models, **{key: 8}),
                "compilation_config": GRAPH_COMPILATION_CONFIG,
            },
            gpu_waves,
            timeout_s=TIMEOUTS["graphs"],
            sampling=sampling,
        )
    common = [
        "--dtype", PAIR_DTYPE, "--max-model-len", "512", "--max-num-seqs", "8", "--seed", "0",
        "--gpu-memory-utilization", "0.3", "--kv-cache-memory-bytes", str(1 << 30),
    ]  # fmt: skip
    if PD_EAGER:
        common.append("--enforce-eager")
    else:
        common += ["--compilation-config", json.dumps(GRAPH_COMPILATION_CONFIG)]
    if DRYRUN_CPU:
        for name in ("pair_baseline", "pair_spec", "pd"):
            jobs.skip(
                name,
                "DSPARK_GPU_DRYRUN_CPU=1: no PD (nor its trained-pair references) on the CPU dry "
                "run",
            )
        yield jobs
        jobs.shutdown()
        return
    from support import tiny_pair

    ok, why = tiny_pair.available()
    if not ok:
        for name in ("pair_baseline", "pair_spec", "pd"):
            jobs.skip(name, why)
        yield jobs
        jobs.shutdown()
        return
    pair_waves = [pair_prompts()]
    pair_llm = {"model": tiny_pair.TARGET, "dtype": PAIR_DTYPE}
    jobs.submit(
        "pair_baseline",
        run_llm,
        "pair_baseline",
        {**pair_llm, "enforce_eager": True},
        pair_waves,
        timeout_s=TIMEOUTS["eager"],
        sampling=PAIR_SAMPLING,
        logprobs=2,
    )
    mode = {"enforce_eager": True} if PD_EAGER else {"compilation_config": GRAPH_COMPILATION_CONFIG}
    jobs.submit(
        "pair_spec",
        run_llm,
        "pair_spec",
        {**pair_llm, **mode, "speculative_config": tiny_pair.spec_config()},
        pair_waves,
        timeout_s=TIMEOUTS["eager" if PD_EAGER else "graphs"],
        sampling=PAIR_SAMPLING,
    )
    # The aggregated reference of the synchronous-scheduling PD run (issue 13: both modes).
    jobs.submit(
        "pair_spec_sync",
        run_llm,
        "pair_spec_sync",
        {
            **pair_llm,
            **mode,
            "speculative_config": tiny_pair.spec_config(),
            "async_scheduling": False,
        },
        pair_waves,
        timeout_s=TIMEOUTS["eager" if PD_EAGER else "graphs"],
        sampling=PAIR_SAMPLING,
    )

    def pd_both_modes():
        # One mode after the other: two pairs of servers at once would not fit their memory shares.
        out = {}
        for sched, flag in (("async", "--async-scheduling"), ("sync", "--no-async-scheduling")):
            out[sched] = run_pd(
                tiny_pair.TARGET,
                tiny_pair.spec_config(),
                pair_waves[-1],
                timeout_s=TIMEOUTS["pd"],
                common_args=[*common, flag],
                max_tokens=PAIR_MAX_TOKENS,
                ignore_eos=False,
            )
        return out

    jobs.submit("pd", pd_both_modes)
    yield jobs
    jobs.shutdown()
