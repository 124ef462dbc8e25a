"""Greedy DSpark acceptance computed with vLLM 0.34.0's own Kimi-K3 layers
(``dspark_dev.training.k3_vllm_sim``, in a child process) equals the training modules' simulation
(``train_tiny_pair.simulate_acceptance``; both walk with ``greedy_dspark``), on a seeded random K3
pair whose drafter is overfitted on the measured prompt (so that acceptance is far from 1).

Control: ``simulate_acceptance`` rerun here with the training drafter's RoPE in the NeoX layout
(vLLM's is GPT-J) must disagree with the vLLM-layer result, while the unmutated rerun here equals
it (vLLM's side is computed once: a second child would double the time).

Opt-in (vLLM's K3 layers on CPU, the KDA kernel in Triton's interpreter; about a minute):
``DSPARK_K3_TRAIN_CHECK=1``, as test_k3_equivalence.py.
"""

from __future__ import annotations

import os

import pytest
from support.k3_pair import (
    make_random_k3_pair,
    mutate_training_modules,
    one_torch_thread,
    run_child,
)

NUM_PROMPTS, MAX_NEW = 1, 20

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("DSPARK_K3_TRAIN_CHECK") != "1",
        reason="opt-in: DSPARK_K3_TRAIN_CHECK=1 (vLLM's K3 layers on CPU)",
    ),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("k3-sim-pair") / "pair")
    make_random_k3_pair(path, seed=0, fit_prompts=NUM_PROMPTS, fit_max_new=MAX_NEW)
    return path


@pytest.fixture(scope="module")
def sim(pair, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("k3-sim") / "sim.json")
    argv = ["-m", "dspark_dev.training.k3_vllm_sim", pair, "--num-prompts", str(NUM_PROMPTS)]
    return run_child([*argv, "--max-new", str(MAX_NEW), "--out-json", out], out, timeout=600)


def _training_simulation(pair: str) -> dict:
    from dspark_dev.training.export import load_k3_pair
    from dspark_dev.training.k3_vllm_sim import heldout_prompt_ids
    from dspark_dev.training.train_tiny_pair import simulate_acceptance

    target, draft = load_k3_pair(pair)
    target.eval()
    draft.eval()
    prompts = heldout_prompt_ids(pair, NUM_PROMPTS)
    with one_torch_thread():
        al, per_pos, steps, _ = simulate_acceptance(draft, target, prompts, MAX_NEW, "cpu")
    return {"mean_acceptance_length": al, "per_position_acceptance": per_pos, "steps": steps}


@pytest.mark.timeout(900)
def test_vllm_layers_reproduce_the_training_simulation(sim):
    assert sim["num_prompts"] == NUM_PROMPTS
    assert sim["greedy_equal"] == f"{NUM_PROMPTS}/{NUM_PROMPTS}", sim["greedy_divergences"]
    steps = [
        (p["accepted_per_step_vllm_layers"], p["accepted_per_step_training"])
        for p in sim["per_prompt"]
    ]
    assert all(v == t for v, t in steps), steps
    assert sim["vllm_layers"] == sim["training_modules"]
    assert sim["draft_tokens_equal"] == 1.0, sim["draft_token_differences"]
    # not vacuous: the overfitted drafter gets well past the bonus token alone
    assert sim["vllm_layers"]["mean_acceptance_length"] >= 2.0, sim["vllm_layers"]


@pytest.mark.timeout(900)
def test_k3_sim_catches_a_mutated_training_drafter(pair, sim, monkeypatch):
    assert _training_simulation(pair) == sim["vllm_layers"]
    mutate_training_modules("neox-rope", monkeypatch.setattr)
    assert _training_simulation(pair) != sim["vllm_layers"]
