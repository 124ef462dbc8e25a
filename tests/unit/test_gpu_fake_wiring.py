"""The GPU groups of issue 26 run their wiring on CPU with fake engines (tests/support/
gpu_fake_engines.py): which engines each mode starts, with which arguments, and that their checks
pass on good counters and fail on bad ones. A GPU lease is short; a test module broken in a way the
CPU can see must not be found there. Each case is the plugin's own command in a child pytest."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parents[2]
DSV4K3 = ["tests/gpu/test_dsv4_k3_engine.py", "tests/gpu/test_dsv4_k3_pp.py"]
PD_PP = ["tests/gpu/test_pd_pp_producer.py"]


def _fake_run(modules: list[str], **env: str) -> dict[str, int]:
    child_env = {
        **os.environ,
        "DSPARK_FAKE_MODELS": str(REPO / "models"),
        "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("", "tests", "tests/gpu")),
        **env,
    }
    for knob in ("DSPARK_DSV4K3_WEIGHTS", "DSPARK_GPU_PD_PP_PAIR", "DSPARK_FAKE_MUTATION"):
        if not child_env.get(knob):
            child_env.pop(knob, None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["-p", "support.gpu_fake_engines", *modules],
        cwd=REPO,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", last)}
    counts["errors"] = counts.pop("error", 0) + counts.pop("errors", 0)
    counts["rc"] = proc.returncode
    counts["last"] = last  # type: ignore[assignment]
    return counts


@pytest.mark.parametrize(
    "modules, env",
    [
        (DSV4K3 + PD_PP, {}),  # dummy weights (k=4), the tiny pair's PD
        (DSV4K3 + PD_PP, {"DSPARK_DSV4K3_WEIGHTS": "trained", "DSPARK_GPU_PD_PP_PAIR": "dsv4"}),
        (PD_PP, {"DSPARK_GPU_PD_PP_PAIR": "k3"}),
    ],
    ids=["dummy", "trained-dsv4", "pd-pp-k3"],
)
def test_fake_engines_pass_the_gpu_groups_wiring(modules, env):
    got = _fake_run(modules, **env)
    assert got["rc"] == 0 and not got.get("failed") and not got["errors"], got["last"]
    assert got.get("passed", 0) > 0, got["last"]


def test_the_wiring_run_fails_when_a_draft_position_never_accepts():
    """The control: the fake counters with draft position 6 at 0 must fail the trained checks."""
    got = _fake_run(
        DSV4K3 + PD_PP,
        DSPARK_DSV4K3_WEIGHTS="trained",
        DSPARK_GPU_PD_PP_PAIR="dsv4",
        DSPARK_FAKE_MUTATION="pos6_zero",
    )
    assert got["rc"] != 0 and got.get("failed", 0) > 0, got["last"]
