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
before ``kimi_k3/nvidia/mla.py:455`` splits it.) So ``k3_vllm_probe.py`` runs
``dspark_dev.training.k3_vllm_layers``: vLLM's ``KimiLinearForCausalLM`` and
``K3DSparkForCausalLM`` built in one process, the exported checkpoints loaded through their own
``load_weights``, the forwards composed from vLLM's layers (its docstring names the one reference
piece). The served-engine check (greedy tokens, logprobs and
per-position acceptance) is the GPU command in docs/tiny-pair.md's Kimi-K3 section.

Opt-in (a few minutes on 2 cores: Triton's interpreter runs the KDA kernel):
``DSPARK_K3_TRAIN_CHECK=1``. The control runs the same probe on a training KDA without its short
convolution, and on a drafter with the NeoX RoPE layout, and requires a mismatch.
"""

from __future__ import annotations

import os

import pytest
from support.k3_pair import PROBE, make_random_k3_pair, run_child

TOL = 2e-3

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("DSPARK_K3_TRAIN_CHECK") != "1",
        reason="opt-in: DSPARK_K3_TRAIN_CHECK=1 (vLLM's K3 modules on CPU, minutes)",
    ),
]


def _probe(pair: str, tmp, mutation: str = "") -> dict:
    out = str(tmp / f"probe{mutation}.json")
    return run_child([PROBE, pair, out, mutation], out)


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
