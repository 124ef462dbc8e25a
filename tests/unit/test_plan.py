"""`vllm-dspark-pp plan` builds vLLM's configs from config.json files and judges the deployment.

The plans are independent (each call builds fresh configs; the plugin's register() is idempotent),
so the module runs them all in one process (``support.cli_batch``, vLLM imported once); the
TP=3 rejection goes through the real ``python -m vllm_dspark_pp.cli.main`` entry point, exit
status included.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.cli_batch import run_cli_batch

from vllm_dspark_pp.deployment_plan import build_plan_stages, tap_stage


def _plan(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_dspark_pp.cli.main", "plan", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
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
        "nixl_producer_pp1": [
            target,
            *spec,
            "--kv-transfer-config",
            _kv("NixlConnector", "kv_producer"),
        ],
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


def test_plan_rejects_tp_that_does_not_divide_heads_with_vllms_message(tiny_models):
    # the real entry point (`python -m vllm_dspark_pp.cli.main`), in a process of its own
    proc = _plan(tiny_models.target, "--speculative-config", _spec(tiny_models.draft), "-tp", "3")
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
