"""`vllm-dspark-pp plan` builds vLLM's configs from config.json files and judges the deployment.

The plans are independent (each call builds fresh configs; the plugin's register() is idempotent),
so the module runs them all in one process (``support.cli_batch``, vLLM imported once); the
TP=3 rejection goes through the real ``python -m vllm_dspark_pp.cli.main`` entry point, exit
status included, and so does the plan with ``VLLM_PP_LAYER_PARTITION`` set (an environment of
its own). The stage balance's cost model and split are tested in test_stage_balance.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli_batch import run_cli_batch

from vllm_dspark_pp.deployment_plan import (
    _checkpoint_ships,
    build_plan_stages,
    qwen3_draft_bytes_per_rank,
    stage_global_ranks,
    stage_weight_bytes,
    tap_stage,
    tp_share,
)
from vllm_dspark_pp.stage_balance import stage_balance


def _plan(*args: str, timeout: int = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_dspark_pp.cli.main", "plan", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else {**os.environ, **env},
    )


def _spec(draft: str, k: int = 4) -> str:
    return json.dumps({"method": "dspark", "model": draft, "num_speculative_tokens": k})


def _kv(connector: str, role: str) -> str:
    return json.dumps({"kv_connector": connector, "kv_role": role})


def _batched_plans(target: str, draft: str) -> dict[str, list[str]]:
    """The `plan` arguments of every test below but the entry-point one, by test."""
    spec = ["--speculative-config", _spec(draft)]
    return {
        "pp2_json": [target, *spec, "-pp", "2", "--json"],
        "pp3_text": [target, *spec, "-pp", "3"],
        "pp7": [target, *spec, "-pp", "7"],
        "mooncake_producer_pp2": [
            target,
            *spec,
            "-pp",
            "2",
            "--kv-transfer-config",
            _kv("MooncakeConnector", "kv_producer"),
        ],
        "nixl_producer_pp2": [
            target,
            *spec,
            "-pp",
            "2",
            "--kv-transfer-config",
            _kv("NixlConnector", "kv_producer"),
        ],
        "pp2_tp2_json": [target, *spec, "-pp", "2", "-tp", "2", "--json"],
        "pp2_tp2_text": [target, *spec, "-pp", "2", "-tp", "2"],
        "mooncake_producer_pp2_tp2_json": [
            target,
            *spec,
            "-pp",
            "2",
            "-tp",
            "2",
            "--kv-transfer-config",
            _kv("MooncakeConnector", "kv_producer"),
            "--json",
        ],
        "nixl_producer_pp1": [
            target,
            *spec,
            "--kv-transfer-config",
            _kv("NixlConnector", "kv_producer"),
        ],
        "pp2_measured_draft_json": [
            target,
            *spec,
            "-pp",
            "2",
            "--draft-cost-layers",
            "0",
            "--json",
        ],
        "pp1_measured_draft": [target, *spec, "--draft-cost-layers", "2"],
        "negative_draft_cost": [target, *spec, "-pp", "2", "--draft-cost-layers", "-1"],
        "tp3": [target, *spec, "-tp", "3"],
    }


@pytest.fixture(scope="module")
def plans(tiny_models, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Each batched `plan` call's result (exit status, stdout, stderr), by the key above."""
    calls = _batched_plans(tiny_models.target, tiny_models.draft)
    done = run_cli_batch(
        [["plan", *argv] for argv in calls.values()],
        timeout=480,
        tmp_dir=tmp_path_factory.mktemp("plan_batch"),
    )
    return dict(zip(calls, done, strict=True))


def test_plan_accepts_pp2_dspark_and_places_taps_and_drafter(plans):
    proc = plans["pp2_json"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = json.loads(proc.stdout[proc.stdout.index("{\n") :])
    assert plan["accepted"] is True
    assert plan["pp_size"] == 2 and plan["method"] == "dspark"
    assert plan["draft_architecture"] == "Qwen3DSparkModel"
    assert plan["draft_pp_size"] == 1  # DSpark drafts with a draft-local PP=1 config
    # draft target_layer_ids (1, 3, 5) -> aux taps (2, 4, 6); 6 layers split 0-2 | 3-5
    assert plan["aux_tap_ids"] == [2, 4, 6]
    s0, s1 = plan["stages"]
    assert s0["layers"] == [0, 3] and s1["layers"] == [3, 6]
    assert s0["aux_taps"] == [2] and s1["aux_taps"] == [4, 6]
    assert s1["drafts"] and not s0["drafts"]
    assert s0["relay_out_taps"] == [2] and s0["relay_bytes_per_token"] > 0
    # judged as a GPU deployment: what the CPU platform could not check is listed
    assert any("CUDA graph" in n for n in plan["not_checked"])


def test_plan_text_output_names_the_verdict(plans):
    proc = plans["pp3_text"]
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "verdict     ACCEPTED" in proc.stdout
    assert "not checked on this machine (GPU-only)" in proc.stdout


def test_plan_rejects_tp_that_does_not_divide_heads_with_vllms_message(plans):
    # batched (the real entry point in a process of its own: the partition test below)
    proc = plans["tp3"]
    assert proc.returncode == 1
    assert "REJECTED" in proc.stdout
    assert "divisible by tensor parallel size (3)" in proc.stdout


def test_plan_rejects_more_stages_than_layers(plans):
    proc = plans["pp7"]
    assert proc.returncode == 1
    assert "REJECTED" in proc.stdout and "without target layers" in proc.stdout


def test_tap_stage_follows_vllms_capture_point():
    ranges = [(0, 3), (3, 6)]
    assert tap_stage(0, ranges) == 0  # embedding output
    assert tap_stage(3, ranges) == 0  # captured after layer 2
    assert tap_stage(4, ranges) == 1
    with pytest.raises(ValueError):
        tap_stage(8, ranges)


def test_relay_carries_earlier_taps_through_every_later_boundary():
    stages = build_plan_stages(6, 3, [2, 4, 6], hidden_size=8, dtype_bytes=2)
    assert [s.relay_out_taps for s in stages] == [[2], [2, 4], []]
    assert [s.relay_bytes_per_token for s in stages] == [16, 32, 0]
    # VLLM_DSPARK_PP_TAP_PARTIALS=auto (boundary 1->2 carries two taps): one row per boundary
    assert [s.partial_relay_bytes_per_token for s in stages] == [16, 16, 0]


def test_tap_partials_are_shown_only_where_auto_would_switch_them_on():
    """One tap per boundary: ``auto`` keeps raw taps, so the plan shows no partial figure (the
    control of the line above); three taps on stage 0 of a PP=2 Qwen3-8B-like target: 3 rows
    become one row of the drafter's width."""
    one_each = build_plan_stages(6, 2, [2, 6], hidden_size=8, dtype_bytes=2)
    assert [s.partial_relay_bytes_per_token for s in one_each] == [16, 0]
    three = build_plan_stages(36, 2, [2, 10, 17, 27], hidden_size=4096, dtype_bytes=2)
    assert three[0].relay_out_taps == [2, 10, 17] and three[0].relay_bytes_per_token == 3 * 8192
    assert three[0].partial_relay_bytes_per_token == 8192
    wide = build_plan_stages(36, 2, [2, 10], 4096, 2, partial_width=2048)
    assert wide[0].partial_relay_bytes_per_token == 4096


def test_plan_shows_context_only_draft_bytes_for_a_mooncake_producer(plans):
    proc = plans["mooncake_producer_pp2"]
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "this role builds: context-KV-only drafter (prefill-only producer)" in proc.stdout
    assert "draft bytes: full drafter" in proc.stdout


def test_plan_flags_nixl_with_a_pp2_dspark_producer(plans):
    proc = plans["nixl_producer_pp2"]
    assert proc.returncode == 1
    assert "NotImplementedError" in proc.stdout and "MooncakeConnector" in proc.stdout


def test_plan_accepts_nixl_with_a_pp1_dspark_producer(plans):
    proc = plans["nixl_producer_pp1"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "verdict     ACCEPTED" in proc.stdout
    assert "this role builds: context-KV-only drafter (prefill-only producer)" in proc.stdout
    assert (
        "nixl: NixlConnector with a DSpark prefill-only producer at PP=1: accepted" in proc.stdout
    )


# ------------------------------------------------------------------ TP x PP
def _json(proc) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{\n") :])


def _dtype_bytes(plan: dict) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[plan["dtype"]]


def _target_bytes_per_rank(target: str, tp: int, b: int) -> tuple[int, int]:
    """One TP rank's bytes of stage 0 and stage 1 of a Qwen3 target over PP=2, by hand from its
    config.json: q, o and the MLP divided by TP; a rank holds max(1, kv_heads // tp) KV heads;
    norms whole; the vocab-parallel embedding (first stage) and LM head (last stage; its own copy
    of the embedding when tied) divided by TP; the final norm on the last stage."""
    c = json.loads((Path(target) / "config.json").read_text())
    h, hd, nq, nkv = (
        c["hidden_size"],
        c["head_dim"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
    )
    matrices = h * nq * hd * 2 + 3 * h * c["intermediate_size"]
    kv = 2 * h * nkv * hd * max(1, nkv // tp) / nkv
    layer = (matrices / tp + kv + 2 * h + 2 * hd) * b
    per_stage = c["num_hidden_layers"] // 2
    vocab = c["vocab_size"] * h * b / tp
    return int(per_stage * layer + vocab), int(per_stage * layer + h * b + vocab)


def test_plan_tp2_pp2_places_global_ranks_and_divides_weights_and_drafter(plans, tiny_models):
    plan = _json(plans["pp2_tp2_json"])
    b = _dtype_bytes(plan)
    assert (plan["tp_size"], plan["pp_size"]) == (2, 2) and plan["accepted"] is True
    s0, s1 = plan["stages"]
    assert s0["global_ranks"] == [0, 1] and s1["global_ranks"] == [2, 3]
    assert s0["layers"] == [0, 3] and s1["layers"] == [3, 6]
    assert (s0["weight_bytes_per_rank"], s1["weight_bytes_per_rank"]) == (
        _target_bytes_per_rank(tiny_models.target, 2, b)
    )
    assert s0["draft_bytes_per_rank"] is None
    whole = _json(plans["pp2_json"])["stages"]
    assert [s["weight_bytes_per_rank"] for s in whole] == list(
        _target_bytes_per_rank(tiny_models.target, 1, b)
    )
    hf = json.loads((Path(tiny_models.draft) / "config.json").read_text())
    ships = _checkpoint_ships(tiny_models.draft)
    assert whole[1]["draft_bytes_per_rank"] == qwen3_draft_bytes_per_rank(hf, b, *ships, 1)["full"]
    assert s1["draft_bytes_per_rank"] == qwen3_draft_bytes_per_rank(hf, b, *ships, 2)["full"]
    assert s1["draft_bytes_per_rank"] < whole[1]["draft_bytes_per_rank"]
    assert plan["extra"]["draft bytes per TP rank"].startswith("full drafter")


def test_plan_tp2_text_has_the_per_rank_table(plans):
    proc = plans["pp2_tp2_text"]
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = proc.stdout
    assert "parallel    PP=2 TP=2 (4 ranks)" in out
    assert "stage  global ranks      target weights  drafter         weights + drafter" in out
    s0, s1 = _json(plans["pp2_tp2_json"])["stages"]
    w0, w1, d1 = (f"{x / 2**20:.2f} MiB" for x in (s0["weight_bytes_per_rank"],
                  s1["weight_bytes_per_rank"], s1["draft_bytes_per_rank"]))  # fmt: skip
    total = f"{(s1['weight_bytes_per_rank'] + s1['draft_bytes_per_rank']) / 2**20:.2f} MiB"
    assert f"    0  [0, 1]            {w0:<14}  -               {w0}" in out, out
    assert f"    1  [2, 3]            {w1:<14}  {d1:<14}  {total}" in out, out


def test_plan_tp2_producer_holds_the_context_only_drafter_per_rank(plans, tiny_models):
    plan = _json(plans["mooncake_producer_pp2_tp2_json"])
    last = plan["stages"][-1]
    from vllm_dspark_pp.producer.memory import draft_param_bytes

    hf = json.loads((Path(tiny_models.draft) / "config.json").read_text())
    c = draft_param_bytes(hf, role="kv_both", dtype_bytes=_dtype_bytes(plan))["components"]
    nkv = hf["num_key_value_heads"]
    kv_per_rank = c["layers.kv_proj"] * max(1, nkv // 2) // nkv
    # fc (replicated), hidden norm, this rank's K/V rows, the K norms: no fused copy, no layers
    want = c["fc"] + c["hidden_norm"] + kv_per_rank + c["layers.k_norm"]
    assert last["draft_bytes_per_rank"] == want
    assert plan["extra"]["this role builds"].startswith("context-KV-only drafter")


def test_stage_global_ranks_follow_vllms_layout():
    assert stage_global_ranks(2, 2) == [[0, 1], [2, 3]]
    assert stage_global_ranks(3, 1) == [[0], [1], [2]]
    assert stage_global_ranks(2, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_tp_share_keeps_vectors_routers_and_scarce_kv_heads_whole():
    assert tp_share("model.layers.0.mlp.up_proj.weight", 2, 4, 8) == 0.25
    assert tp_share("model.layers.0.input_layernorm.weight", 1, 4, 8) == 1.0
    assert tp_share("model.layers.0.mlp.gate.weight", 2, 4, 8) == 1.0  # MoE router
    assert tp_share("model.layers.0.mlp.gate_proj.weight", 2, 4, 8) == 0.25
    assert tp_share("model.layers.0.self_attn.k_proj.weight", 2, 4, 8) == 0.25
    assert tp_share("model.layers.0.self_attn.k_proj.weight", 2, 4, 2) == 0.5  # 1 head of 2
    assert tp_share("model.layers.0.self_attn.v_proj.weight", 2, 8, 1) == 1.0  # replicated
    assert tp_share("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", 2, 4, 8) == 1.0
    assert tp_share("model.layers.0.mlp.up_proj.weight", 2, 1, 8) == 1.0


def test_stage_weight_bytes_places_embedding_layers_and_head():
    t = {
        "model.embed_tokens.weight": ("BF16", [10, 4]),
        "model.layers.0.mlp.up_proj.weight": ("BF16", [8, 4]),
        "model.layers.1.mlp.up_proj.weight": ("BF16", [8, 4]),
        "model.layers.1.input_layernorm.weight": ("BF16", [4]),
        "model.norm.weight": ("BF16", [4]),
        "lm_head.weight": ("BF16", [10, 4]),
        "mtp.0.attn.wq.weight": ("F8_E4M3", [4, 4]),  # a drafter in the target: 1 byte kept
    }
    # dtype bytes 2; TP=2: matrices halved, vectors whole
    assert stage_weight_bytes(t, [(0, 1), (1, 2)], 2, 1, 2) == [40 + 32, 32 + 8 + 8 + 40 + 8]
    assert stage_weight_bytes(t, [(0, 2)], 1, 1, 2) == [80 + 64 + 64 + 8 + 8 + 80 + 16]
    del t["lm_head.weight"]  # tied: the last stage builds its own copy of the embedding
    tied = stage_weight_bytes(t, [(0, 1), (1, 2)], 2, 1, 2, tied_embeddings=True)
    assert tied == [40 + 32, 32 + 8 + 8 + 8 + 40]


def test_draft_bytes_per_rank_at_tp1_is_the_familys_rule_and_splits_at_tp2(tiny_models):
    from vllm_dspark_pp.producer.memory import draft_load_bytes, draft_param_bytes

    hf = json.loads((Path(tiny_models.draft) / "config.json").read_text())
    own_embed, own_head = _checkpoint_ships(tiny_models.draft)
    whole = draft_load_bytes(hf, 4, own_embed, own_head)
    one = qwen3_draft_bytes_per_rank(hf, 4, own_embed, own_head, 1)
    assert one == {"full": whole["full"], "context_only": whole["context_only"]}
    two = qwen3_draft_bytes_per_rank(hf, 4, own_embed, own_head, 2)
    c = draft_param_bytes(hf, role="kv_both", dtype_bytes=4)["components"]
    nkv = hf["num_key_value_heads"]
    kv_per_rank = c["layers.kv_proj"] * max(1, nkv // 2) // nkv
    assert two["context_only"] == c["fc"] + c["hidden_norm"] + kv_per_rank + c["layers.k_norm"]
    assert one["full"] / 2 < two["full"] < one["full"]
    # four KV heads over two ranks: each holds half the K/V rows
    four = {**hf, "num_key_value_heads": 4, "num_attention_heads": 4}
    c4 = draft_param_bytes(four, role="kv_both", dtype_bytes=4)["components"]
    got = qwen3_draft_bytes_per_rank(four, 4, own_embed, own_head, 2)["context_only"]
    assert got == c4["fc"] + c4["hidden_norm"] + c4["layers.kv_proj"] // 2 + c4["layers.k_norm"]


# ------------------------------------------------------------------ stage balance (issue 44 item 3)
def _configs(tiny_models) -> tuple[dict, dict]:
    """The tiny target's and draft's config.json."""
    target, draft = (
        json.loads((Path(d) / "config.json").read_text())
        for d in (tiny_models.target, tiny_models.draft)
    )
    return target, draft


def test_plan_json_recommends_a_layer_partition_from_the_cost_model(plans, tiny_models):
    plan = _json(plans["pp2_json"])
    lp = plan["layer_partition"]
    want = stage_balance(*_configs(tiny_models), 4, 2)  # the same model on the config.json files
    assert lp["default"]["partition"] == [3, 3] and lp["best"]["partition"] == [5, 1]
    assert lp["best"] == want.to_dict()["best"] and lp["default"] == want.to_dict()["default"]
    assert lp["improves"] is True and lp["export"] == "VLLM_PP_LAYER_PARTITION=5,1"
    assert lp["best"]["bottleneck"] < lp["default"]["bottleneck"]
    assert lp["draft_cost_source"] == "cost model" and lp["env_partition"] is None
    assert lp["draft_cost_layers"] == pytest.approx(want.draft_cost_layers)
    # only recommended: the stages vLLM would build are still its default split
    assert [s["layers"] for s in plan["stages"]] == [[0, 3], [3, 6]]
    # the memory the split moves: target weights per rank under both splits
    assert lp["default_weight_bytes_per_rank"] == [
        s["weight_bytes_per_rank"] for s in plan["stages"]
    ]
    assert lp["best_weight_bytes_per_rank"][0] > lp["default_weight_bytes_per_rank"][0]


def test_plan_text_prints_the_line_to_export_with_the_stage_costs(plans, tiny_models):
    out = plans["pp3_text"].stdout
    want = stage_balance(*_configs(tiny_models), 4, 3)
    assert want.improves
    assert "stage balance: an ESTIMATE from a cost model, not a measurement" in out
    part = ",".join(map(str, want.best.partition))
    assert f"to use it:   export VLLM_PP_LAYER_PARTITION={part}" in out, out
    default = " | ".join(f"{c:.2f}" for c in want.default.stage_costs)
    assert f"vLLM's default             2,2,2          {default}" in out, out
    assert "measure before relying on it" in out


def test_plan_takes_a_measured_drafter_and_keeps_the_default_when_nothing_beats_it(plans):
    lp = _json(plans["pp2_measured_draft_json"])["layer_partition"]
    assert lp["draft_cost_layers"] == 0.0 and lp["draft_cost_source"].startswith("measured")
    # 3 | 3 + LM head 0.89 is below 4 | 2.89: the default split stays
    assert lp["improves"] is False and lp["export"] is None
    assert lp["best"] == lp["default"] and lp["default"]["partition"] == [3, 3]


def test_plan_refuses_a_negative_draft_cost(plans):
    proc = plans["negative_draft_cost"]
    assert proc.returncode == 2
    assert "a number of target layers >= 0" in proc.stderr


def test_plan_at_pp1_computes_no_stage_balance(plans):
    proc = plans["pp1_measured_draft"]
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "stage balance: not computed (it needs PP > 1 and a DSpark draft)" in proc.stdout
    assert "VLLM_PP_LAYER_PARTITION=" not in proc.stdout


def test_plan_respects_a_partition_set_in_the_environment(tiny_models):
    # the real entry point, in a process of its own with the variable set (vLLM reads it there)
    proc = _plan(
        tiny_models.target,
        "--speculative-config",
        _spec(tiny_models.draft),
        "-pp",
        "2",
        env={"VLLM_PP_LAYER_PARTITION": "2,4"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "    0  [  0,   2)" in out and "    1  [  2,   6)" in out  # vLLM built the stages so
    assert "VLLM_PP_LAYER_PARTITION=2,4 is set in this environment and is in effect" in out
    assert "the cost model picks 5,1" in out
    assert "export VLLM_PP_LAYER_PARTITION" not in out
    assert "in effect (environment)    2,4" in out, out
