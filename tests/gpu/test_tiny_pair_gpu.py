"""The trained tiny pair on one GPU: vLLM loads it, greedy DSpark (k=7) output equals the
non-speculative output on 64 held-out prompts, and the mean acceptance length meets issue 7's bar.

Runs benchmarks/tiny_pair_acceptance.py (two vLLM subprocesses with hard timeouts).
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAIR = os.path.join(REPO, "models", "tiny-pair")


@pytest.mark.gpu
@pytest.mark.timeout(1500)
def test_tiny_pair_gpu_lossless_and_acceptance(tmp_path):
    if not os.path.exists(os.path.join(PAIR, "dspark-draft", "model.safetensors")):
        pytest.skip(
            "the trained tiny pair is not committed under models/tiny-pair yet (docs/tiny-pair.md)"
        )
    out = tmp_path / "acc.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.tiny_pair_acceptance",
            "--num-prompts",
            "64",
            "--out-json",
            str(out),
            "--timeout",
            "600",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads(out.read_text())
    assert res["lossless_identical_outputs"] == "64/64"
    assert res["mean_acceptance_length"] >= 3.0, res
