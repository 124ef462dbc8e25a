"""Seeded tiny Kimi-K3 pairs for the CPU checks against vLLM's K3 layers
(tests/unit/dspark_dev/training/test_k3_equivalence.py, test_k3_vllm_sim.py), the training-module
mutations their controls apply, and the runner of their child processes."""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch

from dspark_dev.training.export import round_to_bf16_, write_k3_pair
from dspark_dev.training.k3_models import K3DraftConfig, K3TargetConfig, TinyK3, TinyK3DSpark

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(REPO, "models", "tiny-pair", "target", "tokenizer.json")
TRAINING_STATE = "training_state.pt"  # read by k3_vllm_probe.py
PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "k3_vllm_probe.py")
MUTATIONS = ("no-conv", "neox-rope")


@contextlib.contextmanager
def one_torch_thread():
    """The tiny K3 training modules run many small ops, which 2 OpenMP threads on 2 busy cores run
    about ten times slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _fit_draft(target, draft, num_prompts: int, max_new: int, steps: int) -> None:
    """Overfit the drafter on the target's greedy continuations of the first held-out prompts (the
    ones ``k3_vllm_sim`` measures), so that their acceptance is far from trivial."""
    from dspark_dev.training import corpus
    from dspark_dev.training.tokenizer import EOS_ID, PAD_ID, PurePythonBPE
    from dspark_dev.training.train_tiny_pair import draft_batch, greedy_generate

    bpe = PurePythonBPE(TOKENIZER)
    probs = corpus.heldout_problems(corpus.DEFAULT_HELDOUT_SIZE)[:num_prompts]
    target.eval()
    seqs, plens = [], []
    for p in probs:
        prompt = bpe.encode(corpus.format_prompt(p.question))
        seqs.append(prompt + greedy_generate(target, prompt, max_new, "cpu") + [EOS_ID])
        plens.append(len(prompt))
    N = draft.dcfg.block_size
    T = max(map(len, seqs)) + N + 1
    ids = torch.full((len(seqs), T), PAD_ID, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
    doc_len = torch.tensor([len(s) for s in seqs])
    M = max(len(s) - 1 - p for s, p in zip(seqs, plens, strict=True))
    # every anchor of every row (a row with fewer repeats its last one)
    anchors = torch.stack(
        [(p + torch.arange(M)).clamp(max=len(s) - 2) for s, p in zip(seqs, plens, strict=True)]
    )
    for p_ in target.parameters():
        p_.requires_grad_(False)
    trainable = [p_ for p_ in draft.parameters() if p_.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=3e-3, weight_decay=0.0)
    draft.train()
    for _ in range(steps):
        loss, _ = draft_batch(
            draft, target, ids, doc_len, anchors, 4.0, (0.1, 0.9, 1.0), contextlib.nullcontext
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    draft.eval()


def make_random_k3_pair(
    out: str, seed: int = 0, fit_prompts: int = 0, fit_max_new: int = 24, fit_steps: int = 60
) -> None:
    """Seeded random pair whose every parameter matters: weights perturbed, norms and the MoE
    correction bias away from their defaults, a nonzero Markov head. ``fit_prompts`` > 0 then
    overfits the drafter on the target's continuations of that many held-out prompts."""
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
    if fit_prompts:
        with one_torch_thread():
            _fit_draft(target, draft, fit_prompts, fit_max_new, fit_steps)
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


def mutate_training_modules(mutation: str, set_attr=setattr) -> None:
    """The controls: a training KDA without its short convolution (``no-conv``), or the drafter's
    RoPE in the NeoX layout instead of vLLM's GPT-J one (``neox-rope``). ``set_attr``: pytest's
    ``monkeypatch.setattr`` in a test process (undone after the test)."""
    import torch.nn.functional as F

    from dspark_dev.training import k3_models

    if mutation == "no-conv":
        set_attr(k3_models.KDA, "short_conv", staticmethod(lambda x, w: F.silu(x)))
    elif mutation == "neox-rope":
        from dspark_dev.training.models import apply_rope

        set_attr(k3_models, "apply_rope_interleaved", apply_rope)
    elif mutation:
        raise ValueError(f"unknown mutation {mutation!r} (known: {MUTATIONS})")


def run_child(argv: list[str], out_json: str, timeout: float = 900) -> dict:
    """Run ``python ARGV`` in its own process (the CPU test environment, this repository first on
    PYTHONPATH, a deadline) and return the JSON it wrote to ``out_json``."""
    from dspark_dev.proc import run_with_timeout
    from support.env import CPU_ENV

    env = {
        **os.environ,
        **CPU_ENV,
        "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    rc, so, se = run_with_timeout([sys.executable, *argv], timeout=timeout, env=env, capture=True)
    assert rc == 0, f"{argv[:2]} failed ({rc}):\n{so[-3000:]}\n{se[-6000:]}"
    with open(out_json) as f:
        return json.load(f)
