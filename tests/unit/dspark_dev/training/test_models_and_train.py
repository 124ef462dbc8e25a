"""Training-side invariants: batched blocks == one block at a time, loss terms, and a CPU smoke run
of
the training command (tiny step counts) that writes a loadable pair."""

import argparse
import json
import os

import torch

from dspark_dev.training.export import load_pair
from dspark_dev.training.models import (
    DraftConfig,
    TargetConfig,
    TinyDSparkDraft,
    TinyQwen3,
    dspark_loss,
    position_weights,
)


def _pair(seed=0):
    torch.manual_seed(seed)
    tcfg, dcfg = (
        TargetConfig(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        DraftConfig(
            num_hidden_layers=2,
            intermediate_size=96,
            num_attention_heads=2,
            num_key_value_heads=1,
            target_layer_ids=[0, 2],
        ),
    )
    t, d = TinyQwen3(tcfg), TinyDSparkDraft(tcfg, dcfg)
    d.init_from_target(t)
    with torch.no_grad():
        for p in list(t.parameters()) + list(d.parameters()):
            p.add_(torch.randn_like(p) * 0.1)
    return t.eval(), d.eval()


def test_batched_blocks_equal_single_blocks():
    t, d = _pair()
    ids = torch.randint(3, 64, (2, 40))
    with torch.no_grad():
        _, _, aux = t(ids, d.aux_layer_ids)
        ctx = d.context(aux)
        anchors = torch.tensor([[5, 17, 30], [1, 9, 33]])
        lg, conf, hid = d(ids, ctx, anchors, t.embed_tokens.weight)
        for b in range(2):
            for m in range(3):
                lg1, conf1, hid1 = d(
                    ids[b : b + 1],
                    ctx[b : b + 1],
                    anchors[b : b + 1, m : m + 1],
                    t.embed_tokens.weight,
                )
                torch.testing.assert_close(hid[b, m], hid1[0, 0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(lg[b, m], lg1[0, 0], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(conf[b, m], conf1[0, 0], atol=1e-5, rtol=1e-5)


def test_context_after_anchor_is_invisible():
    t, d = _pair(1)
    ids = torch.randint(3, 64, (1, 30))
    with torch.no_grad():
        _, _, aux = t(ids, d.aux_layer_ids)
        ctx = d.context(aux)
        a = torch.tensor([[12]])
        _, _, h1 = d(ids, ctx, a, t.embed_tokens.weight)
        ctx2 = ctx.clone()
        ctx2[:, 12:] = torch.randn_like(ctx2[:, 12:])
        ids2 = ids.clone()
        ids2[:, 13:] = 5  # tokens after the anchor only reach the teacher-forced Markov input
        _, _, h2 = d(ids2, ctx2, a, t.embed_tokens.weight)
    torch.testing.assert_close(h1, h2)


def test_dspark_loss_terms():
    torch.manual_seed(0)
    B, M, N, V = 2, 3, 7, 11
    logits = torch.randn(B, M, N, V)
    probs = logits.softmax(-1)
    labels = logits.argmax(-1)
    valid = torch.ones(B, M, N, dtype=torch.bool)
    conf = torch.full((B, M, N), 10.0)
    _, parts = dspark_loss(logits, conf, labels, probs, valid, gamma=4.0)
    assert parts["tv"].item() < 1e-6  # draft == target distribution
    assert parts["conf"].item() < 1e-3  # label 1 - TV = 1, confident logit
    other = torch.randn(B, M, N, V).softmax(-1)
    _, parts2 = dspark_loss(logits, conf, labels, other, valid, gamma=4.0)
    assert 0 < parts2["tv"].item() <= 1
    w = position_weights(N, 4.0)
    assert w[0] == 1 and torch.all(w[1:] < w[:-1])
    # invalid positions do not count
    valid2 = valid.clone()
    valid2[..., 3:] = False
    logits_bad = logits.clone()
    logits_bad[..., 3:, :] = 1e4 * torch.randn_like(logits_bad[..., 3:, :])
    _, p_a = dspark_loss(logits, conf, labels, other, valid2, gamma=4.0)
    _, p_b = dspark_loss(logits_bad, conf, labels, other, valid2, gamma=4.0)
    torch.testing.assert_close(p_a["ce"], p_b["ce"])


def test_train_command_cpu_smoke(tmp_path):
    from dspark_dev.training.train_tiny_pair import add_arguments, main

    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp_path / "pair"
    args = p.parse_args(
        [
            "--device",
            "cpu",
            "--out",
            str(out),
            "--num-train-docs",
            "200",
            "--heldout-docs",
            "8",
            "--batch-size",
            "4",
            "--target-steps",
            "2",
            "--draft-steps",
            "2",
            "--eval-every",
            "1",
            "--eval-prompts",
            "1",
            "--target-layers",
            "2",
            "--draft-layers",
            "1",
            "--target-inter",
            "64",
            "--draft-inter",
            "64",
            "--hidden",
            "64",
        ]
    )
    assert main(args) == 0
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["target_steps_run"] == 2 and summary["draft_steps_run"] == 2
    assert 1.0 <= summary["simulated_mean_acceptance_length"] <= 8.0
    for sub in ("target", "dspark-draft"):
        files = os.listdir(out / sub)
        assert {"config.json", "tokenizer.json", "tokenizer_config.json", "training.json"} <= set(
            files
        )
    cfg = json.loads((out / "dspark-draft" / "config.json").read_text())
    assert cfg["architectures"] == ["DSparkDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"]["mask_token_id"] == 1 and cfg["block_size"] == 7
    t, d = load_pair(str(out))
    assert d.dcfg.target_layer_ids == [0, 1]
