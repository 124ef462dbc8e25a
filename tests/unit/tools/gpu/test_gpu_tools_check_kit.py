"""tools/gpu/check_kit.py: an incomplete GPU kit is named as such before any engine starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

SCRIPT = Path(__file__).resolve().parents[4] / "tools" / "gpu" / "check_kit.py"


def _check(site: Path) -> subprocess.CompletedProcess:
    # the kit's env.sh puts the site first on PYTHONPATH; the same here
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(site)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _site(tmp_path: Path, *packages: str) -> Path:
    site = tmp_path / "site"
    for name in packages:
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text("")
    site.mkdir(exist_ok=True)
    return site


def test_a_complete_kit_passes(tmp_path):
    res = _check(_site(tmp_path, "torch", "vllm"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "come from the kit" in res.stdout


def test_a_kit_without_its_torch_group_is_named_with_the_fix(tmp_path):
    # the sixth H200 session: torch fell back to the machine's copy (here: this environment's)
    res = _check(_site(tmp_path, "vllm"))
    assert res.returncode == 3, res.stdout + res.stderr
    assert "FATAL: torch: " in res.stdout and "FATAL: vllm" not in res.stdout
    assert "boot.sh" in res.stdout and "N/M pieces" in res.stdout
