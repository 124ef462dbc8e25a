"""The GPU parity rule (dspark_dev/parity.py) and the one /metrics reader
(dspark_dev.metrics)."""

from __future__ import annotations

import math

from dspark_dev import metrics
from dspark_dev.parity import acceptance_close, acceptance_rate, compare_tokens


def test_identical_tokens():
    rep = compare_tokens([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]])
    assert rep.ok and rep.identical and rep.num_tokens == 5


def test_a_proven_near_tie_is_excused_and_reported_with_its_gap():
    lps = [[{"1": -0.1, "9": -2.0}, {"2": -0.70, "7": -0.75}, {"3": 0.0}]]
    rep = compare_tokens([[1, 2, 3]], [[1, 7, 8]], lps, near_tie=0.125)
    assert rep.ok and not rep.identical
    (m,) = rep.mismatches
    assert (m.request, m.position, m.ref_token, m.got_token) == (0, 1, 2, 7)
    assert math.isclose(m.gap, 0.05) and m.excused
    assert "top-2 gap 0.0500" in rep.describe() and "near-tie (excused)" in rep.describe()


def test_a_wide_gap_is_a_failure():
    lps = [[{"1": -0.01, "9": -4.6}]]
    rep = compare_tokens([[1]], [[9]], lps)
    assert not rep.ok and "NOT a near-tie" in rep.describe()


def test_no_evidence_is_no_excuse():
    assert not compare_tokens([[1, 2]], [[1, 3]]).ok  # no logprobs at all
    assert not compare_tokens([[1, 2]], [[1, 3]], [[{"1": 0.0}, {"2": -0.01}]]).ok  # 3 not in top-k


def test_length_and_count_differences_fail():
    assert not compare_tokens([[1, 2, 3]], [[1, 2]]).ok
    assert not compare_tokens([[1], [2]], [[1]]).ok


def test_acceptance_rule():
    a = {"num_draft_tokens": 400, "num_accepted_tokens": 180}
    b = {"num_draft_tokens": 400, "num_accepted_tokens": 176}
    c = {"num_draft_tokens": 400, "num_accepted_tokens": 140}  # 35% vs 45%: the cold-drafter bug
    assert acceptance_rate(a) == 45.0
    assert acceptance_close(a, b)[0]
    ok, desc = acceptance_close(a, c)
    assert not ok and "45.00%" in desc and "35.00%" in desc
    ok, desc = acceptance_close(a, {"num_draft_tokens": 0, "num_accepted_tokens": 0})
    assert not ok and "NO tokens" in desc


def test_prometheus_parser_sums_label_sets_and_reads_counters():
    text = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 48.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 12.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 96.0
vllm:external_prefix_cache_hits_total{engine="1",model_name="m"} 4.0
"""
    m = metrics.parse_prometheus(text)
    assert m["vllm:external_prefix_cache_hits_total"] == 100.0
    assert m['vllm:external_prefix_cache_hits_total{engine="1",model_name="m"}'] == 4.0
    c = metrics.spec_metrics_from_prometheus(m)
    assert c == {
        "num_drafts": 12,
        "num_draft_tokens": 48,
        "num_accepted_tokens": 20,
        "accepted_per_pos": [12, 8],
    }
    d = metrics.counter_delta({"num_drafts": 2, "accepted_per_pos": [2, 1]}, c)
    assert d["num_drafts"] == 10 and d["accepted_per_pos"] == [10, 7]


def test_llm_result_metrics_sum_the_waves_per_position_included():
    """The GPU PD per-position check reads LLMResult.metrics()['accepted_per_pos']."""
    from support.gpu import LLMResult

    waves = [
        {
            "tokens": [[1]],
            "metrics": {
                "num_drafts": 2,
                "num_draft_tokens": 8,
                "num_accepted_tokens": 3,
                "accepted_per_pos": [2, 1],
            },
        },
        {
            "tokens": [[2]],
            "metrics": {
                "num_drafts": 1,
                "num_draft_tokens": 4,
                "num_accepted_tokens": 3,
                "accepted_per_pos": [1, 1, 1],
            },
        },
    ]
    r = LLMResult("x", waves, {}, None, 0.0, 0.0)
    assert r.metrics() == {
        "num_drafts": 3,
        "num_draft_tokens": 12,
        "num_accepted_tokens": 6,
        "accepted_per_pos": [3, 2, 1],
    }
    assert r.metrics(1)["accepted_per_pos"] == [1, 1, 1]
