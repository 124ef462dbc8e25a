"""tests/support/tap_probe (the GPU tap-partials control's probe): in a process that has its
directory first on PYTHONPATH and ``DSPARK_TEST_TAP_WRONG_BLOCK=1``, every stage but the last
reads its column block of the draft's ``fc`` as zeros; the last stage, and every stage without
the knob, read the checkpoint's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PROBE = REPO / "tests" / "support" / "tap_probe"
CODE = """
import json, sys
from vllm_dspark_pp.protocol import tap_partials as tp
draft = sys.argv[1]
hit = tp.find_linear(draft, "fc", 384)
out = {}
for last in (False, True):
    plan = tp.TapPlan(num_taps=3, tap_width=128, partial_width=128, base=0 if not last else 1,
                      count=1 if not last else 2, is_first=not last, is_last=last, upstream=(1,))
    block = tp.load_column_block(draft, hit, plan, __import__("torch").float32, "cpu")
    out["last" if last else "first"] = [list(block.shape), float(block.abs().sum())]
print(json.dumps(out))
"""


def _blocks(knob: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "DSPARK_TEST_TAP_WRONG_BLOCK"}
    env["PYTHONPATH"] = os.pathsep.join([str(PROBE), str(REPO), env.get("PYTHONPATH", "")])
    if knob is not None:
        env["DSPARK_TEST_TAP_WRONG_BLOCK"] = knob
    draft = str(REPO / "models" / "tiny-pair" / "dspark-draft")
    res = subprocess.run([sys.executable, "-c", CODE, draft], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("knob", [None, "0"])
def test_without_the_knob_every_stage_reads_the_checkpoint(knob):
    got = _blocks(knob)
    assert got["first"][0] == [128, 128] and got["first"][1] > 0
    assert got["last"][0] == [128, 256] and got["last"][1] > 0


def test_with_the_knob_the_stages_before_the_last_read_zeros():
    got, honest = _blocks("1"), _blocks(None)
    assert got["first"] == [[128, 128], 0.0]
    assert got["last"] == honest["last"]
