"""``train_tiny_pair --family dsv4`` end to end on CPU with 3 + 3 steps, then the written
directory loaded into vLLM's DeepSeek-V4 target and DSpark drafter built on the CPU (names,
shapes, values). Opt-in: DSPARK_DSV4_TRAIN_SMOKE=1. At the training geometry (the default since
``--dsv4-geometry``: 8 query heads) it took 13 s on 2 shared cores; at the 64-head GPU geometry it
took 2-3 minutes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from dspark_dev.proc import run_with_timeout

pytestmark = pytest.mark.skipif(
    os.environ.get("DSPARK_DSV4_TRAIN_SMOKE") != "1",
    reason="opt-in (about 15 s): set DSPARK_DSV4_TRAIN_SMOKE=1",
)

REPO = Path(__file__).resolve().parents[4]


def test_dsv4_smoke_trains_and_loads_into_vllm(tmp_path):
    out = tmp_path / "pair"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    train = [sys.executable, "-m", "dspark_dev.training.train_tiny_pair", "--family", "dsv4"]
    train += ["--device", "cpu", "--target-steps", "3", "--draft-steps", "3", "--batch-size", "4"]
    train += ["--num-train-docs", "64", "--heldout-docs", "4", "--eval-prompts", "1"]
    train += ["--minutes", "20", "--out", str(out)]
    rc, so, se = run_with_timeout(train, timeout=600, env=env, cwd=str(REPO), capture=True)
    assert rc == 0, (so or "")[-2000:] + (se or "")[-2000:]
    info = json.loads((out / "dsv4" / "training.json").read_text())
    assert info["target_steps_run"] == 3 and info["draft_steps_run"] == 3
    assert "simulated_mean_acceptance_length" in info
    assert (out / "README.md").is_file()
    check = [sys.executable, "-m", "dspark_dev.training.dsv4_train", str(out / "dsv4")]
    rc, so, se = run_with_timeout(check, timeout=300, env=env, cwd=str(REPO), capture=True)
    assert rc == 0, (so or "")[-3000:] + (se or "")[-2000:]
    problems = json.loads(so[so.rindex("{\n") :])
    assert problems == {"target": [], "drafter": []}
