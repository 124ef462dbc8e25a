"""The training modules compute what vLLM 0.34.0 computes at inference, on the same weights.

A random-ish pair (seeded; weights perturbed so that every parameter, the Markov head and the
mask row included, matters) is written with ``export.write_pair`` and served by CPU vLLM with
DSpark k=7 (subprocess, hard timeout). For every draft step vLLM took, the training-side
``TinyDSparkDraft.draft_greedy`` on the same verified tokens must give the same drafts, the same
base logits and the same confidences; the target's greedy continuation must equal vLLM's output.
"""

import json
import os
import sys

import pytest
import torch
from support.env import CPU_E2E_EXTRA, CPU_ENV

from dspark_dev.proc import run_with_timeout
from dspark_dev.training.export import load_pair, write_pair
from dspark_dev.training.models import DraftConfig, TargetConfig, TinyDSparkDraft, TinyQwen3

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
TOKENIZER = os.path.join(REPO, "models", "tiny-pair", "target", "tokenizer.json")


def make_random_pair(out: str, seed: int = 0) -> None:
    torch.manual_seed(seed)
    tcfg, dcfg = TargetConfig(vocab_size=448), DraftConfig()
    target, draft = TinyQwen3(tcfg), TinyDSparkDraft(tcfg, dcfg)
    draft.init_from_target(target)
    with torch.no_grad():
        for p in list(target.parameters()) + list(draft.parameters()):
            p.add_(torch.randn_like(p) * 0.2)
    write_pair(
        out,
        target,
        draft,
        TOKENIZER,
        {"target_config": tcfg.to_dict(), "draft_config": dcfg.to_dict()},
    )


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_training_draft_matches_vllm(tmp_path):
    pair = str(tmp_path / "pair")
    make_random_pair(pair)
    rec_path = str(tmp_path / "records.json")
    env = {
        **os.environ,
        **CPU_ENV,
        **CPU_E2E_EXTRA,
        "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    rc, out, err = run_with_timeout(
        [
            sys.executable,
            os.path.join(HERE, "vllm_draft_probe.py"),
            pair,
            rec_path,
            "Question: Tom has 3 apples.",
            "24",
        ],
        env=env,
        capture=True,
        timeout=800,
    )
    assert rc == 0, out[-3000:] + err[-6000:]
    rec = json.load(open(rec_path))
    target, draft = load_pair(pair)
    target.eval()
    draft.eval()
    seq = torch.tensor(rec["prompt"] + rec["out"])
    P = len(rec["prompt"])
    with torch.no_grad():
        logits, _, _ = target(seq.view(1, -1))
    assert logits[0, P - 1 : -1].argmax(-1).tolist() == rec["out"], (
        "vLLM greedy output != training target greedy"
    )
    assert len(rec["records"]) >= 10
    worst = 0.0
    for r in rec["records"]:
        a = r["pos"][0]
        assert r["pos"] == list(range(a, a + 7)), r["pos"]  # anchor-as-first-prediction block
        assert r["ids"][0] == int(seq[a]) and all(
            t == draft.dcfg.mask_token_id for t in r["ids"][1:]
        )
        drafts, base, conf = draft.draft_greedy(target, seq, a)
        assert drafts.tolist() == r["draft"], (a, drafts.tolist(), r["draft"])
        vb = torch.tensor(r["base"])
        worst = max(worst, ((base - vb).abs().max() / vb.abs().max()).item())
        torch.testing.assert_close(conf, torch.tensor(r["conf"]), atol=1e-4, rtol=1e-4)
    assert worst < 1e-4, f"relative base-logit error {worst}"
