"""One-GPU tests of the DeepSeek-V4 and Kimi-K3 context-KV-only DSpark drafters (marker ``gpu``).

Run on the GPU machine:  pytest -m gpu tests/gpu/test_context_kv_mla_gpu.py -v

For each family a child process (``_context_kv_mla_child.py``, hard timeout) builds, on CUDA and
directly under ``set_current_vllm_config`` (no engine, no DeepSeek-V4/K3 target model), vLLM
0.34.0's full DSpark drafter and our context-KV-only drafter from a generated tiny config, and
checks, each as a named step:

1. ``build_full`` / ``route_and_build_context_only``: both construct on the GPU; the context-only
   class is the one ``families.context_kv_class_for`` picks for the architecture (DeepSeek-V4:
   through vLLM's registry pick of the CUDA implementation).
2. ``context_only_tree``: its parameters are a subset of the full drafter's and none is an
   embedding, head, Markov/confidence head, MLP/MoE, query/output projection, hyper-connection or
   layer norm of the drafting path.
3. ``kv_layer_names_and_specs_equal``: the same draft KV-cache layer names, the same
   attention-layer registry, equal ``KVCacheSpec`` per layer and the same attention backends.
4. ``skipped_weights``: over the generated checkpoint names, exactly the context tensors are kept.
5. ``load_weights``: the context-only drafter loads exactly its parameters (Kimi-K3: the full one
   loads all of its own from the same checkpoint), and the stacked context KV projection equals
   the full drafter's; after post-processing the context-only drafter holds each weight once
   (``drafter.held_weight_bytes`` = its parameter bytes: Kimi-K3's per-layer ``kv_a_layernorm``
   weights are views of vLLM's stacked copy).
6. ``context_kv_written_equal``: both run vLLM's context-KV code (projection, kv norm, RoPE and
   the CUDA cache insert: DeepSeek-V4 ``fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert`` into
   the fp8_ds_mla SWA cache, Kimi-K3 ``concat_and_cache_mla_grouped``) for the same inputs and slot
   mapping into their own zeroed caches; the caches must be bytewise equal and non-empty.
7. ``drafting_refused``: drafting entry points raise ``ContextOnlyDrafterError``.

A failing step fails the test with the child's traceback; nothing here skips except on a machine
without CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_dev.proc import run_with_timeout

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CHILD = HERE / "_context_kv_mla_child.py"
TIMEOUT_S = 240
STEPS = [
    "engine_config",
    "distributed_init",
    "build_full",
    "route_and_build_context_only",
    "context_only_tree",
    "kv_layer_names_and_specs_equal",
    "skipped_weights",
    "load_weights",
    "context_kv_written_equal",
    "drafting_refused",
]


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


needs_cuda = pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from vllm_dspark_pp.tiny_models import make_tiny_models

    # the engine config the drafters are built under (its target/draft HF configs are replaced)
    return make_tiny_models(tmp_path_factory.mktemp("tiny-mla-gpu"), dtype="bfloat16")


def _run_child(family: str, tiny, tmp: Path) -> dict:
    out, log = tmp / f"{family}.json", tmp / f"{family}.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(CHILD), family, str(tiny.target), str(tiny.draft), str(out)]
    with open(log, "wb") as f:
        try:  # own session; the whole process group is killed at the end either way
            run_with_timeout(cmd, timeout=TIMEOUT_S, env=env, stdout=f)
        except subprocess.TimeoutExpired:
            pass
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
    if not out.exists():
        pytest.fail(f"{family} child wrote no report (crash or {TIMEOUT_S}s timeout):\n{tail}")
    report = json.loads(out.read_text())
    print(json.dumps(report["facts"], indent=1)[:6000])
    for name in STEPS:
        result = report["steps"].get(name)
        if result is None:
            pytest.fail(f"{family}: step {name!r} never ran (child died before it):\n{tail}")
        if not result["ok"]:
            pytest.fail(f"{family}: step {name!r} failed:\n{result['error']}")
    assert report.get("done") is True
    return report


@needs_cuda
def test_deepseek_v4_context_only_drafter_on_gpu(tiny, tmp_path):
    report = _run_child("dsv4", tiny, tmp_path)
    facts = report["facts"]
    assert facts["context_class"] == "DSparkDeepseekV4ContextKVForCausalLM"
    assert facts["kv_layers"] == ["model.layers.2.attn.swa_cache", "model.layers.3.attn.swa_cache"]
    assert facts["specs"]["model.layers.2.attn"] == "None"
    assert facts["context_params"] == [
        "model.context_wkv_proj.weight",
        "model.layers.0.attn.kv_norm.weight",
        "model.layers.1.attn.kv_norm.weight",
        "model.main_norm.weight",
        "model.main_proj.weight",
    ]


@needs_cuda
def test_kimi_k3_context_only_drafter_on_gpu(tiny, tmp_path):
    report = _run_child("k3", tiny, tmp_path)
    facts = report["facts"]
    assert facts["context_class"] == "K3DSparkContextKVForCausalLM"
    assert facts["kv_layers"] == ["model.layers.6.self_attn", "model.layers.7.self_attn"]
    assert facts["context_params"] == [
        "model.context_kv_proj.weight",
        "model.context_norm.weight",
        "model.context_proj.weight",
        "model.layers.0.self_attn.kv_a_layernorm.weight",
        "model.layers.1.self_attn.kv_a_layernorm.weight",
    ]
