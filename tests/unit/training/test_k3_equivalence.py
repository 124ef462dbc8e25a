"""The Kimi-K3 training modules (dspark_dev/training/k3_models.py) compute what vLLM 0.34.0's
Kimi-K3 modules compute on the same weights (CPU, float32).

Not through an engine: vLLM 0.34.0's CPU engine cannot serve Kimi-K3 on CPUs without AMX tiles
(this one): the reference CPU MLA backend takes block size 16 only
(``v1/attention/backends/mla/cpu_mla.py:67-72``, ``platforms/cpu.py:290-297``) while a hybrid MLA
model's KV block is aligned to at least 128 (``platforms/interface.py:1096-1100``), which
``platforms/interface.py:807-834`` refuses; past that (forced in a probe), the KDA prefill path
asserts a CUDA tensor (``model_executor/layers/mamba/ops/gather_initial_states.py:52``) and its
chunked Triton kernels do not run in Triton's interpreter. (Also on the way: the CuTe GEMM-AR
import needs ``VLLM_KIMI_K3_GEMM_AR=0``, and the CPU linear repack empties ``kv_b_proj.weight``
before ``kimi_k3/nvidia/mla.py:455`` splits it.) So ``k3_vllm_probe.py`` builds vLLM's
``KimiLinearForCausalLM`` and ``K3DSparkForCausalLM`` in one process, loads the exported
checkpoints through their own ``load_weights`` and composes the forwards from vLLM's layers (its
docstring names the one reference piece). The served-engine check (greedy tokens, logprobs and
per-position acceptance) is the GPU command in docs/tiny-pair.md's Kimi-K3 section.

Opt-in (a few minutes on 2 cores: Triton's interpreter runs the KDA kernel):
``DSPARK_K3_TRAIN_CHECK=1``. The control runs the same probe on a training KDA without its short
convolution, and on a drafter with the NeoX RoPE layout, and requires a mismatch.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import support
import torch
from support.env import CPU_ENV

from dspark_dev.proc import run_with_timeout
from dspark_dev.training.export import round_to_bf16_, write_k3_pair
from dspark_dev.training.k3_models import K3DraftConfig, K3TargetConfig, TinyK3, TinyK3DSpark

HERE = os.path.dirname(os.path.abspath(__file__))
# The probe is a script run in its own process (tests/support: the one home of test helpers).
PROBE = os.path.join(os.path.dirname(os.path.abspath(support.__file__)), "k3_vllm_probe.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
TOKENIZER = os.path.join(REPO, "models", "tiny-pair", "target", "tokenizer.json")
TOL = 2e-3
TRAINING_STATE = "training_state.pt"  # read by k3_vllm_probe.py

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("DSPARK_K3_TRAIN_CHECK") != "1",
        reason="opt-in: DSPARK_K3_TRAIN_CHECK=1 (vLLM's K3 modules on CPU, minutes)",
    ),
]


def make_random_k3_pair(out: str, seed: int = 0) -> None:
    """Seeded random pair whose every parameter matters: weights perturbed, norms and the MoE
    correction bias away from their defaults, a nonzero Markov head."""
    torch.manual_seed(seed)
    tcfg, dcfg = K3TargetConfig(vocab_size=448), K3DraftConfig()
    target, draft = TinyK3(tcfg), TinyK3DSpark(tcfg, dcfg)
    with torch.no_grad():
        for p in list(target.parameters()) + list(draft.parameters()):
            p.add_(torch.randn_like(p) * 0.05)
        for layer in target.layers:
            if layer.is_moe:
                layer.block_sparse_moe.e_score_correction_bias.normal_(0, 0.1)
        target.embed_tokens.weight.mul_(20)  # RMSNorm-ed anyway; exercises the residual scale
    draft.init_from_target(target)
    with torch.no_grad():
        draft.mask_embedding.normal_(0, 1.0)
    round_to_bf16_(target, draft)  # the values the bfloat16 checkpoint holds
    # the modules as trained (their own parameter layout): the probe compares vLLM against these,
    # so a layout slip in hf_state_dict / vllm_state_dict cannot hide behind the loader
    os.makedirs(out, exist_ok=True)
    torch.save(
        {"target": target.state_dict(), "draft": draft.state_dict()},
        os.path.join(out, TRAINING_STATE),
    )
    write_k3_pair(
        out,
        target,
        draft,
        TOKENIZER,
        {"target_config": tcfg.to_dict(), "draft_config": dcfg.to_dict()},
    )


def _probe(pair: str, tmp, mutation: str = "") -> dict:
    out = str(tmp / f"probe{mutation}.json")
    env = {
        **os.environ,
        **CPU_ENV,
        "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    rc, so, se = run_with_timeout(
        [sys.executable, PROBE, pair, out, mutation],
        timeout=900,
        env=env,
        capture=True,
    )
    assert rc == 0, f"probe failed ({rc}):\n{so[-3000:]}\n{se[-6000:]}"
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("k3-pair") / "pair")
    make_random_k3_pair(path)
    return path


@pytest.mark.timeout(1200)
def test_k3_training_modules_match_vllm(pair, tmp_path):
    rep = _probe(pair, tmp_path)
    assert rep["unloaded_target"] == [] and rep["unloaded_draft"] == [], rep
    bad = {k: v for k, v in rep["max_abs_diff"].items() if not v <= TOL}
    assert not bad, f"training module != vLLM module: {bad}"
    # every compared output is far from zero, so the tolerance is not vacuous
    small = {k: v for k, v in rep["max_abs_training"].items() if not v > 100 * TOL}
    assert not small, f"outputs too small to compare: {small}"
    assert rep["greedy_vllm_modules"] == rep["greedy_training"]
    assert rep["draft_greedy_vllm_modules"] == rep["draft_greedy_training"]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("mutation,component", [("no-conv", "kda"), ("neox-rope", "draft_logits")])
def test_k3_probe_catches_a_mutated_training_module(pair, tmp_path, mutation, component):
    rep = _probe(pair, tmp_path, mutation)
    assert rep["max_abs_diff"][component] > 10 * TOL, rep["max_abs_diff"]
