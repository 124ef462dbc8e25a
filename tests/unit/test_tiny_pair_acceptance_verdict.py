"""benchmarks/tiny_pair_acceptance.py's lossless verdict, with its two vLLM runs replaced by
fixed outputs (pure Python, no engine): float32 must be identical; bfloat16 excuses a first
difference only at a proven near-tie of the no-speculation run's top-2 (dspark_dev.parity)."""

from __future__ import annotations

import json
import sys

import pytest
from support.scripts import load_script

BASE = [[5, 6, 7, 2], [8, 9, 2]]


def _run(monkeypatch, tmp_path, dtype: str, spec_tokens, gap: float) -> tuple[int, dict]:
    bench = load_script("benchmarks/tiny_pair_acceptance.py")

    def fake_run_one(args, spec):
        # top-2 of the reference at request 0, position 1: its own token 6 and the other run's 4
        lp = [[{}, {"6": -0.5, "4": -0.5 - gap}, {}, {}], [{}, {}, {}]]
        return {
            "tokens": spec_tokens if spec else BASE,
            "texts": ["#### 1", "#### 2"],
            "metrics": {"num_drafts": 2, "num_accepted_tokens": 3, "accepted_per_pos": [2, 1]},
            "logprobs": None if spec or dtype == "float32" else lp,
            "generate_s": 0.0,
        }

    monkeypatch.setattr(bench, "run_one", fake_run_one)
    monkeypatch.setattr(bench, "_prompts", lambda n: (["q1", "q2"], [1, 2]))
    out = tmp_path / "r.json"
    monkeypatch.setattr(
        sys, "argv", ["tiny_pair_acceptance.py", "--dtype", dtype, "--out-json", str(out)]
    )
    rc = bench.main()
    return rc, json.loads(out.read_text())


@pytest.mark.parametrize(
    "dtype, spec_tokens, gap, rc",
    [
        ("float32", BASE, 0.0, 0),
        ("float32", [[5, 4, 7, 2], [8, 9, 2]], 0.01, 1),  # exact rule: no near-tie excuse
        ("bfloat16", [[5, 4, 7, 2], [8, 9, 2]], 0.01, 0),  # proven near-tie: excused, reported
        ("bfloat16", [[5, 4, 7, 2], [8, 9, 2]], 1.0, 1),  # a confident token differs
        ("bfloat16", [[5, 6, 7, 2], [8, 9]], 0.0, 1),  # a shorter answer: not excusable
    ],
)
def test_lossless_verdict(monkeypatch, tmp_path, dtype, spec_tokens, gap, rc):
    got_rc, res = _run(monkeypatch, tmp_path, dtype, spec_tokens, gap)
    assert got_rc == rc, res
    assert res["lossless_ok"] is (rc == 0)
    assert bool(res["first_differences"]) is (spec_tokens != BASE)
    if spec_tokens != BASE and rc == 0:
        assert "near-tie (excused)" in res["first_differences"][0]
    assert res["mean_acceptance_length"] == 2.5


def test_vllm_figures_are_recorded_before_the_training_comparison(monkeypatch, tmp_path):
    """A deadline that kills the run inside ``--compare-training`` (the training modules on the
    same prompts) must leave vLLM's acceptance in the JSON: it is written first."""
    bench = load_script("benchmarks/tiny_pair_acceptance.py")
    out = tmp_path / "r.json"

    def fake_run_one(args, spec):
        return {
            "tokens": BASE,
            "texts": ["#### 1", "#### 2"],
            "metrics": {"num_drafts": 2, "num_accepted_tokens": 3, "accepted_per_pos": [2, 1]},
            "logprobs": None,
            "generate_s": 0.0,
        }

    def killed(*a, **k):
        raise KeyboardInterrupt  # what the deadline's signal amounts to here

    monkeypatch.setattr(bench, "run_one", fake_run_one)
    monkeypatch.setattr(bench, "_prompts", lambda n: (["q1", "q2"], [1, 2]))
    monkeypatch.setattr(bench, "compare_training", killed)
    monkeypatch.setattr(
        sys,
        "argv",
        ["tiny_pair_acceptance.py", "--dtype", "float32", "--compare-training"]
        + ["--out-json", str(out)],
    )
    with pytest.raises(KeyboardInterrupt):
        bench.main()
    res = json.loads(out.read_text())
    assert res["mean_acceptance_length"] == 2.5 and res["training_comparison"] == "running"
