"""benchmarks/tiny_pair_acceptance.py's lossless verdict, with its two vLLM runs replaced by
fixed outputs (pure Python, no engine): float32 must be identical; bfloat16 excuses a first
difference only at a proven near-tie of the no-speculation run's top-2 (dspark_dev.parity)."""

from __future__ import annotations

import json
import sys

import pytest

BASE = [[5, 6, 7, 2], [8, 9, 2]]


def _run(monkeypatch, tmp_path, dtype: str, spec_tokens, gap: float) -> tuple[int, dict]:
    from benchmarks import tiny_pair_acceptance as bench

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
    from benchmarks import tiny_pair_acceptance as bench

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


def test_training_device_probe(monkeypatch):
    """The training comparison runs on CUDA only when a tiny ``solve_triangular`` works there (the
    GPU kit's torch lacked libtorch_cuda_linalg.so, which K3's kda_chunked needs); else on CPU,
    with the reason recorded."""
    import torch

    from benchmarks import tiny_pair_acceptance as bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.training_device() == ("cpu", "")

    def no_linalg(*a, **k):
        raise RuntimeError("Error in dlopen: libtorch_cuda_linalg.so: cannot open shared object")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "eye", lambda n, device=None: torch.ones(n, n).tril())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert bench.training_device() == ("cuda", "")  # the probe passes: CUDA
    monkeypatch.setattr(torch.linalg, "solve_triangular", no_linalg)
    name, why = bench.training_device()
    assert name == "cpu" and "RuntimeError" in why and "libtorch_cuda_linalg.so" in why


def _training_only(monkeypatch, tmp_path, recorded: dict, *extra: str) -> str:
    from benchmarks import tiny_pair_acceptance as bench

    path = tmp_path / "recorded.json"
    path.write_text(json.dumps(recorded))
    monkeypatch.setattr(bench, "compare_training", lambda *a: pytest.fail("must refuse first"))
    argv = ["tiny_pair_acceptance.py", "--family", "k3", "--pair", "models/k3-pair"]
    monkeypatch.setattr(sys, "argv", argv + ["--training-only", "--from-json", str(path), *extra])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert json.loads(path.read_text()) == recorded  # left as it was
    return str(e.value)


def test_training_only_refuses_a_json_without_the_run_settings(monkeypatch, tmp_path):
    msg = _training_only(monkeypatch, tmp_path, {"family": "k3", "mean_acceptance_length": 3.9})
    assert "not a recorded acceptance JSON" in msg and "['pair', 'num_prompts', 'k']" in msg
    rec = {"pair": "models/k3-pair", "family": "k3", "num_prompts": 64, "k": 7}
    msg = _training_only(monkeypatch, tmp_path, rec, "--num-prompts", "8")  # other prompts: refused
    assert "num_prompts: 64 recorded, 8 given" in msg


def test_training_only_adds_the_comparison_afterwards(monkeypatch, tmp_path):
    """``--training-only --from-json``: the training modules (the tiny Qwen3 pair, two prompts,
    CUDA refused by the probe) added to the recorded JSON, vLLM's figures kept."""
    from benchmarks import tiny_pair_acceptance as bench

    path = tmp_path / "acc.json"
    rec = {"pair": "models/tiny-pair", "family": "qwen3", "num_prompts": 2, "k": 7}
    path.write_text(
        json.dumps(dict(rec, mean_acceptance_length=2.5, training_comparison="running"))
    )
    monkeypatch.setattr(bench, "training_device", lambda: ("cpu", "probe refused"))
    monkeypatch.setattr(
        sys,
        "argv",
        ["tiny_pair_acceptance.py", "--num-prompts", "2", "--max-tokens", "4"]
        + ["--training-only", "--from-json", str(path)],
    )
    assert bench.main() == 0
    res = json.loads(path.read_text())
    assert (
        res["mean_acceptance_length"] == 2.5
        and res["training_comparison"] == "done (cpu, afterwards)"
    )
    assert res["training_device"] == "cpu" and res["training_device_reason"] == "probe refused"
    assert res["training_greedy_equal_to_vllm_no_spec"] == "n/a (vLLM tokens not recorded)"
    assert res["training_simulated_steps"] > 0 and res["training_max_tokens"] == 4
