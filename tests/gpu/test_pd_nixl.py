"""DSpark PD over NixlConnector on one GPU (issue 18): stock failure, prefill-only producer,
control.

Independent of tests/gpu/conftest.py's ``gpu_jobs`` (this file never asks for it, so selecting
only this file starts only its own servers). One module fixture runs, concurrently for two model
pairs, everything tests/gpu/pd_nixl.py describes:

* **trained** pair (models/tiny-pair, float32, k=7, 7 held-out prompts, stop at EOS): decoder +
  prefill-only producer (PD), a corrupted-draft producer with a decoder that skips the hash check
  (control), and a prefiller without speculation (DSpark on the decoder only, vLLM #48221);
* **qwen3** random-weight pair (``vllm_dspark_pp.tiny_models``, float32): decoder + prefill-only
  producer.

Checked: the PD requests succeed over NIXL (else the test prints what NIXL/UCX logged); the
decoder-only case fails and its exact error text is printed; the producer built the context-only
drafter and drafted nothing (its log and counters); the decoder pulled the prompt KV (external
prefix-cache hits) and paired the producer's draft KV layers (its log); decoder greedy output
equals the aggregated run's (the decoder itself, no remote prefill); acceptance within 2 points;
the corrupted draft context KV lowers acceptance by more than 10 points (so the acceptance check
can fail) while the output stays the same (lossless).

Run (GPU machine, kit booted with the ``nixl`` group):
``DSPARK_GPU_NIXL=1 DSPARK_PP_TEST_DEVICE=gpu DSPARK_NIXL_OUT=$OUT/nixl python3 -m pytest
tests/gpu/test_pd_nixl.py -v -s`` (without ``DSPARK_GPU_NIXL=1``, e.g. in the whole-suite run of
tools/gpu/run_gpu_suite.sh, every test here is skipped saying so).
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from gpu_common import make_prompts, require_cuda

from dspark_dev.parity import acceptance_close, acceptance_rate, compare_tokens

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(255)]

LABELS = ("trained", "qwen3")
READY_BUDGET_S = float(os.environ.get("DSPARK_NIXL_READY_S", "170"))
CONTROL_DROP_POINTS = 10.0


def _common(dtype: str) -> list[str]:
    return [
        "--dtype", dtype, "--max-model-len", "512", "--max-num-seqs", "8", "--seed", "0",
        "--gpu-memory-utilization", "0.08", "--kv-cache-memory-bytes", str(256 << 20),
        "--enforce-eager",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_cuda()
    if os.environ.get("DSPARK_GPU_NIXL") != "1":
        pytest.skip(
            "the NIXL PD run is its own GPU command (7 servers): set DSPARK_GPU_NIXL=1; "
            "NIXL PD NOT run"
        )
    if importlib.util.find_spec("nixl") is None:
        pytest.fail(
            "nixl is not importable: boot the kit with its `nixl` group "
            "(prepare.sh ... nixl); NIXL PD NOT run"
        )
    from support import tiny_pair
    from support.pd_nixl import corrupt_draft, run_nixl_pd, summary, write_artifacts

    from vllm_dspark_pp.tiny_models import make_tiny_models

    ok, why = tiny_pair.available()
    if not ok:
        pytest.fail(why)
    tmp = tmp_path_factory.mktemp("nixl")
    bad_draft = corrupt_draft(tiny_pair.DRAFT, str(tmp))
    rnd = make_tiny_models(tmp / "qwen3-random", seed=0)
    deadline = time.monotonic() + READY_BUDGET_S
    logs: dict[str, str] = {}
    jobs = {
        "trained": dict(
            model=tiny_pair.TARGET,
            spec=tiny_pair.spec_config(),
            prompts=tiny_pair.heldout_prompts(7),
            common_args=_common("float32"),
            max_tokens=64,
            ignore_eos=False,
            control_draft=bad_draft,
            decoder_only_case=True,
        ),
        "qwen3": dict(
            model=rnd.target,
            spec={"method": "dspark", "model": rnd.draft},
            prompts=make_prompts(sizes=(7,))[0],
            common_args=_common("float32"),
            max_tokens=32,
            ignore_eos=True,
        ),
    }
    with ThreadPoolExecutor(max_workers=len(jobs)) as ex:
        futs = {
            k: ex.submit(run_nixl_pd, k, deadline=deadline, logs=logs, **v) for k, v in jobs.items()
        }
        results = {k: f.result() for k, f in futs.items()}
    write_artifacts(
        os.environ.get("DSPARK_NIXL_OUT") or os.environ.get("DSPARK_GPU_ARTIFACTS"), results, logs
    )
    for k, r in results.items():
        print(
            f"NIXL result ({k}):",
            json.dumps({x: y for x, y in r.items() if x != "logs"}, default=str)[:6000],
        )
    print(summary(results))
    return results


def _ran(runs, label, what="pd"):
    r = runs[label]
    if "error" in r or what not in r:
        lines = [ln for log in r.get("logs", {}).values() for ln in log["failure_lines"]]
        pytest.fail(
            f"[{label}] NIXL run stopped at step {r.get('step')!r}: {r.get('error')}\n"
            "server log lines:\n" + "\n".join(lines[-30:])
        )
    return r


@pytest.mark.parametrize("label", LABELS)
def test_pd_requests_went_through_nixl(runs, label):
    r = _ran(runs, label)
    pd = r["pd"]
    assert not pd["errors"], (
        f"PD requests failed over NIXL (UCX env {r['ucx_env']}): {pd['errors'][:2]}\n"
        "decoder log: "
        + "\n".join(r["logs"]["decoder"]["failure_lines"][-15:])
        + "\nproducer log: "
        + "\n".join(r["logs"]["producer"]["failure_lines"][-15:])
    )
    st = pd["proxy"]
    assert st["requests"] == st["prefill_ok"] == st["decode_ok"] == len(pd["tokens"]), st


def _failed(answer: dict) -> bool:
    """An HTTP error, or an answer vLLM finished with an error (kv_load_failure_policy=fail)."""
    return "error" in answer or answer.get("finish_reason") not in ("length", "stop")


def test_decoder_only_dspark_fails_with_the_stock_error(runs):
    """vLLM #48221 on 0.34.0: a DSpark decoder with a prefiller without speculation."""
    r = _ran(runs, "trained", "decoder_only")
    strict, lax = r["decoder_only"]["decoder"], r["decoder_only"]["lax_decoder"]
    for name, x in (("decoder", strict), ("lax_decoder", lax)):
        print(f"decoder-only DSpark, {name}: answer {x['answer']}")
        print("\n".join(f"  {ln}" for ln in x["log_lines"]))
    assert _failed(strict["answer"]), f"the request succeeded: {strict['answer']}"
    assert any("compatibility hash mismatch" in ln for ln in strict["log_lines"]), strict
    assert any("runs no speculative decoding" in ln for ln in strict["log_lines"]), strict
    # without the hash check the handshake reaches the layer comparison (our message)
    assert _failed(lax["answer"]), f"the request succeeded: {lax['answer']}"
    assert any("First difference at position" in ln for ln in lax["log_lines"]), lax


@pytest.mark.parametrize("label", LABELS)
def test_producer_built_the_context_only_drafter(runs, label):
    r = _ran(runs, label)
    markers = r["logs"]["producer"]["prefill_markers"]
    print(f"[{label}] producer log markers: {markers}; spec counters {r['pd']['producer_spec']}")
    assert markers and all(markers.values()), markers
    assert r["pd"]["producer_spec"]["num_draft_tokens"] == 0, r["pd"]["producer_spec"]


@pytest.mark.parametrize("label", LABELS)
def test_decoder_pulled_prompt_and_draft_kv_over_nixl(runs, label):
    r = _ran(runs, label)
    kv = r["pd"]["kv"]
    print(f"[{label}] decoder KV counters (PD pass): {kv}")
    assert kv.get("vllm:external_prefix_cache_hits_total", 0) > 0, kv
    paired = [p for p in r["logs"]["decoder"]["paired"] if p[0] == r["engine_ids"]["ctx"]]
    print(f"[{label}] decoder paired layers: {paired}")
    assert paired and int(paired[0][2]) >= 1, (
        f"the decoder did not log pairing the producer's draft KV layers: "
        f"{r['logs']['decoder']['paired']}"
    )


@pytest.mark.parametrize("label", LABELS)
def test_pd_greedy_output_equals_aggregated(runs, label):
    r = _ran(runs, label)
    agg, pd = r["aggregated"], r["pd"]
    assert not agg["errors"], agg["errors"]
    rep = compare_tokens(agg["tokens"], pd["tokens"])  # float32 on both: no near-tie excuse
    print(f"[{label}] PD vs aggregated DSpark: {rep.describe()}")
    assert rep.ok, rep.describe()


@pytest.mark.parametrize("label", LABELS)
def test_pd_acceptance_within_2_points_of_aggregated(runs, label):
    r = _ran(runs, label)
    ok, desc = acceptance_close(r["pd"]["spec"], r["aggregated"]["spec"])
    print(
        f"[{label}] NIXL PD acceptance: decoder {acceptance_rate(r['pd']['spec']):.1f}% vs "
        f"aggregated {acceptance_rate(r['aggregated']['spec']):.1f}% ({desc}); "
        f"drafts {r['pd']['spec']['num_drafts']} vs {r['aggregated']['spec']['num_drafts']}"
    )
    assert ok, desc


def test_corrupted_draft_kv_lowers_acceptance(runs):
    r = _ran(runs, "trained", "control")
    ctl, agg, pd = r["control"], r["aggregated"], r["pd"]
    assert not ctl["errors"], ctl["errors"][:2]
    assert ctl["kv"].get("vllm:external_prefix_cache_hits_total", 0) > 0, ctl["kv"]
    a_pd, a_ctl = acceptance_rate(pd["spec"]), acceptance_rate(ctl["spec"])
    print(
        f"control: corrupted draft context KV -> acceptance {a_ctl:.1f}% "
        f"({ctl['spec']}) vs clean PD {a_pd:.1f}% ({pd['spec']})"
    )
    assert a_ctl < a_pd - CONTROL_DROP_POINTS, (a_ctl, a_pd)
    rep = compare_tokens(agg["tokens"], ctl["tokens"])
    print(f"control vs aggregated tokens: {rep.describe()}")
    assert rep.ok, rep.describe()
