"""PD on one GPU: prefiller (kv_producer) + decoder (kv_consumer) over MooncakeConnector/TCP.

Both ``vllm serve`` instances share the GPU (0.3 of its memory each, 1 GiB KV), have the same
DSpark speculative config, and talk through tests/gpu/pd_proxy.py: each request goes to the
prefiller with one output token, then to the decoder. Model: the trained tiny pair
(models/tiny-pair, k=7, float32 unless ``DSPARK_GPU_PAIR_DTYPE`` says otherwise) on 7 held-out
prompts sent concurrently, each answer stopping at EOS; the references are the ``pair_baseline``
(no speculation) and ``pair_spec`` (aggregated DSpark, same graph mode as the servers) jobs.
Checked: the KV really came over the connector (the decoder's external prefix cache hits),
greedy output equals the aggregated runs (gpu_parity rule: identical except at a proven
near-tie), the aggregated pair really accepts (mean acceptance length >= 3), and the decoder's
acceptance (its /metrics counters) equals the aggregated DSpark run's within 2 points. The
random-weight pair accepted only at draft position 0, so a decoder drafter with a wrong or cold
context could not fail the last check with it; the trained pair's acceptance collapses then (on
CPU, corrupting the draft context KV took it from 100% to 34%: tests/e2e/producer/test_pd_producer_cpu.py).
"""

from __future__ import annotations

import json

import pytest
from gpu_parity import acceptance_close, acceptance_rate, compare_tokens

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(540)]


@pytest.fixture(scope="module")
def pd(gpu_jobs):
    res = gpu_jobs.result("pd")
    print("PD result:", json.dumps({k: v for k, v in res.items() if k != "tokens"}, indent=1, default=str))
    return res


def _aggregated(gpu_jobs):
    return gpu_jobs.result("pair_spec")


def test_pd_requests_all_went_through_prefill_then_decode(pd):
    st = pd["proxy"]
    assert not st["errors"], st["errors"]
    assert st["requests"] == st["prefill_ok"] == st["decode_ok"] == len(pd["tokens"]), st


def test_prefiller_is_a_context_kv_only_producer(pd):
    markers = pd.get("prefill_log_markers", {})
    print(f"prefiller log markers: {markers}")
    assert markers and all(markers.values()), (
        f"the prefiller (kv_producer) did not build the context-KV-only drafter or still schedules "
        f"drafts: {markers}"
    )
    assert pd["prefill_spec"]["num_draft_tokens"] == 0, pd["prefill_spec"]


def test_decoder_received_the_prompt_kv_over_mooncake(pd):
    kv = pd["decoder_kv"]
    hits = kv.get("vllm:external_prefix_cache_hits_total", 0)
    print(f"decoder KV counters (delta): {kv}")
    assert hits > 0, (
        "the decoder reports no external prefix-cache hits: it recomputed the prompts instead of "
        f"pulling them from the prefiller ({kv})"
    )
    failed = kv.get("vllm:mooncake_num_failed_transfers_total", 0) + kv.get("vllm:mooncake_num_failed_recvs_total", 0)
    assert failed == 0, f"Mooncake reports failed transfers: {kv}"


def test_pd_greedy_output_equals_aggregated(pd, gpu_jobs):
    base = gpu_jobs.result("pair_baseline")
    agg = _aggregated(gpu_jobs)
    ref_tokens, ref_lps = base.waves[-1]["tokens"], base.waves[-1]["logprobs"]
    rep = compare_tokens(ref_tokens, pd["tokens"], ref_lps)
    print(f"PD vs non-speculative baseline: {rep.describe()}")
    rep2 = compare_tokens(agg.waves[-1]["tokens"], pd["tokens"], ref_lps)
    print(f"PD vs aggregated DSpark ({agg.name}): {rep2.describe()}")
    assert rep.ok, rep.describe()
    assert rep2.ok, rep2.describe()


def test_decoder_acceptance_equals_aggregated(pd, gpu_jobs):
    agg = _aggregated(gpu_jobs)
    dec = pd["decoder_spec"]
    ref = agg.metrics(len(agg.waves) - 1)
    assert ref["num_drafts"] > 0 and 1 + ref["num_accepted_tokens"] / ref["num_drafts"] >= 3.0, (
        f"the aggregated trained pair does not accept like a trained drafter: {ref}"
    )
    ok, desc = acceptance_close(dec, ref)
    print(f"decoder {dec} vs aggregated {agg.name} wave {ref}: {desc}")
    print(f"prefiller spec counters (delta): {pd['prefill_spec']}")
    assert ok, (
        f"decoder acceptance {acceptance_rate(dec):.2f}% vs aggregated {acceptance_rate(ref):.2f}%: {desc}"
    )
