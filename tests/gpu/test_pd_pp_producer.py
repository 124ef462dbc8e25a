"""PD with a PP=2 prefill-only producer over MooncakeConnector, on one GPU (issue 25, part 2;
issue 26 "also at PP=2" for the trained DeepSeek-V4 and Kimi-K3 pairs; issue 42 for the trained
DeepSeek-V4.1 pair, with a PP=1 producer too).

Three launchers on GPU 0 by default (dspark_dev/pp_launch.py; ``DSPARK_GPU_PP_LAYOUT=
per-stage`` puts producer stage R on GPU R and the decoder on GPU 2): the producer is ``vllm
serve -pp 2 --nnodes 2`` (node 0 with the API server and Mooncake's bootstrap, node 1 headless),
both stages ``kv_producer`` with the DSpark speculative config, so the plugin's prefill-only role
builds the context-KV-only drafter where the drafter lives (the last stage); the decoder is a
PP=1 ``kv_consumer`` with the same DSpark config. Our proxy sends each request to the producer
(one token), then to the decoder, which pulls the prompt's KV from every producer stage (vLLM's
Mooncake worker selects all remote PP ranks when its own PP size differs:
mooncake_connector.py ``_select_remote_workers``).

The pair, one knob: ``DSPARK_GPU_PD_PP_PAIR`` (``tiny``, the default; ``dsv4``; ``k3``;
``dsv41``).

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
  ``k3`` runs with the same settings as ``dsv4`` (CUDA graphs on both sides): until 2026-12-05
  its producer ran eager with ``CUDA_LAUNCH_BLOCKING=1`` around vLLM 0.34.0's Kimi-K3 failure at
  PP > 1, which the plugin's worker-stream pin fixed (docs/k3-pp-race.md; the trained pair at PP=2
  with graphs: docs/results/k3_pp_trained_gpu.json). ``DSPARK_GPU_PD_K3_BLOCKING=1`` brings the
  old producer settings back.
* ``dsv41``: the trained tiny DeepSeek-V4.1 pair (models/dsv41-pair/dsv41, issue 42), with
  ``dsv4``'s settings (both sides CUDA graphs; the V4.1 family's context-KV-only drafter on the
  producer's last stage, vllm_dspark_pp/producer/deepseek_v41.py). vLLM has no CPU
  implementation of V4.1, so this is its first PD run. Its group also runs ``pd_pp1``: the same
  PD with a PP=1 producer (one launcher), the checks of the PP=2 job but the stage lines
  (the PP=1 PD of the other pairs is test_dsv4_k3_engine.py's and test_pd_mooncake_gpu.py's).
  The subtle control's strength was estimated on CPU for the K3 and V4 pairs only
  (``draft_controls.SUBTLE_PERTURB``); for V4.1 the GPU run is its first reading.

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
functions. A JSON record of these jobs, ``pd_pp.json`` (commit, source fingerprint, date, GPU,
command, shapes, the references' and every PD job's counters per position, KV and producer
evidence, each check's verdict with its ``PD acceptance:`` line and the controls', set before the
test asserts), goes to ``$DSPARK_GPU_PD_PP_OUT`` (run_groups.sh: ``OUTDIR/<group>/pd_pp.json``),
else ``$DSPARK_GPU_ARTIFACTS``, else a new temporary folder, whenever a PP=2 or PP=1 producer job
ran.

Jobs (``DSPARK_GPU_PD_PP_JOBS=a,b`` selects, ``all`` runs every one; empty: group pd_pp's
``pair_baseline``, ``pair_spec``, ``pd_pp2``, ``pd_pp2_control``, ``pd_pp2_subtle``, and for
``dsv41`` also ``pd_pp1``). Opt-in, any pair: ``pd_pp2_sync``, ``pd_pp2`` with synchronous
scheduling on every PD launcher (``--no-async-scheduling``; issue 40 item 6), checked as
``pd_pp2`` (every request through both sides, the producer drafting nothing on two stages over
nccl, the prompt KV over Mooncake, greedy and the ``PD acceptance:`` line against the async
references). Opt-in, the
tiny pair only, issue 40 item 2 (group ``pd_tp_pp``): PD with a TP=2 x PP=2 producer, four
launchers ``-tp 2 -pp 2 --nnodes 4`` (one rank each, launcher R = global rank R, each its own
``NCCL_HOSTID`` on GPU 0 and ``--disable-custom-all-reduce``, as tests/gpu/test_tp_pp_one_gpu.py),
into a DSpark decoder at TP=2 (two launchers ``-tp 2 --nnodes 2``, the second headless: one
launcher with two ranks on one GPU fails in NCCL, "Duplicate GPU") or TP=1 (vLLM 0.34.0's Mooncake
connector re-shards KV heads when the TP sizes divide each other: docs/producer.md, "Heterogeneous
TP and PP"): ``pd_tp2pp2_tp2``, ``pd_tp2pp2_tp1``, and at TP=2 the NaN-norm control
``pd_tp2pp2_tp2_control`` and the subtle control ``pd_tp2pp2_tp2_subtle`` (the tiny draft's ``fc``
aux blocks exchanged). Checks per PD job: every request through both sides, no failed transfer,
every prompt's KV pulled (the decoder computed at most one prompt token per request itself); vLLM's
rank line of each producer launcher, the context-KV-only drafter built on both TP ranks of the last
stage and not on stage 0, the exchange ``over nccl`` on all four; greedy equal to no-spec and to
aggregated PP=1 DSpark (near-tie rule); the ``PD acceptance:`` line with the shapes
(``producer TP2xPP2 -> decoder TP2``) within 2 points of aggregated; the controls against the TP=2
PD run when it ran, else against aggregated. That every shard of every stage arrived is shown end
to end: a missing target shard changes the greedy tokens, a missing draft shard the acceptance
(the NaN-norm control shows the acceptance check sees a broken draft context). A JSON record
(commit from ``DSPARK_GPU_COMMIT``, date, GPU, command, shapes, per-job counters and evidence,
per-check verdicts) goes to ``$DSPARK_GPU_PD_TP_PP_OUT/pd_tp_pp.json`` (else
``$DSPARK_GPU_ARTIFACTS``).

    source /tmp/site/env.sh && bash tools/gpu/run_groups.sh $OUT pd_pp            # tiny
    source /tmp/site/env.sh && bash tools/gpu/run_groups.sh $OUT pd_pp_dsv4 pd_pp_k3
    source /tmp/site/env.sh && bash tools/gpu/run_groups.sh $OUT pd_pp_dsv41
    source /tmp/site/env.sh && DSPARK_GPU_COMMIT=<sha> bash tools/gpu/run_groups.sh $OUT pd_tp_pp

On CPU the wiring runs with fake engines (tests/support/gpu_fake_engines.py):
``DSPARK_FAKE_MODELS=$PWD/models DSPARK_GPU_PD_PP_PAIR=k3 PYTHONPATH=$PWD:$PWD/tests:$PWD/tests/gpu
python -m pytest -p support.gpu_fake_engines tests/gpu/test_pd_pp_producer.py``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from gpu_common import (
    GRAPH_COMPILATION_CONFIG,
    PAIR_DTYPE,
    PAIR_MAX_TOKENS,
    PAIR_SAMPLING,
    GpuRecord,
    Jobs,
    job_summary,
    pair_prompts,
    require_cuda,
    select_jobs,
)
from support import mla_pairs, tiny_pair
from support.draft_controls import SUBTLE_PERTURB

from dspark_dev import pp_launch
from dspark_dev.parity import acceptance_rate, compare_tokens, counters_close
from dspark_dev.pd_launch import shape_label
from vllm_dspark_pp.producer.load import BUILT_LINE

pytestmark = pytest.mark.gpu  # the time limit: run_groups.sh --timeout (its budget)

REPO = Path(__file__).resolve().parents[2]

PAIRS = ("tiny", "dsv4", "k3", "dsv41")
PAIR = os.environ.get("DSPARK_GPU_PD_PP_PAIR", "tiny").strip() or "tiny"
if PAIR not in PAIRS:
    raise ValueError(f"DSPARK_GPU_PD_PP_PAIR={PAIR!r}: use one of {', '.join(PAIRS)}")
MLA = PAIR != "tiny"  # a trained DeepSeek-V4 / Kimi-K3 / DeepSeek-V4.1 pair
READY_S = float(os.environ.get("DSPARK_GPU_PD_PP_READY_S", "420"))
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
# Kimi-K3's producer launchers (module docstring): as dsv4's since the stream pin; the old
# eager + synchronous-kernel producer only with DSPARK_GPU_PD_K3_BLOCKING=1
K3_BLOCKING = os.environ.get("DSPARK_GPU_PD_K3_BLOCKING", "") == "1"
K3_PRODUCER_ARGS = ["--enforce-eager"] if K3_BLOCKING else []
K3_PRODUCER_ENV = {"CUDA_LAUNCH_BLOCKING": "1"} if K3_BLOCKING else {}
#: dsv4 / k3: the NaN-norm control's acceptance ceiling (test_dsv4_k3_engine.py's trained rule)
NAN_CONTROL_MAX_PCT = 2.0
#: dsv4 / k3: how far below the PD run the subtle control must fall (test_dsv4_k3_engine.py's rule)
SUBTLE_MARGIN_POINTS = 5.0
PP_JOBS = ("pd_pp2", "pd_pp2_control", "pd_pp2_subtle")
#: PD with a PP=1 producer (one launcher): a default job of the dsv41 pair only (issue 42)
PP1_JOB = "pd_pp1"
#: issue 40 item 6, opt-in: ``pd_pp2`` with synchronous scheduling on every PD launcher
#: (``--no-async-scheduling`` in place of the tiny pair's ``--async-scheduling``)
SYNC_JOB = "pd_pp2_sync"
#: issue 40 item 2, opt-in (the tiny pair only): PD with a TP=2 x PP=2 producer, one launcher per
#: rank. name: (producer TP, producer PP, decoder TP, what the producer drafts with: the real
#: draft, the NaN-norm control's or the subtle control's)
TP_JOBS = {
    "pd_tp2pp2_tp2": (2, 2, 2, "real"),
    "pd_tp2pp2_tp1": (2, 2, 1, "real"),
    "pd_tp2pp2_tp2_control": (2, 2, 2, "nan"),
    "pd_tp2pp2_tp2_subtle": (2, 2, 2, "subtle"),
}
TP_GOOD = [n for n, v in TP_JOBS.items() if v[3] == "real"]
PD_JOBS = (*PP_JOBS, PP1_JOB, SYNC_JOB, *TP_JOBS)
JOBS_ENV = "DSPARK_GPU_PD_PP_JOBS"
ALL_JOBS = ("pair_baseline", "pair_spec", *PD_JOBS)
#: what an empty ``DSPARK_GPU_PD_PP_JOBS`` starts: group pd_pp's jobs (the TP x PP ones are opt-in)
DEFAULT_JOBS = ("pair_baseline", "pair_spec", *PP_JOBS, *((PP1_JOB,) if PAIR == "dsv41" else ()))


ONLY = select_jobs(os.environ.get(JOBS_ENV, ""), JOBS_ENV, ALL_JOBS, DEFAULT_JOBS)


def _label() -> str:
    """The ``PD acceptance:`` line's setting (issue 25's tiny line unchanged)."""
    if not MLA:
        return "async scheduling"
    extra = ", producer eager + CUDA_LAUNCH_BLOCKING=1" if PAIR == "k3" and K3_BLOCKING else ""
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
        llm={**MLA_LLM, **mla_pairs.engine_kwargs(PAIR), "model": pair.target},
        spec_llm={"speculative_config": spec, "compilation_config": GRAPH_COMPILATION_CONFIG},
        sampling=MLA_SAMPLING,
        max_tokens=MLA_SAMPLING["max_tokens"],
        # both sides in one mode, as at PP=1; Kimi-K3 with DSPARK_GPU_PD_K3_BLOCKING=1: the
        # producer eager, the decoder in MLA_PD_MODE
        common=[*MLA_COMMON, *mla_pairs.serve_args(PAIR)]
        + ([] if k3 and K3_BLOCKING else MLA_PD_MODE),
        producer_args=K3_PRODUCER_ARGS if k3 else [],
        producer_env=K3_PRODUCER_ENV if k3 else {},
        decoder_args=MLA_PD_MODE if k3 and K3_BLOCKING else [],
        name=f"pdpp_{PAIR}",
    )


def _sync(setup: Setup) -> Setup:
    """``setup`` with synchronous scheduling on every PD launcher (job ``pd_pp2_sync``)."""
    common = [a for a in setup.common if a != "--async-scheduling"]
    return dataclasses.replace(setup, common=[*common, "--no-async-scheduling"])


def _pd_with_pp2_producer(
    setup: Setup,
    guard,
    prefill_spec=None,
    producer_tp: int = 1,
    decoder_tp: int = 1,
    producer_pp: int = 2,
):
    """PD with a ``producer_tp`` x ``producer_pp`` producer and a ``decoder_tp`` x PP=1 decoder,
    one launcher per rank (dspark_dev/pd_launch.py ``engine_launchers``: the producer's ranks
    first, then the decoder's, each launcher its own NCCL host on GPU 0, or its own GPU
    per-stage); ``producer_pp=1`` with TP=1: one plain producer launcher (job ``pd_pp1``)."""
    from support.pd_run import run_pd

    from dspark_dev.pd_launch import engine_launchers

    gpu_layout = pp_launch.layout()
    nccl = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", **guard.env()}
    producer = [
        (args + setup.producer_args, {**env, **nccl, **setup.producer_env})
        for args, env in engine_launchers(
            tp=producer_tp, pp=producer_pp, device="gpu", gpu_layout=gpu_layout, tag="pd"
        )
    ]
    decoder = engine_launchers(
        tp=decoder_tp, pp=1, device="gpu", gpu_layout=gpu_layout, tag="pd",
        first_index=producer_tp * producer_pp,
    )  # fmt: skip
    if decoder_tp > 1:
        decoder = [(args, {**env, **nccl}) for args, env in decoder]
    (args0, env0), (dec_args, dec_env) = producer[0], decoder[0]
    # decode_args / followers only when there are any: the PP=2 jobs' call stays what it was
    dec_all = [*dec_args, *setup.decoder_args]
    extra: dict = {"decode_args": dec_all} if dec_all else {}
    if decoder[1:]:
        extra["decode_followers"] = [(a + setup.decoder_args, e) for a, e in decoder[1:]]
    return run_pd(
        setup.target,
        setup.spec,
        setup.prompts,
        timeout_s=READY_S,
        common_args=setup.common,
        prefill_args=args0,
        prefill_env=env0,
        prefill_followers=producer[1:],
        prefill_speculative_config=prefill_spec,
        decode_env=dec_env,
        max_tokens=setup.max_tokens,
        ignore_eos=False,
        **extra,
    )


# --- the JSON record of the PP=2 (and PP=1) producer jobs: pd_pp.json ---------------------------

PP_RECORD = GpuRecord("pd_pp.json")
PP_RECORD_JOBS = ("pair_baseline", "pair_spec", *PP_JOBS, PP1_JOB, SYNC_JOB)


def _pp_shape(name: str) -> dict:
    """A PD job of pd_pp.json: the producer's PP size, what it drafts with, both sides' modes."""
    ppp = 1 if name == PP1_JOB else 2
    pd_graphs = not (MLA and "--enforce-eager" in MLA_PD_MODE)
    return {
        "producer_tp": 1, "producer_pp": ppp, "decoder_tp": 1, "decoder_pp": 1,
        "label": shape_label(1, ppp, 1),
        "producer_draft": {"pd_pp2_control": "nan", "pd_pp2_subtle": "subtle"}.get(name, "real"),
        "pair": PAIR, "dtype": "bfloat16" if MLA else PAIR_DTYPE,
        "scheduling": "sync" if name == SYNC_JOB else "vLLM's default" if MLA else "async",
        "producer_cuda_graphs": pd_graphs and PAIR != "k3", "decoder_cuda_graphs": pd_graphs,
        "layout": pp_launch.layout(),
    }  # fmt: skip


def _pd_job_summary(jobs: Jobs, name: str, shape: dict | None) -> dict:
    """A PD job's part of a record (its counters per position, KV, proxy, timings, producer
    evidence) or a reference's (token count, start-up, the aggregated run's counters)."""

    def summarize(res) -> dict:
        if not isinstance(res, dict):  # an LLMResult (the references)
            out = {"num_tokens": sum(len(t) for t in res.tokens), "startup_s": res.startup_s}
            if name == "pair_spec":
                out["counters"] = res.metrics()
            return out
        keep = ("decoder_spec", "prefill_spec", "decoder_kv", "proxy", "timings",
                "prefill_log_markers", "engine_id")  # fmt: skip
        out = {k: res[k] for k in keep if k in res}
        out["num_tokens"] = sum(len(t) for t in res.get("tokens", []))
        out["producer_evidence"] = _producer_evidence(res)
        return out

    return job_summary(jobs, name, selected=name in ONLY, summarize=summarize, shape=shape)


def _write_pp_record(jobs: Jobs, setup: Setup) -> Path:
    jobs_out = {
        n: _pd_job_summary(jobs, n, _pp_shape(n) if n in PD_JOBS else None) for n in PP_RECORD_JOBS
    }
    fields = {
        "issue": 25 if PAIR == "tiny" else 42 if PAIR == "dsv41" else 26,
        "selected_jobs": sorted(ONLY),
        "pair": PAIR,
        "target": setup.target,
        "draft": setup.draft,
        "k": setup.spec.get("num_speculative_tokens"),
        "num_prompts": len(setup.prompts),
        "max_tokens": setup.max_tokens,
        "common_args": setup.common,
        "shapes": {n: _pp_shape(n) for n in (*PP_JOBS, PP1_JOB, SYNC_JOB)},
        "jobs": jobs_out,
    }
    path = PP_RECORD.write(
        REPO, "tests/gpu/test_pd_pp_producer.py", fields,
        out=os.environ.get("DSPARK_GPU_PD_PP_OUT"), fallback=None,
        sources=("dspark_dev/pp_launch.py", "dspark_dev/pd_launch.py", "tests/support/pd_run.py"),
    )  # fmt: skip
    print(f"PD PP record: {path}")
    return path


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
    jobs = Jobs(only=ONLY, max_workers=len(ALL_JOBS), knob=JOBS_ENV)
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
    jobs.submit(PP1_JOB, _pd_with_pp2_producer, setup, guard, producer_pp=1)
    jobs.submit(SYNC_JOB, _pd_with_pp2_producer, _sync(setup), guard)
    if MLA:  # the subtle control: the producer's draft reads its aux taps misordered
        from support.draft_controls import aux_perturbed_draft

        subtle = aux_perturbed_draft(setup.draft, str(tmp_path_factory.mktemp("pd-pp-subtle")))
        subtle_spec = {**setup.spec, "model": subtle}
        jobs.submit("pd_pp2_subtle", _pd_with_pp2_producer, setup, guard, subtle_spec)
    else:
        jobs.skip(
            "pd_pp2_subtle",
            "the subtle control is issue 26's, for the trained MLA pairs "
            "(DSPARK_GPU_PD_PP_PAIR=dsv4, k3 or dsv41)",
        )
    _submit_tp_jobs(jobs, setup, guard, bad_spec, tmp_path_factory)
    yield jobs, guard
    try:
        if ONLY & {*PP_JOBS, PP1_JOB, SYNC_JOB}:
            _write_pp_record(jobs, setup)
    finally:
        try:
            if ONLY & set(TP_JOBS):
                _write_tp_record(jobs)
        finally:
            jobs.shutdown()


def _pd(pd_jobs, name="pd_pp2"):
    jobs, _ = pd_jobs
    return jobs.result(name, timeout=1200)


def _proxy_problems(r: dict) -> list[str]:
    st = r["proxy"]
    problems = [f"proxy errors {st['errors']}"] if st["errors"] else []
    if not st["requests"] == st["prefill_ok"] == st["decode_ok"] == len(r["tokens"]):
        problems.append(f"not every request went through both sides: proxy {st}")
    return problems


def _kv_problems(kv: dict) -> list[str]:
    problems = [] if kv.get("vllm:external_prefix_cache_hits_total", 0) > 0 else [
        "no prompt KV came over the connector (external prefix cache hits 0)"
    ]  # fmt: skip
    failed = kv.get("vllm:mooncake_num_failed_transfers_total", 0) + kv.get(
        "vllm:mooncake_num_failed_recvs_total", 0
    )
    if failed:
        problems.append(f"{failed:g} failed Mooncake transfers / receives")
    return problems


def _acceptance_line(dec: dict, agg: dict, producer: str, setting: str | None = None) -> str:
    return (
        f"PD acceptance: decoder {acceptance_rate(dec):.1f}% "
        f"({dec['num_accepted_tokens']}/{dec['num_draft_tokens']}) vs aggregated "
        f"{acceptance_rate(agg):.1f}% ({agg['num_accepted_tokens']}/{agg['num_draft_tokens']}), "
        f"producer {producer}, {setting or _label()}, {datetime.date.today().isoformat()}"
    )


#: vLLM's API server logs its non-default arguments at start (entrypoints/launchers/launcher.py
#: ``setup_server``); with ``--no-async-scheduling`` the dict holds ``'async_scheduling': False``
SYNC_ARG = "'async_scheduling': False"


def test_every_request_went_through_the_pp2_producer_then_the_decoder(pd_jobs):
    r = _pd(pd_jobs)
    st = r["proxy"]
    problems = _proxy_problems(r)
    PP_RECORD.verdict("proxy[pd_pp2]", not problems, "; ".join(problems) or f"proxy {st}")
    print(f"proxy {st}; timings {r['timings']}")
    assert not problems, problems


def test_pp2_producer_is_context_kv_only_and_both_stages_ran(pd_jobs):
    r = _pd(pd_jobs)
    print(f"producer log markers: {r['prefill_log_markers']}")
    logs = r["producer_logs"]
    joined = "\n".join(logs.values())
    backends = [x for log in logs.values() for x in log.split("DSpark PP exchange:")[1:2]]
    problems = []
    if not all(r["prefill_log_markers"].values()):
        problems.append(f"producer log markers {r['prefill_log_markers']}")
    if r["prefill_spec"]["num_draft_tokens"] != 0:
        problems.append(f"the producer drafted: {r['prefill_spec']}")
    if len(logs) != 2:
        problems.append(f"producer launcher logs {list(logs)}, want 2")
    if "PP handshake: 2 ranks agree" not in joined:
        problems.append("no 'PP handshake: 2 ranks agree' line")
    if not (len(backends) == 2 and all(" over nccl" in b.splitlines()[0] for b in backends)):
        problems.append(f"the exchange did not run over nccl on both stages: {backends}")
    detail = "; ".join(problems) or json.dumps(_producer_evidence(r))
    PP_RECORD.verdict("producer[pd_pp2]", not problems, detail)
    assert not problems, "\n".join(problems)


def test_decoder_pulled_the_prompt_kv_over_mooncake(pd_jobs):
    kv = _pd(pd_jobs)["decoder_kv"]
    print(f"decoder KV counters (delta): {kv}")
    problems = _kv_problems(kv)
    PP_RECORD.verdict("kv[pd_pp2]", not problems, "; ".join(problems) or json.dumps(kv))
    assert not problems, (problems, kv)


def test_pd_greedy_equals_aggregated_and_no_speculation(pd_jobs):
    jobs, _ = pd_jobs
    base, agg = jobs.result("pair_baseline"), jobs.result("pair_spec")
    got = _pd(pd_jobs)["tokens"]
    rep = compare_tokens(base.tokens, got, base.logprobs)
    rep2 = compare_tokens(agg.tokens, got, base.logprobs)
    desc = f"PD (PP=2 producer) vs no-spec: {rep.describe()}\nvs aggregated: {rep2.describe()}"
    PP_RECORD.verdict("greedy[pd_pp2]", rep.ok and rep2.ok, desc)
    print(desc)
    assert rep.ok and rep2.ok, (rep.describe(), rep2.describe())


def test_pd_acceptance_equals_aggregated(pd_jobs):
    jobs, _ = pd_jobs
    agg = jobs.result("pair_spec").metrics()
    dec = _pd(pd_jobs)["decoder_spec"]
    ok, desc = counters_close(dec, agg)
    line = _acceptance_line(dec, agg, "PP=2")
    engaged = bool(agg["num_drafts"]) and 1 + agg["num_accepted_tokens"] / agg["num_drafts"] >= 3.0
    problems = [] if engaged else [f"the aggregated reference accepted too little: {agg}"]
    per_pos = f"per position {agg.get('accepted_per_pos')} vs {dec.get('accepted_per_pos')}"
    if MLA:  # the 2-point rule compares real acceptance: every draft position accepted
        problems += [f"[{PAIR}] aggregated DSpark: {p}"
                     for p in mla_pairs.trained_acceptance_problems(agg, MLA_K)]  # fmt: skip
        per_pos = (
            f"[{PAIR}] aggregated acceptance length {mla_pairs.acceptance_length(agg):.3f}, "
            f"decoder {mla_pairs.acceptance_length(dec):.3f}; {per_pos}"
        )
    PP_RECORD.verdict(
        "acceptance[pd_pp2]", ok and not problems, "\n".join([line, desc, per_pos, *problems])
    )
    print(line)
    print(desc)
    print(per_pos)
    assert engaged, agg
    assert not problems, problems
    assert ok, desc


def test_corrupted_producer_draft_drops_the_decoder_acceptance(pd_jobs):
    jobs, _ = pd_jobs
    good, bad = _pd(pd_jobs), _pd(pd_jobs, "pd_pp2_control")
    g, b = good["decoder_spec"], bad["decoder_spec"]
    base = jobs.result("pair_baseline")
    rep = compare_tokens(base.tokens, bad["tokens"], base.logprobs)
    line = (
        f"NaN-norm control (PP=2 producer, {_label()}): decoder {acceptance_rate(b):.1f}% {b} vs "
        f"PD {acceptance_rate(g):.1f}% {g}; tokens vs no-spec: {rep.describe().splitlines()[0]}"
    )
    problems = [] if b["num_draft_tokens"] > 0 else ["the control's decoder drafted nothing"]
    if not acceptance_rate(b) < acceptance_rate(g) - 2.0:
        problems.append("the NaN-norm producer draft did not drop the acceptance by 2 points")
    if MLA and acceptance_rate(b) > NAN_CONTROL_MAX_PCT:  # test_dsv4_k3_engine.py's trained rule
        problems.append(f"[{PAIR}] a NaN draft context KV still accepted "
                        f"{acceptance_rate(b):.2f}% (> {NAN_CONTROL_MAX_PCT}%)")  # fmt: skip
    if not rep.ok:
        problems.append(f"the corrupted draft changed the output: {rep.describe()}")
    PP_RECORD.verdict("nan_control", not problems, "\n".join([line, *problems]))
    print(line)
    assert not problems, problems


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
    base = jobs.result("pair_baseline")
    rep = compare_tokens(base.tokens, bad["tokens"], base.logprobs)
    line = (
        f"subtle control ({PAIR}, PP=2 producer): decoder {bp:.1f}% vs PD {gp:.1f}%, drop "
        f"{gp - bp:.2f} points (need {SUBTLE_MARGIN_POINTS}); producer draft's aux taps "
        f"{SUBTLE_PERTURB}; {g} vs {b}; tokens vs no-spec: {rep.describe().splitlines()[0]}"
    )
    ok = b["num_draft_tokens"] > 0 and rep.ok and bp <= gp - SUBTLE_MARGIN_POINTS
    PP_RECORD.verdict("subtle_control", ok, line)
    print(line)
    assert b["num_draft_tokens"] > 0, b
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
    called = guard.calls() if guard.so is not None else None
    detail = f"the recording NCCL stub was not built: {guard.problem}" if called is None else (
        f"{len(guard.symbols)} stubbed NCCL symbols; called: {called}"
    )  # fmt: skip
    PP_RECORD.verdict("nccl_stubs", called == [], detail)
    assert guard.so is not None, detail
    assert not called, called


# --- issue 42: PD with a PP=1 producer (job pd_pp1; the dsv41 pair's default) -----------------


def test_pp1_producer_pd_is_context_kv_only_and_pulled_over_mooncake(pd_jobs):
    """PD with a PP=1 producer (one launcher): every request went producer -> decoder, the
    producer built the context-KV-only drafter and drafted nothing, the decoder pulled the prompt
    KV over Mooncake without a failed transfer."""
    r = _pd(pd_jobs, PP1_JOB)
    st, kv = r["proxy"], r["decoder_kv"]
    print(f"[{PAIR} PP=1 producer] proxy {st}; markers {r['prefill_log_markers']}; KV {kv}")
    problems = _proxy_problems(r) + _kv_problems(kv)
    if not all(r["prefill_log_markers"].values()):
        problems.append(f"producer log markers {r['prefill_log_markers']}")
    if r["prefill_spec"]["num_draft_tokens"] != 0:
        problems.append(f"the producer drafted: {r['prefill_spec']}")
    detail = "; ".join(problems) or f"proxy {st}; KV {json.dumps(kv)}"
    PP_RECORD.verdict(f"producer_kv[{PP1_JOB}]", not problems, detail)
    assert not problems, problems


def test_pp1_producer_pd_greedy_and_acceptance_equal_aggregated(pd_jobs):
    """The PP=1 producer's PD against the same references as ``pd_pp2``: greedy equal to no-spec
    and aggregated DSpark (near-tie rule), the decoder's counters within 2 points of aggregated
    (the ``PD acceptance:`` line, producer PP=1), aggregated accepting like a trained pair."""
    jobs, _ = pd_jobs
    base, agg_run = jobs.result("pair_baseline"), jobs.result("pair_spec")
    r = _pd(pd_jobs, PP1_JOB)
    rep = compare_tokens(base.tokens, r["tokens"], base.logprobs)
    rep2 = compare_tokens(agg_run.tokens, r["tokens"], base.logprobs)
    agg, dec = agg_run.metrics(), r["decoder_spec"]
    ok, desc = counters_close(dec, agg)
    greedy = f"PD (PP=1 producer) vs no-spec: {rep.describe()}\nvs aggregated: {rep2.describe()}"
    line = _acceptance_line(dec, agg, "PP=1")
    problems = mla_pairs.trained_acceptance_problems(agg, MLA_K) if MLA else []
    per_pos = f"per position {agg.get('accepted_per_pos')} vs {dec.get('accepted_per_pos')}"
    PP_RECORD.verdict(f"greedy[{PP1_JOB}]", rep.ok and rep2.ok, greedy)
    PP_RECORD.verdict(
        f"acceptance[{PP1_JOB}]", ok and not problems, "\n".join([line, desc, per_pos, *problems])
    )
    print(greedy)
    print(line)
    print(desc)
    assert rep.ok and rep2.ok, (rep.describe(), rep2.describe())
    assert not problems, f"[{PAIR}] aggregated DSpark: {'; '.join(problems)} ({agg})"
    assert ok, desc


# --- issue 40 item 6: PD with a PP=2 producer under synchronous scheduling (job pd_pp2_sync) ---


def test_sync_pp2_producer_pd_is_lossless_and_accepts_like_aggregated(pd_jobs):
    """``pd_pp2`` with ``--no-async-scheduling`` on the producer's two launchers and the decoder:
    every request through both sides, the producer's two stages handshook and exchanged over nccl
    and drafted nothing, the decoder's prompt KV came over Mooncake, greedy output equals the
    no-spec and aggregated references (near-tie rule), the decoder's counters within 2 points of
    aggregated DSpark's. The control for the 2-point rule is ``pd_pp2_control``'s NaN-norm draft
    (same checks, async); for the scheduling itself, stock vLLM's sync PP hang
    (docs/sync-scheduling.md)."""
    jobs, _ = pd_jobs
    base, agg_run = jobs.result("pair_baseline"), jobs.result("pair_spec")
    r = _pd(pd_jobs, SYNC_JOB)
    logs = r["producer_logs"]
    joined = "\n".join(logs.values())
    backends = [x for log in logs.values() for x in log.split("DSpark PP exchange:")[1:2]]
    problems = _proxy_problems(r) + _kv_problems(r["decoder_kv"])
    if r["prefill_spec"]["num_draft_tokens"] != 0:
        problems.append(f"the producer drafted: {r['prefill_spec']}")
    if "PP handshake: 2 ranks agree" not in joined:
        problems.append("no 'PP handshake: 2 ranks agree' line")
    if not (len(backends) == 2 and all(" over nccl" in b.splitlines()[0] for b in backends)):
        problems.append(f"the exchange did not run over nccl on both stages: {backends}")
    # both API servers (producer node 0, the decoder) started with synchronous scheduling
    api_logs = {"producer": next(iter(logs.values()), ""),
                "decoder": next(iter(r.get("decoder_logs", {}).values()), "")}  # fmt: skip
    for side, text in api_logs.items():
        if SYNC_ARG not in text:
            problems.append(f"the {side}'s API server did not log {SYNC_ARG} (not sync)")
    PP_RECORD.verdict(
        f"producer_kv[{SYNC_JOB}]", not problems,
        "; ".join(problems) or f"proxy {r['proxy']}; KV {json.dumps(r['decoder_kv'])}",
    )  # fmt: skip
    rep = compare_tokens(base.tokens, r["tokens"], base.logprobs)
    rep2 = compare_tokens(agg_run.tokens, r["tokens"], base.logprobs)
    greedy = f"PD (PP=2 producer, sync) vs no-spec: {rep.describe()}"
    greedy += f"\nvs aggregated: {rep2.describe()}"
    PP_RECORD.verdict(f"greedy[{SYNC_JOB}]", rep.ok and rep2.ok, greedy)
    agg, dec = agg_run.metrics(), r["decoder_spec"]
    ok, desc = counters_close(dec, agg)
    setting = "sync scheduling" if not MLA else f"{_label()}, sync scheduling"
    line = _acceptance_line(dec, agg, "PP=2", setting)
    per_pos = f"per position {agg.get('accepted_per_pos')} vs {dec.get('accepted_per_pos')}"
    PP_RECORD.verdict(f"acceptance[{SYNC_JOB}]", ok, "\n".join([line, desc, per_pos]))
    print(greedy)
    print(line)
    print(desc)
    assert not problems, problems
    assert rep.ok and rep2.ok, (rep.describe(), rep2.describe())
    assert ok, desc


# --- issue 40 item 2: PD with a TP=2 x PP=2 producer (opt-in jobs, group pd_tp_pp) -------------

TP_RECORD = GpuRecord("pd_tp_pp.json")
TP_SUBTLE_MARGIN_POINTS = SUBTLE_MARGIN_POINTS  # the same rule as the trained MLA pairs'


def _submit_tp_jobs(jobs: Jobs, setup: Setup, guard, nan_spec: dict, tmp_path_factory) -> None:
    """The TP x PP PD jobs: the tiny pair only (the trained DeepSeek-V4 / Kimi-K3 pairs have no
    TP tier yet). The subtle control's draft is written only when its job is selected."""
    for name, (ptp, _, dtp, draft) in TP_JOBS.items():
        if MLA:
            jobs.skip(name, f"{name}: the TP x PP PD jobs run the tiny pair (this run: {PAIR})")
            continue
        if name not in ONLY:
            jobs.submit(name, None)  # recorded as not selected (Jobs.submit skips it)
            continue
        spec = None
        if draft == "nan":
            spec = nan_spec
        elif draft == "subtle":
            from support.draft_controls import aux_perturbed_draft

            out = str(tmp_path_factory.mktemp("pd-tp-pp-subtle"))
            spec = {**setup.spec, "model": aux_perturbed_draft(setup.draft, out)}
        jobs.submit(name, _pd_with_pp2_producer, setup, guard, spec, producer_tp=ptp,
                    decoder_tp=dtp)  # fmt: skip


def _tp_shape(name: str) -> dict:
    ptp, ppp, dtp, draft = TP_JOBS[name]
    return {
        "producer_tp": ptp, "producer_pp": ppp, "decoder_tp": dtp, "decoder_pp": 1,
        "label": shape_label(ptp, ppp, dtp), "producer_draft": draft, "pair": PAIR,
        "dtype": PAIR_DTYPE, "scheduling": "async", "cuda_graphs": True,
        "layout": pp_launch.layout(),
    }  # fmt: skip


def _tp_verdict(check: str, ok: bool, detail: str) -> None:
    """The check's outcome for the JSON record (set before the test asserts it)."""
    TP_RECORD.verdict(check, ok, detail)


def _write_tp_record(jobs: Jobs) -> Path:
    fields = {
        "issue": 40,
        "item": 2,
        "selected_jobs": sorted(ONLY),
        "pair": PAIR,
        "num_prompts": len(pair_prompts()) if not MLA else None,
        "shapes": {n: _tp_shape(n) for n in TP_JOBS},
        "jobs": {
            n: _pd_job_summary(jobs, n, _tp_shape(n) if n in TP_JOBS else None)
            for n in ("pair_baseline", "pair_spec", *TP_JOBS)
        },
    }
    path = TP_RECORD.write(
        REPO, "tests/gpu/test_pd_pp_producer.py", fields,
        out=os.environ.get("DSPARK_GPU_PD_TP_PP_OUT"), fallback=None,
        sources=("dspark_dev/pp_launch.py", "dspark_dev/pd_launch.py", "tests/support/pd_run.py"),
    )  # fmt: skip
    print(f"PD TP x PP record: {path}")
    return path


def _by_source(kv: dict[str, float], source: str) -> float:
    """A ``vllm:prompt_tokens_by_source_total{...source="S"}`` delta (summed over engines)."""
    return sum(v for k, v in kv.items() if f'source="{source}"' in k)


def _producer_evidence(r: dict) -> dict:
    """Per producer launcher (launcher R = global rank R): vLLM's rank line, whether it built the
    context-KV-only drafter, its exchange backend; and the decoder launchers' rank lines."""
    plogs = list(r.get("producer_logs", {}).values())
    dlogs = list(r.get("decoder_logs", {}).values())
    return {
        "producer_ranks": pp_launch.rank_assignments(plogs),
        "producer_built_drafter": [BUILT_LINE in t for t in plogs],
        "producer_exchange": [sorted(set(pp_launch.EXCHANGE.findall(t))) for t in plogs],
        "handshake_sizes": pp_launch.handshake_sizes(plogs),
        "decoder_ranks": pp_launch.rank_assignments(dlogs),
    }


def _tp_pd(jobs: Jobs, name: str) -> dict:
    return jobs.result(name, timeout=1200)


@pytest.mark.parametrize("name", TP_GOOD)
def test_tp_pp_pd_every_prompt_kv_came_over_mooncake(pd_jobs, name):
    """Every request went producer -> decoder, no transfer failed, and the decoder computed at
    most one prompt token per request itself (``prompt_tokens_by_source``: the rest came from
    the pulled KV). Control: the fake engines' ``kv_recomputed`` (the decoder prefills the
    prompts itself) fails it (tests/unit/support/test_gpu_fake_wiring.py)."""
    jobs, _ = pd_jobs
    r = _tp_pd(jobs, name)
    st, kv, n = r["proxy"], r["decoder_kv"], len(r["tokens"])
    failed = kv.get("vllm:mooncake_num_failed_transfers_total", 0) + kv.get(
        "vllm:mooncake_num_failed_recvs_total", 0
    )
    local, external = _by_source(kv, "local_compute"), _by_source(kv, "external_kv_transfer")
    problems = []
    if st["errors"] or not st["requests"] == st["prefill_ok"] == st["decode_ok"] == n:
        problems.append(f"proxy {st}")
    if failed:
        problems.append(f"{failed:g} failed Mooncake transfers / receives")
    if not kv.get("vllm:external_prefix_cache_hits_total", 0) > 0 or not external > 0:
        problems.append("no prompt token came over the connector")
    if local > n:
        problems.append(f"the decoder computed {local:g} prompt tokens itself (at most {n})")
    _tp_verdict(f"kv[{name}]", not problems, "; ".join(problems) or f"{st}; {kv}")
    print(f"{name} ({_tp_shape(name)['label']}): proxy {st}; decoder KV {kv}")
    assert not problems, problems


@pytest.mark.parametrize("name", TP_GOOD)
def test_tp_pp_pd_every_producer_rank_ran_its_part(pd_jobs, name):
    """Launcher R of the producer holds rank R (vLLM's rank line: PP stage R // TP, TP rank
    R % TP); both TP ranks of the last stage built the context-KV-only drafter and stage 0's did
    not (it lives where the speculator does); every launcher ran the plugin's exchange over NCCL;
    the producer drafted nothing; each decoder launcher holds its rank. Control: the fake
    engines' ``pd_one_stage`` (only node 0 logs the exchange) fails it."""
    jobs, _ = pd_jobs
    r = _tp_pd(jobs, name)
    ptp, ppp, dtp, _ = TP_JOBS[name]
    ev = _producer_evidence(r)
    world = ptp * ppp
    want_ranks = [[(i, world, i // ptp, i % ptp)] for i in range(world)]
    problems = []
    if ev["producer_ranks"] != want_ranks:
        problems.append(f"producer rank lines {ev['producer_ranks']}, want {want_ranks}")
    want_built = [i // ptp == ppp - 1 for i in range(world)]
    if ev["producer_built_drafter"] != want_built:
        problems.append(f"context-KV-only drafter built per launcher "
                        f"{ev['producer_built_drafter']}, want {want_built}")  # fmt: skip
    if ev["producer_exchange"] != [["nccl"]] * world:
        problems.append(f"exchange backend per launcher {ev['producer_exchange']}, want nccl")
    if not ev["handshake_sizes"]:
        problems.append("no 'PP handshake: N ranks agree' line")
    if r["prefill_spec"].get("num_draft_tokens", 0) != 0:
        problems.append(f"the producer drafted: {r['prefill_spec']}")
    if dtp > 1 and ev["decoder_ranks"] != [[(i, dtp, 0, i)] for i in range(dtp)]:
        problems.append(f"decoder rank lines {ev['decoder_ranks']}")
    _tp_verdict(f"ranks[{name}]", not problems, "; ".join(problems) or json.dumps(ev))
    print(f"{name} evidence: {json.dumps(ev)}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", TP_GOOD)
def test_tp_pp_pd_greedy_equals_aggregated_and_no_speculation(pd_jobs, name):
    jobs, _ = pd_jobs
    base, agg = jobs.result("pair_baseline"), jobs.result("pair_spec")
    got = _tp_pd(jobs, name)["tokens"]
    rep = compare_tokens(base.tokens, got, base.logprobs)
    rep2 = compare_tokens(agg.tokens, got, base.logprobs)
    desc = f"PD ({_tp_shape(name)['label']}) vs no-spec: {rep.describe()}\nvs aggregated: " + (
        rep2.describe()
    )
    _tp_verdict(f"greedy[{name}]", rep.ok and rep2.ok, desc)
    print(desc)
    assert rep.ok and rep2.ok, desc


@pytest.mark.parametrize("name", TP_GOOD)
def test_tp_pp_pd_acceptance_within_2_points_of_aggregated(pd_jobs, name):
    """The ``PD acceptance:`` line with the shapes in it. Control: the fake engines' ``pd_low``
    (the decoder's counters lower at its last two draft positions) fails it."""
    jobs, _ = pd_jobs
    agg = jobs.result("pair_spec").metrics()
    dec = _tp_pd(jobs, name)["decoder_spec"]
    ok, desc = counters_close(dec, agg)
    engaged = bool(agg["num_drafts"]) and 1 + agg["num_accepted_tokens"] / agg["num_drafts"] >= 3
    line = (
        f"PD acceptance: decoder {acceptance_rate(dec):.1f}% "
        f"({dec['num_accepted_tokens']}/{dec['num_draft_tokens']}) vs aggregated "
        f"{acceptance_rate(agg):.1f}% ({agg['num_accepted_tokens']}/{agg['num_draft_tokens']}), "
        f"{_tp_shape(name)['label']}, {_label()}, {datetime.date.today().isoformat()}"
    )
    _tp_verdict(f"acceptance[{name}]", ok and engaged, f"{line}\n{desc}")
    print(line)
    print(desc)
    assert engaged, f"the aggregated reference accepted too little to compare with: {agg}"
    assert ok, desc


def _tp_control_reference(jobs: Jobs) -> tuple[str, dict]:
    """The good TP x PP PD run's decoder counters when it ran, else the aggregated run's (the PD
    run is within 2 points of them when it passes)."""
    good = "pd_tp2pp2_tp2"
    if good in ONLY:
        return good, _tp_pd(jobs, good)["decoder_spec"]
    return "pair_spec", jobs.result("pair_spec").metrics()


def test_tp_pp_pd_nan_norm_producer_draft_drops_the_decoder_acceptance(pd_jobs):
    """The NaN-norm control at TP2 x PP2: the producer's draft context KV of the prompt is NaN
    on every shard; the decoder's acceptance must drop by more than 2 points, its tokens stay.
    Control: the fake engines' ``nan_same`` (the NaN-norm control accepts like the good run)
    fails it."""
    jobs, _ = pd_jobs
    bad = _tp_pd(jobs, "pd_tp2pp2_tp2_control")
    ref_name, g = _tp_control_reference(jobs)
    b = bad["decoder_spec"]
    base = jobs.result("pair_baseline")
    rep = compare_tokens(base.tokens, bad["tokens"], base.logprobs)
    ok = b["num_draft_tokens"] > 0 and acceptance_rate(b) < acceptance_rate(g) - 2.0 and rep.ok
    line = (
        f"NaN-norm control ({_tp_shape('pd_tp2pp2_tp2_control')['label']}): decoder "
        f"{acceptance_rate(b):.1f}% vs {ref_name} {acceptance_rate(g):.1f}%; tokens vs no-spec: "
        f"{rep.describe().splitlines()[0]}"
    )
    _tp_verdict("nan_control", ok, line)
    print(line)
    assert b["num_draft_tokens"] > 0, b
    assert acceptance_rate(b) < acceptance_rate(g) - 2.0, (g, b)
    assert rep.ok, f"the corrupted draft changed the output: {rep.describe()}"


def test_tp_pp_pd_subtly_wrong_producer_draft_drops_the_decoder_acceptance(pd_jobs):
    """The subtle control at TP2 x PP2: the producer's draft reads its first and last aux taps
    exchanged (``fc``'s column blocks, support.draft_controls); the decoder keeps the real draft.
    Tokens unchanged, acceptance at least ``TP_SUBTLE_MARGIN_POINTS`` below the good run's. For
    the tiny pair this strength is not calibrated (no CPU estimate: pd_control_sim covers the
    MLA families). Control: the fake engines' ``subtle_same`` (the subtle control accepts like
    the good run) fails it."""
    jobs, _ = pd_jobs
    bad = _tp_pd(jobs, "pd_tp2pp2_tp2_subtle")
    ref_name, g = _tp_control_reference(jobs)
    b = bad["decoder_spec"]
    gp, bp = acceptance_rate(g), acceptance_rate(b)
    base = jobs.result("pair_baseline")
    rep = compare_tokens(base.tokens, bad["tokens"], base.logprobs)
    ok = b["num_draft_tokens"] > 0 and rep.ok and bp <= gp - TP_SUBTLE_MARGIN_POINTS
    line = (
        f"subtle control ({_tp_shape('pd_tp2pp2_tp2_subtle')['label']}): decoder {bp:.1f}% vs "
        f"{ref_name} {gp:.1f}%, drop {gp - bp:.2f} points (need {TP_SUBTLE_MARGIN_POINTS}); "
        f"aux taps {SUBTLE_PERTURB}; tokens vs no-spec: {rep.describe().splitlines()[0]}"
    )
    _tp_verdict("subtle_control", ok, line)
    print(line)
    assert b["num_draft_tokens"] > 0, b
    assert rep.ok, f"a subtly wrong producer draft changed the output: {rep.describe()}"
    assert bp <= gp - TP_SUBTLE_MARGIN_POINTS, line
