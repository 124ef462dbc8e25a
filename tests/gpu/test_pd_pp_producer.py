"""PD with a PP=2 prefill-only producer over MooncakeConnector, on one GPU (issue 25, part 2;
issue 26 "also at PP=2" for the trained DeepSeek-V4 and Kimi-K3 pairs).

Three launchers on GPU 0 by default (dspark_dev/pp_launch.py; ``DSPARK_GPU_PP_LAYOUT=
per-stage`` puts producer stage R on GPU R and the decoder on GPU 2): the producer is ``vllm
serve -pp 2 --nnodes 2`` (node 0 with the API server and Mooncake's bootstrap, node 1 headless),
both stages ``kv_producer`` with the DSpark speculative config, so the plugin's prefill-only role
builds the context-KV-only drafter where the drafter lives (the last stage); the decoder is a
PP=1 ``kv_consumer`` with the same DSpark config. Our proxy sends each request to the producer
(one token), then to the decoder, which pulls the prompt's KV from every producer stage (vLLM's
Mooncake worker selects all remote PP ranks when its own PP size differs:
mooncake_connector.py ``_select_remote_workers``).

The pair, one knob: ``DSPARK_GPU_PD_PP_PAIR`` (``tiny``, the default; ``dsv4``; ``k3``).

* ``tiny``: the trained Qwen3 tiny pair (models/tiny-pair), 7 held-out prompts at once, async
  scheduling (the GPU default), CUDA graphs, ``PAIR_DTYPE``; the engines of issue 25's run.
* ``dsv4`` / ``k3``: the trained tiny DeepSeek-V4 or Kimi-K3 pair (``support.mla_pairs``:
  models/dsv4-pair, models/k3-pair; not bundled: every test skips with that reason, and a skip is
  not a pass), bf16, k = ``mla_pairs.TRAINED_K`` (7), the 7-prompt held-out wave that
  tests/gpu/test_dsv4_k3_engine.py's PD jobs send, stopping at EOS (at most 64 tokens), and that
  module's trained-mode engine settings (max model length 256, 256 MiB of KV per engine, memory
  share 0.06, CUDA graphs; ``DSPARK_DSV4K3_PD_EAGER=1`` makes the PD servers eager as there).
  DeepSeek-V4's transfer block size is the plugin's Mooncake patch's business (its compressed
  layers' groups; vllm_dspark_pp/patches/distributed_kv_transfer_kv_connector_v1_mooncake_
  mooncake_connector.py), applied on every launcher as at PP=1: nothing to pass here.
  For ``k3`` the producer's two launchers run eager with ``CUDA_LAUNCH_BLOCKING=1``: vLLM 0.34.0's
  Kimi-K3 path races at PP > 1 with or without the plugin (docs/results/gpu.md, "Kimi-K3 PP=2: a
  race, and stock vLLM has it too"; only synchronous kernels served it correctly), so this is the
  one K3 PP=2 setting known to serve; the PP=1 decoder keeps CUDA graphs.

Checked, for every pair: every request went producer -> decoder; the producer built the
context-KV-only drafter and drafted nothing, both stages ran (the PP handshake, the exchange
``over nccl``); the decoder's prompt KV came over Mooncake without failures; greedy output equals
PP=1 without speculation and PP=1 aggregated DSpark (the bf16 near-tie rule of
dspark_dev/parity.py against the no-spec run's top-2 logprobs); the decoder's drafts, acceptance
and per-position counters equal aggregated DSpark's within 2 points (printed as the ``PD
acceptance:`` line of docs/results/gpu.md), the aggregated run accepting like a trained pair
(mean acceptance length >= 3.0; for ``dsv4`` / ``k3`` also
``mla_pairs.trained_acceptance_problems`` == []: an accepted token at every draft position); and
the control: the same deployment whose producer drafts with a NaN-norm copy of the draft
(tests/support/draft_controls.py) drops the decoder's acceptance by more than 2 points (for
``dsv4`` / ``k3`` also to at most 2 %, test_dsv4_k3_engine.py's trained rule) while its greedy
output stays equal. For ``dsv4`` / ``k3`` also the subtle control (job ``pd_pp2_subtle``,
as in test_dsv4_k3_engine.py): the producer's draft reads its first and last aux taps exchanged
(``draft_controls.aux_perturbed_draft``, ``SUBTLE_PERTURB``: a finite, somewhat wrong prompt
context KV), the decoder keeps the real draft: greedy output unchanged and acceptance at least
``SUBTLE_MARGIN_POINTS`` (5) below the PD run's. No launcher reaches the GPU kit's stubbed NCCL
functions.

    source /tmp/site/env.sh && bash tools/gpu/run_groups.sh $OUT pd_pp            # tiny
    source /tmp/site/env.sh && bash tools/gpu/run_groups.sh $OUT pd_pp_dsv4 pd_pp_k3

On CPU the wiring runs with fake engines (tests/support/gpu_fake_engines.py):
``DSPARK_FAKE_MODELS=$PWD/models DSPARK_GPU_PD_PP_PAIR=k3 PYTHONPATH=$PWD:$PWD/tests:$PWD/tests/gpu
python -m pytest -p support.gpu_fake_engines tests/gpu/test_pd_pp_producer.py``.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from dataclasses import dataclass, field

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
from support import mla_pairs, tiny_pair
from support.draft_controls import SUBTLE_PERTURB

from dspark_dev import pp_launch
from dspark_dev.parity import acceptance_rate, compare_tokens, counters_close
from dspark_dev.serve import free_port

pytestmark = pytest.mark.gpu  # the time limit: run_groups.sh --timeout (its budget)

PAIRS = ("tiny", "dsv4", "k3")
PAIR = os.environ.get("DSPARK_GPU_PD_PP_PAIR", "tiny").strip() or "tiny"
if PAIR not in PAIRS:
    raise ValueError(f"DSPARK_GPU_PD_PP_PAIR={PAIR!r}: use one of {', '.join(PAIRS)}")
MLA = PAIR != "tiny"  # a trained DeepSeek-V4 / Kimi-K3 pair
READY_S = float(os.environ.get("DSPARK_GPU_PD_PP_READY_S", "420"))
ONLY = frozenset(j for j in os.environ.get("DSPARK_GPU_PD_PP_JOBS", "").split(",") if j) or None
COMMON = [
    "--dtype", PAIR_DTYPE, "--max-model-len", "512", "--max-num-seqs", "8", "--seed", "0",
    "--gpu-memory-utilization", "0.05", "--kv-cache-memory-bytes", str(512 << 20),
    "--compilation-config", json.dumps(GRAPH_COMPILATION_CONFIG), "--async-scheduling",
]  # fmt: skip

# dsv4 / k3: the trained-mode settings of tests/gpu/test_dsv4_k3_engine.py (``LLM_BASE`` for the
# references, ``common`` for its PD servers, ``MAX_TOKENS``, ``DSPARK_DSV4K3_PD_EAGER``)
MLA_K = mla_pairs.TRAINED_K
MLA_SAMPLING = {"max_tokens": 64, "ignore_eos": False}  # held-out answers stop at EOS before
MLA_LLM = {"max_model_len": 256, "gpu_memory_utilization": 0.06, "kv_cache_memory_bytes": 256 << 20}
MLA_COMMON = [
    "--dtype", "bfloat16", "--max-model-len", "256", "--max-num-seqs", "8", "--seed", "0",
    "--gpu-memory-utilization", "0.06", "--kv-cache-memory-bytes", str(256 << 20),
]  # fmt: skip
MLA_PD_MODE = (
    ["--enforce-eager"]
    if os.environ.get("DSPARK_DSV4K3_PD_EAGER", "") == "1"
    else ["--compilation-config", json.dumps(GRAPH_COMPILATION_CONFIG)]
)
# Kimi-K3's producer launchers only (module docstring): vLLM 0.34.0's Kimi-K3 path races at PP > 1
# (PP rank 0 reads out-of-range token ids, stock vLLM too); eager with every kernel synchronous is
# the one setting that served K3 PP=2 correctly (test_dsv4_k3_pp.py's ``blocking`` diagnosis).
# Not a fix: another session diagnoses the race. The PP=1 decoder does not race and keeps graphs.
K3_PRODUCER_ARGS = ["--enforce-eager"]
K3_PRODUCER_ENV = {"CUDA_LAUNCH_BLOCKING": "1"}
#: dsv4 / k3: the NaN-norm control's acceptance ceiling (test_dsv4_k3_engine.py's trained rule)
NAN_CONTROL_MAX_PCT = 2.0
#: dsv4 / k3: how far below the PD run the subtle control must fall (test_dsv4_k3_engine.py's rule)
SUBTLE_MARGIN_POINTS = 5.0
PD_JOBS = ("pd_pp2", "pd_pp2_control", "pd_pp2_subtle")


def _label() -> str:
    """The ``PD acceptance:`` line's setting (issue 25's tiny line unchanged)."""
    if not MLA:
        return "async scheduling"
    extra = ", producer eager + CUDA_LAUNCH_BLOCKING=1" if PAIR == "k3" else ""
    return f"{PAIR}, trained bf16, k={MLA_K}{extra}"


@dataclass
class Setup:
    """One pair's engines: what every job of the module starts (``_setup``)."""

    target: str
    draft: str
    spec: dict
    prompts: list[list[int]]
    llm: dict  # the references' engine arguments (model, dtype, memory)
    spec_llm: dict  # on top of ``llm``: the aggregated DSpark reference's
    sampling: dict
    max_tokens: int
    common: list[str]  # every PD server's arguments
    producer_args: list[str] = field(default_factory=list)  # each producer launcher's, on top
    producer_env: dict = field(default_factory=dict)
    decoder_args: list[str] = field(default_factory=list)
    name: str = "pdpp"  # the reference engines' name prefix (their logs)


def _setup() -> Setup:
    if not MLA:
        ok, why = tiny_pair.available()
        if not ok:
            pytest.skip(why)
        spec = tiny_pair.spec_config()
        return Setup(
            target=tiny_pair.TARGET,
            draft=tiny_pair.DRAFT,
            spec=spec,
            prompts=pair_prompts(),
            llm={"model": tiny_pair.TARGET, "dtype": PAIR_DTYPE, "gpu_memory_utilization": 0.05},
            spec_llm={
                "compilation_config": GRAPH_COMPILATION_CONFIG,
                "async_scheduling": True,
                "speculative_config": spec,
            },
            sampling=PAIR_SAMPLING,
            max_tokens=PAIR_MAX_TOKENS,
            common=COMMON,
        )
    pair, why = mla_pairs.trained_pair(PAIR)
    if pair is None:
        pytest.skip(why)
    trained_k = mla_pairs.block_size(pair, PAIR)
    if trained_k != MLA_K:
        pytest.fail(f"the bundled {PAIR} pair was trained for block {trained_k}, not {MLA_K}")
    spec = pair.speculative_config(MLA_K)
    k3 = PAIR == "k3"
    return Setup(
        target=pair.target,
        draft=pair.draft,
        spec=spec,
        prompts=mla_pairs.heldout_waves(pair)[-1],  # the 7-request wave, as the PP=1 PD sends
        llm={**MLA_LLM, "model": pair.target},
        spec_llm={"speculative_config": spec, "compilation_config": GRAPH_COMPILATION_CONFIG},
        sampling=MLA_SAMPLING,
        max_tokens=MLA_SAMPLING["max_tokens"],
        # DeepSeek-V4: both sides in one mode, as at PP=1; Kimi-K3: the producer eager (above)
        common=MLA_COMMON if k3 else [*MLA_COMMON, *MLA_PD_MODE],
        producer_args=K3_PRODUCER_ARGS if k3 else [],
        producer_env=K3_PRODUCER_ENV if k3 else {},
        decoder_args=MLA_PD_MODE if k3 else [],
        name=f"pdpp_{PAIR}",
    )


def _pd_with_pp2_producer(setup: Setup, guard, prefill_spec=None):
    from support.pd_run import run_pd

    gpu_layout = pp_launch.layout()
    nccl = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", **guard.env()}
    master = free_port()

    def node(rank):
        args = ["-pp", "2", "--nnodes", "2", "--node-rank", str(rank),
                "--master-addr", "127.0.0.1", "--master-port", str(master),
                *setup.producer_args]  # fmt: skip
        env = {
            **pp_launch.stage_env(rank, device="gpu", gpu_layout=gpu_layout, tag="pd"),
            **nccl,
            **setup.producer_env,
        }
        return (args + (["--headless"] if rank else []), env)

    args0, env0 = node(0)
    decoder_env = pp_launch.stage_env(2, device="gpu", gpu_layout=gpu_layout, tag="pd")
    # decode_args only when there are any: the tiny pair's call stays what it was
    decoder = {"decode_args": list(setup.decoder_args)} if setup.decoder_args else {}
    return run_pd(
        setup.target,
        setup.spec,
        setup.prompts,
        timeout_s=READY_S,
        common_args=setup.common,
        prefill_args=args0,
        prefill_env=env0,
        prefill_followers=[node(1)],
        prefill_speculative_config=prefill_spec,
        decode_env=decoder_env,
        max_tokens=setup.max_tokens,
        ignore_eos=False,
        **decoder,
    )


@pytest.fixture(scope="module")
def pd_jobs(tmp_path_factory):
    require_cuda()
    setup = _setup()
    from support.draft_controls import nan_norm_draft
    from support.gpu import run_llm

    from dspark_dev.multi_gpu import NcclStubGuard

    guard = NcclStubGuard(tmp_path_factory.mktemp("nccl-guard")).build()
    bad_draft = nan_norm_draft(setup.draft, tempfile.mkdtemp(prefix="dspark-pd-pp-control-"))
    bad_spec = {**setup.spec, "model": bad_draft}
    jobs = Jobs(only=ONLY, knob="DSPARK_GPU_PD_PP_JOBS")
    jobs.submit(
        "pair_baseline", run_llm, f"{setup.name}_baseline", {**setup.llm, "enforce_eager": True},
        [setup.prompts], timeout_s=READY_S, sampling=setup.sampling, logprobs=2,
    )  # fmt: skip
    jobs.submit(
        "pair_spec", run_llm, f"{setup.name}_spec", {**setup.llm, **setup.spec_llm},
        [setup.prompts], timeout_s=READY_S, sampling=setup.sampling,
    )  # fmt: skip
    jobs.submit("pd_pp2", _pd_with_pp2_producer, setup, guard)
    jobs.submit("pd_pp2_control", _pd_with_pp2_producer, setup, guard, bad_spec)
    if MLA:  # the subtle control: the producer's draft reads its aux taps misordered
        from support.draft_controls import aux_perturbed_draft

        subtle = aux_perturbed_draft(setup.draft, str(tmp_path_factory.mktemp("pd-pp-subtle")))
        subtle_spec = {**setup.spec, "model": subtle}
        jobs.submit("pd_pp2_subtle", _pd_with_pp2_producer, setup, guard, subtle_spec)
    else:
        jobs.skip(
            "pd_pp2_subtle",
            "the subtle control is issue 26's, for the trained DeepSeek-V4 / Kimi-K3 pairs "
            "(DSPARK_GPU_PD_PP_PAIR=dsv4 or k3)",
        )
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
        f"producer PP=2, {_label()}, {datetime.date.today().isoformat()}"
    )
    print(desc)
    assert agg["num_drafts"] and 1 + agg["num_accepted_tokens"] / agg["num_drafts"] >= 3.0, agg
    if MLA:  # the 2-point rule compares real acceptance: every draft position accepted
        problems = mla_pairs.trained_acceptance_problems(agg, MLA_K)
        print(
            f"[{PAIR}] aggregated acceptance length {mla_pairs.acceptance_length(agg):.3f}, "
            f"decoder {mla_pairs.acceptance_length(dec):.3f}; per position "
            f"{agg.get('accepted_per_pos')} vs {dec.get('accepted_per_pos')}"
        )
        assert not problems, f"[{PAIR}] aggregated DSpark: {'; '.join(problems)} ({agg})"
    assert ok, desc


def test_corrupted_producer_draft_drops_the_decoder_acceptance(pd_jobs):
    jobs, _ = pd_jobs
    good, bad = _pd(pd_jobs), _pd(pd_jobs, "pd_pp2_control")
    g, b = good["decoder_spec"], bad["decoder_spec"]
    print(f"control: good {acceptance_rate(g):.1f}% {g} vs NaN-norm producer draft "
          f"{acceptance_rate(b):.1f}% {b}")  # fmt: skip
    assert b["num_draft_tokens"] > 0, b
    assert acceptance_rate(b) < acceptance_rate(g) - 2.0, (g, b)
    if MLA:  # test_dsv4_k3_engine.py's trained rule: a NaN context drafts garbage (~0 %)
        assert acceptance_rate(b) <= NAN_CONTROL_MAX_PCT, (
            f"[{PAIR}] a NaN draft context KV still accepted {acceptance_rate(b):.2f}% "
            f"(> {NAN_CONTROL_MAX_PCT}%): {b}"
        )
    base = jobs.result("pair_baseline")
    rep = compare_tokens(base.tokens, bad["tokens"], base.logprobs)
    assert rep.ok, f"the corrupted draft changed the output: {rep.describe()}"


def test_subtly_wrong_producer_draft_drops_the_decoder_acceptance(pd_jobs):
    """dsv4 / k3: the producer's draft reads its first and last aux taps exchanged (a finite,
    somewhat wrong prompt context KV), the decoder keeps the real draft: greedy output unchanged,
    acceptance at least ``SUBTLE_MARGIN_POINTS`` below the PD run's (test_dsv4_k3_engine.py's
    subtle control, with the PP=2 producer)."""
    jobs, _ = pd_jobs
    bad = _pd(pd_jobs, "pd_pp2_subtle")  # skips at once for the tiny pair
    good = _pd(pd_jobs)
    g, b = good["decoder_spec"], bad["decoder_spec"]
    gp, bp = acceptance_rate(g), acceptance_rate(b)
    print(
        f"subtle control ({PAIR}, PP=2 producer): decoder {bp:.1f}% vs PD {gp:.1f}%, drop "
        f"{gp - bp:.2f} points (need {SUBTLE_MARGIN_POINTS}); producer draft's aux taps "
        f"{SUBTLE_PERTURB}; {g} vs {b}"
    )
    assert b["num_draft_tokens"] > 0, b
    base = jobs.result("pair_baseline")
    rep = compare_tokens(base.tokens, bad["tokens"], base.logprobs)
    assert rep.ok, f"a subtly wrong producer draft changed the output: {rep.describe()}"
    assert bp <= gp - SUBTLE_MARGIN_POINTS, (
        f"[{PAIR}] the decoder drafted about as well from a subtly wrong prompt draft context KV "
        f"({bp:.2f}%) as from the real one ({gp:.2f}%; need a drop of {SUBTLE_MARGIN_POINTS} "
        "points): it does not read the pulled draft KV pages, or the control is too weak"
    )


def test_no_pd_launcher_reaches_the_kit_nccl_stubs(pd_jobs):
    jobs, guard = pd_jobs
    for name in PD_JOBS:
        try:
            jobs.result(name, timeout=1200)
        except BaseException:  # noqa: BLE001 - reported by their own tests (or skipped)
            pass
    assert guard.so is not None, f"the recording NCCL stub was not built: {guard.problem}"
    assert not guard.calls(), guard.calls()
