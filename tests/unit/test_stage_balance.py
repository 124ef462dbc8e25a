"""The stage balance of `plan` (issue 44 item 3): the cost model and the layer split.

Pure functions of config dicts (``vllm_dspark_pp.stage_balance``); the split is checked against a
brute force over every split of small cases, vLLM's default split against vLLM's own
``get_pp_indices``, and the cost model against the Qwen3-8B shape by hand. The plan's output
(text, JSON, the environment's split) is tested in test_plan.py.
"""

from __future__ import annotations

import itertools
import random

import pytest

from vllm_dspark_pp.stage_balance import (
    ENV,
    attention_macs,
    best_partition,
    draft_macs,
    format_stage_balance,
    is_moe_layer,
    mlp_macs,
    partition_ranges,
    stage_balance,
    stage_costs,
    target_layer_costs,
    vllm_default_partition,
)

# Qwen3-8B and its published block-7 DSpark draft (benchmarks/real_shapes.py)
QWEN3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
}
DRAFT_8B = {
    **QWEN3_8B,
    "num_hidden_layers": 5,
    "target_layer_ids": [1, 9, 17, 25, 33],
    "target_hidden_size": 4096,
    "markov_rank": 256,
}


def _compositions(n: int, pp: int):
    """Every split of n layers into pp stages of at least one layer."""
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = (0, *cuts, n)
        yield [b - a for a, b in itertools.pairwise(bounds)]


def _cases():
    rng = random.Random(0)
    cases = []
    for n in range(1, 9):
        for pp in range(1, min(n, 4) + 1):
            for _ in range(6):
                # integer costs make ties (the tie-break is checked too), floats do not
                costs = [float(rng.choice((1, 1, 2, 3))) for _ in range(n)]
                if rng.random() < 0.5:
                    costs = [c + rng.random() for c in costs]
                cases.append((costs, pp, rng.choice((0.0, 0.5, 1.0, 2.7, 6.0))))
    return cases


@pytest.mark.parametrize("costs,pp,extra", _cases())
def test_best_partition_is_the_brute_force_optimum(costs, pp, extra):
    got = best_partition(costs, pp, extra)
    assert len(got) == pp and sum(got) == len(costs) and min(got) >= 1
    every = list(_compositions(len(costs), pp))
    best = min(max(stage_costs(p, costs, extra)) for p in every)
    assert max(stage_costs(got, costs, extra)) == pytest.approx(best, abs=1e-9)
    # among the splits that reach the bottleneck, the most even one (least sum of squares)
    tied = [p for p in every if max(stage_costs(p, costs, extra)) <= best + 1e-9]
    squares = min(sum(c * c for c in stage_costs(p, costs, extra)) for p in tied)
    assert sum(c * c for c in stage_costs(got, costs, extra)) == pytest.approx(squares)
    # never worse than vLLM's default split
    default = stage_costs(vllm_default_partition(len(costs), pp), costs, extra)
    assert max(stage_costs(got, costs, extra)) <= max(default) + 1e-9


def test_best_partition_refuses_more_stages_than_layers():
    with pytest.raises(ValueError, match="at least 3 layers"):
        best_partition([1.0, 1.0], 3, 0.0)


@pytest.mark.parametrize("n,pp", [(n, pp) for n in range(1, 21) for pp in range(1, 7) if pp <= n])
def test_default_partition_is_vllms(monkeypatch, n, pp):
    from vllm.distributed.utils import get_pp_indices

    monkeypatch.delenv(ENV, raising=False)
    ranges = [get_pp_indices(n, r, pp) for r in range(pp)]
    assert partition_ranges(vllm_default_partition(n, pp)) == ranges


def test_cost_model_at_the_qwen3_8b_shape_by_hand():
    h, inter, kv = 4096, 12288, 8 * 128
    layer = h * h + 2 * h * kv + h * h + 3 * h * inter  # q, k and v, o, gated MLP
    assert target_layer_costs(QWEN3_8B) == [layer] * 36
    parts = draft_macs(DRAFT_8B, k=7, target_hidden=h)
    assert parts["context"] == 5 * h * h + 5 * 2 * h * kv  # fc over 5 taps, each layer's K/V
    assert parts["query"] == 5 * layer
    assert parts["logits"] == pytest.approx(7 / 8 * h * 151936)
    assert parts["markov"] == pytest.approx(7 / 8 * 256 * 151936)
    sb = stage_balance(QWEN3_8B, DRAFT_8B, 7, 2)
    assert sb.lm_head_cost_layers == pytest.approx(h * 151936 / layer)
    assert sb.draft_cost_layers == pytest.approx(sum(parts.values()) / layer)
    assert round(sb.draft_cost_layers, 2) == 8.65 and round(sb.lm_head_cost_layers, 2) == 3.23
    assert sb.default.partition == [18, 18] and sb.best.partition == [24, 12]
    assert sb.improves and sb.export == f"{ENV}=24,12"
    assert sb.best.bottleneck == pytest.approx(24.0) and sb.default.bottleneck > 29
    # a prefill-only producer builds the context part only and computes one logit row a prompt
    producer = stage_balance(QWEN3_8B, DRAFT_8B, 7, 2, context_only=True)
    assert producer.draft_cost_layers == pytest.approx(parts["context"] / layer)
    assert producer.lm_head_cost_layers == 0.0 and not producer.improves


def test_mla_attention_and_moe_layers():
    mla = {
        "hidden_size": 64,
        "num_attention_heads": 2,
        "q_lora_rank": 16,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
    }
    q = 64 * 16 + 16 * 2 * 12
    kv_write = 64 * (32 + 4)
    assert attention_macs(mla) == (q + kv_write + 32 * 2 * (8 + 8) + 2 * 8 * 64, kv_write)
    moe = {
        "hidden_size": 64,
        "intermediate_size": 256,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
    }
    assert not is_moe_layer(moe, 0) and is_moe_layer(moe, 1)
    assert mlp_macs(moe, 0) == 3 * 64 * 256
    assert mlp_macs(moe, 1) == 64 * 8 + 2 * 3 * 64 * 32 + 3 * 64 * 32
    # only the active experts count: more experts add router columns, not expert work
    more = {**moe, "n_routed_experts": 64}
    assert mlp_macs(more, 1) - mlp_macs(moe, 1) == 64 * 56
    qwen_moe = {
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_experts": 4,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    assert [is_moe_layer(qwen_moe, i) for i in range(6)] == [False, True, False, False, False, True]


def test_a_bigger_drafter_moves_layers_off_the_last_stage():
    last_layers, draft_costs = [], []
    for layers in range(1, 13):
        sb = stage_balance(QWEN3_8B, {**DRAFT_8B, "num_hidden_layers": layers}, 7, 2)
        draft_costs.append(sb.draft_cost_layers)
        last_layers.append(sb.best.partition[-1])
    assert all(b > a for a, b in itertools.pairwise(draft_costs))
    assert all(b <= a for a, b in itertools.pairwise(last_layers))
    assert last_layers[-1] < last_layers[0] < 18
    # so does a longer block (more drafted positions: logits and Markov steps), a wider draft
    # vocabulary and a higher Markov rank
    by_k = [stage_balance(QWEN3_8B, DRAFT_8B, k, 2).draft_cost_layers for k in (1, 3, 7, 15)]
    assert all(b > a for a, b in itertools.pairwise(by_k))
    base = stage_balance(QWEN3_8B, DRAFT_8B, 7, 2).draft_cost_layers
    assert stage_balance(QWEN3_8B, {**DRAFT_8B, "markov_rank": 512}, 7, 2).draft_cost_layers > base
    wide = {**DRAFT_8B, "vocab_size": 2 * 151936}
    assert stage_balance(QWEN3_8B, wide, 7, 2).draft_cost_layers > base
    # at PP=4 too, and the measured override moves layers the same way
    pp4 = [stage_balance(QWEN3_8B, DRAFT_8B, 7, 4, draft_cost_layers=x) for x in (0, 4, 9, 20)]
    lasts = [sb.best.partition[-1] for sb in pp4]
    assert all(b <= a for a, b in itertools.pairwise(lasts)) and lasts[-1] < lasts[0]


def test_the_default_split_is_kept_when_nothing_beats_it():
    # no drafter and no LM head (a producer whose drafter was measured at 0): 36 = 18 + 18
    sb = stage_balance(QWEN3_8B, DRAFT_8B, 7, 2, draft_cost_layers=0, context_only=True)
    assert not sb.improves and sb.export is None
    assert sb.best == sb.default and sb.default.partition == [18, 18]
    text = "\n".join(format_stage_balance(sb))
    assert f"keep it (no {ENV})" in text and "export" not in text
    # a drafter too small to move a whole layer: 18 | 18.4 beats 19 | 17.4
    small = stage_balance(QWEN3_8B, DRAFT_8B, 7, 2, draft_cost_layers=0.4, context_only=True)
    assert not small.improves and small.best.partition == [18, 18]


def test_a_measured_drafter_replaces_the_modelled_one():
    sb = stage_balance(QWEN3_8B, DRAFT_8B, 7, 2, draft_cost_layers=20.0)
    assert sb.draft_cost_layers == 20.0 and sb.draft_cost_source.startswith("measured")
    assert sb.default.stage_costs[-1] == pytest.approx(18 + sb.lm_head_cost_layers + 20)
    assert sb.best.partition == [30, 6]  # 30 vs 6 + 3.23 + 20 (29 | 30.23, 31 | 28.23)
    with pytest.raises(ValueError):
        stage_balance(QWEN3_8B, DRAFT_8B, 7, 2, draft_cost_layers=-1.0)


def test_a_split_set_in_the_environment_is_in_effect_and_priced():
    sb = stage_balance(QWEN3_8B, DRAFT_8B, 7, 2, env_partition="20,16")
    assert sb.env_partition == [20, 16] and sb.in_effect.partition == [20, 16]
    assert sb.in_effect.stage_costs[0] == pytest.approx(20.0)
    assert sb.export is None  # nothing to export: the environment's split stays
    assert sb.best.partition == [24, 12]  # still reported, for comparison
    text = "\n".join(format_stage_balance(sb))
    assert f"{ENV}=20,16 is set in this environment and is in effect" in text
    assert "the cost model picks 24,12" in text and "export" not in text
    same = stage_balance(QWEN3_8B, DRAFT_8B, 7, 2, env_partition="24,12")
    assert "the cost model picks the same split" in "\n".join(format_stage_balance(same))
    # without it, the line to export
    text = "\n".join(format_stage_balance(stage_balance(QWEN3_8B, DRAFT_8B, 7, 2)))
    assert f"export {ENV}=24,12" in text and "ESTIMATE" in text
    with pytest.raises(ValueError, match="not 2 layer counts summing to 36"):
        stage_balance(QWEN3_8B, DRAFT_8B, 7, 2, env_partition="20,20")
