"""PD with a PP=2 prefill-only producer over MooncakeConnector, on one GPU (issue 25, part 2).

Three launchers on GPU 0 by default (dspark_dev/pp_launch.py; ``DSPARK_GPU_PP_LAYOUT=
per-stage`` puts producer stage R on GPU R and the decoder on GPU 2): the producer is ``vllm
serve -pp 2 --nnodes 2`` (node 0 with the API server and Mooncake's bootstrap, node 1 headless),
both stages ``kv_producer`` with the DSpark speculative config, so the plugin's prefill-only role
builds the context-KV-only drafter where the drafter lives (the last stage); the decoder is a
PP=1 ``kv_consumer`` with the same DSpark config. Our proxy sends each request to the producer
(one token), then to the decoder, which pulls the prompt's KV from every producer stage (vLLM's
Mooncake worker selects all remote PP ranks when its own PP size differs:
mooncake_connector.py ``_select_remote_workers``). Model: the trained tiny pair, 7 held-out
prompts at once, async scheduling (the GPU default), CUDA graphs.

Checked: every request went producer -> decoder; the producer built the context-KV-only drafter
and drafted nothing; the decoder's prompt KV came over Mooncake without failures; greedy output
equals PP=1 without speculation and PP=1 aggregated DSpark; the decoder's drafts, acceptance and
per-position counters equal aggregated DSpark's within 2 points (printed as the ``PD acceptance:``
line of docs/results/gpu.md); and the control: the same deployment whose producer drafts with a
NaN-norm copy of the draft (tests/support/draft_controls.py) drops the decoder's acceptance while
its greedy output stays equal. No launcher reaches the GPU kit's stubbed NCCL functions.

    source /tmp/site/env.sh && bash tools/gpu/run_groups.sh $OUT pd_pp
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile

import pytest
from gpu_common import (
    GRAPH_COMPILATION_CONFIG,
    PAIR_DTYPE,
    PAIR_MAX_TOKENS,
    PAIR_SAMPLING,
    Jobs,
    pair_prompts,
    require_cuda,
)
from support import tiny_pair

from dspark_dev import pp_launch
from dspark_dev.parity import acceptance_rate, compare_tokens, counters_close
from dspark_dev.serve import free_port

pytestmark = pytest.mark.gpu  # the time limit: run_groups.sh --timeout (its budget)

READY_S = float(os.environ.get("DSPARK_GPU_PD_PP_READY_S", "420"))
ONLY = frozenset(j for j in os.environ.get("DSPARK_GPU_PD_PP_JOBS", "").split(",") if j) or None
COMMON = [
    "--dtype", PAIR_DTYPE, "--max-model-len", "512", "--max-num-seqs", "8", "--seed", "0",
    "--gpu-memory-utilization", "0.05", "--kv-cache-memory-bytes", str(512 << 20),
    "--compilation-config", json.dumps(GRAPH_COMPILATION_CONFIG), "--async-scheduling",
]  # fmt: skip


def _pd_with_pp2_producer(prompts, guard, prefill_spec=None):
    from support.pd_run import run_pd

    gpu_layout = pp_launch.layout()
    nccl = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", **guard.env()}
    master = free_port()

    def node(rank):
        args = ["-pp", "2", "--nnodes", "2", "--node-rank", str(rank),
                "--master-addr", "127.0.0.1", "--master-port", str(master)]  # fmt: skip
        env = {**pp_launch.stage_env(rank, device="gpu", gpu_layout=gpu_layout, tag="pd"), **nccl}
        return (args + (["--headless"] if rank else []), env)

    args0, env0 = node(0)
    decoder_env = pp_launch.stage_env(2, device="gpu", gpu_layout=gpu_layout, tag="pd")
    return run_pd(
        tiny_pair.TARGET,
        tiny_pair.spec_config(),
        prompts,
        timeout_s=READY_S,
        common_args=COMMON,
        prefill_args=args0,
        prefill_env=env0,
        prefill_followers=[node(1)],
        prefill_speculative_config=prefill_spec,
        decode_env=decoder_env,
        max_tokens=PAIR_MAX_TOKENS,
        ignore_eos=False,
    )


@pytest.fixture(scope="module")
def pd_jobs(tmp_path_factory):
    require_cuda()
    ok, why = tiny_pair.available()
    if not ok:
        pytest.skip(why)
    from support.draft_controls import nan_norm_draft
    from support.gpu import run_llm

    from dspark_dev.multi_gpu import NcclStubGuard

    guard = NcclStubGuard(tmp_path_factory.mktemp("nccl-guard")).build()
    prompts = pair_prompts()
    bad_draft = nan_norm_draft(tiny_pair.DRAFT, tempfile.mkdtemp(prefix="dspark-pd-pp-control-"))
    bad_spec = {**tiny_pair.spec_config(), "model": bad_draft}
    jobs = Jobs(only=ONLY, knob="DSPARK_GPU_PD_PP_JOBS")
    pair = {"model": tiny_pair.TARGET, "dtype": PAIR_DTYPE, "gpu_memory_utilization": 0.05}
    jobs.submit(
        "pair_baseline", run_llm, "pdpp_baseline", {**pair, "enforce_eager": True}, [prompts],
        timeout_s=READY_S, sampling=PAIR_SAMPLING, logprobs=2,
    )  # fmt: skip
    jobs.submit(
        "pair_spec", run_llm, "pdpp_spec",
        {**pair, "compilation_config": GRAPH_COMPILATION_CONFIG, "async_scheduling": True,
         "speculative_config": tiny_pair.spec_config()},
        [prompts], timeout_s=READY_S, sampling=PAIR_SAMPLING,
    )  # fmt: skip
    jobs.submit("pd_pp2", _pd_with_pp2_producer, prompts, guard)
    jobs.submit("pd_pp2_control", _pd_with_pp2_producer, prompts, guard, bad_spec)
    yield jobs, guard
    jobs.shutdown()


def _pd(pd_jobs, name="pd_pp2"):
    jobs, _ = pd_jobs
    return jobs.result(name, timeout=1200)


def test_every_request_went_through_the_pp2_producer_then_the_decoder(pd_jobs):
    r = _pd(pd_jobs)
    st = r["proxy"]
    print(f"proxy {st}; timings {r['timings']}")
    assert not st["errors"], st["errors"]
    assert st["requests"] == st["prefill_ok"] == st["decode_ok"] == len(r["tokens"]), st


def test_pp2_producer_is_context_kv_only_and_both_stages_ran(pd_jobs):
    r = _pd(pd_jobs)
    print(f"producer log markers: {r['prefill_log_markers']}")
    assert all(r["prefill_log_markers"].values()), r["prefill_log_markers"]
    assert r["prefill_spec"]["num_draft_tokens"] == 0, r["prefill_spec"]
    logs = r["producer_logs"]
    assert len(logs) == 2, list(logs)
    joined = "\n".join(logs.values())
    assert "PP handshake: 2 ranks agree" in joined
    backends = [x for log in logs.values() for x in log.split("DSpark PP exchange:")[1:2]]
    assert len(backends) == 2 and all(" over nccl" in b.splitlines()[0] for b in backends), backends


def test_decoder_pulled_the_prompt_kv_over_mooncake(pd_jobs):
    kv = _pd(pd_jobs)["decoder_kv"]
    print(f"decoder KV counters (delta): {kv}")
    assert kv.get("vllm:external_prefix_cache_hits_total", 0) > 0, kv
    failed = kv.get("vllm:mooncake_num_failed_transfers_total", 0) + kv.get(
        "vllm:mooncake_num_failed_recvs_total", 0
    )
    assert failed == 0, kv


def test_pd_greedy_equals_aggregated_and_no_speculation(pd_jobs):
    jobs, _ = pd_jobs
    base, agg = jobs.result("pair_baseline"), jobs.result("pair_spec")
    got = _pd(pd_jobs)["tokens"]
    rep = compare_tokens(base.tokens, got, base.logprobs)
    rep2 = compare_tokens(agg.tokens, got, base.logprobs)
    print(f"PD (PP=2 producer) vs no-spec: {rep.describe()}\nvs aggregated: {rep2.describe()}")
    assert rep.ok and rep2.ok, (rep.describe(), rep2.describe())


def test_pd_acceptance_equals_aggregated(pd_jobs):
    jobs, _ = pd_jobs
    agg = jobs.result("pair_spec").metrics()
    dec = _pd(pd_jobs)["decoder_spec"]
    ok, desc = counters_close(dec, agg)
    print(
        f"PD acceptance: decoder {acceptance_rate(dec):.1f}% "
        f"({dec['num_accepted_tokens']}/{dec['num_draft_tokens']}) vs aggregated "
        f"{acceptance_rate(agg):.1f}% ({agg['num_accepted_tokens']}/{agg['num_draft_tokens']}), "
        f"producer PP=2, async scheduling, {datetime.date.today().isoformat()}"
    )
    print(desc)
    assert agg["num_drafts"] and 1 + agg["num_accepted_tokens"] / agg["num_drafts"] >= 3.0, agg
    assert ok, desc


def test_corrupted_producer_draft_drops_the_decoder_acceptance(pd_jobs):
    jobs, _ = pd_jobs
    good, bad = _pd(pd_jobs), _pd(pd_jobs, "pd_pp2_control")
    g, b = good["decoder_spec"], bad["decoder_spec"]
    print(f"control: good {acceptance_rate(g):.1f}% {g} vs NaN-norm producer draft "
          f"{acceptance_rate(b):.1f}% {b}")  # fmt: skip
    assert b["num_draft_tokens"] > 0, b
    assert acceptance_rate(b) < acceptance_rate(g) - 2.0, (g, b)
    base = jobs.result("pair_baseline")
    rep = compare_tokens(base.tokens, bad["tokens"], base.logprobs)
    assert rep.ok, f"the corrupted draft changed the output: {rep.describe()}"


def test_no_pd_launcher_reaches_the_kit_nccl_stubs(pd_jobs):
    jobs, guard = pd_jobs
    for name in ("pd_pp2", "pd_pp2_control"):
        try:
            jobs.result(name, timeout=1200)
        except BaseException:  # noqa: BLE001 - reported by their own tests
            pass
    assert guard.so is not None, f"the recording NCCL stub was not built: {guard.problem}"
    assert not guard.calls(), guard.calls()
