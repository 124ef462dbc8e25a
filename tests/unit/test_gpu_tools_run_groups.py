"""tools/gpu/run_groups.sh: the groups it knows are the ones it documents, and the issue-26 groups
that run commands rather than pytest start what the next lease needs (``python3`` replaced by a
recorder, so nothing runs: the GPU itself is not needed to check the command lines)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gpu" / "run_groups.sh"
ARMS = ("pp1-nospec", "pp1-dspark", "pp2-dspark")


def _case_labels() -> set[str]:
    text = SCRIPT.read_text()
    body = text[text.index('for g in "$@"; do') : text.index("\ndone\nwait")]
    labels = set()
    for m in re.finditer(r"^  ([a-z0-9_ |]+)\)$", body, re.M):
        labels |= {x.strip() for x in m.group(1).split("|")}
    return labels


def test_every_group_is_documented_and_named_when_unknown():
    text = SCRIPT.read_text()
    labels = _case_labels()
    assert {"acceptance", "dsv4_check", "gsm8k_k3", "gsm8k_dsv4", "dsv4k3"} <= labels
    known = re.search(r"^KNOWN=\(([^)]*)\)", text, re.M).group(1)
    assert set(known.split()) == labels
    header = text[: text.index("set -uo pipefail")]
    for label in labels:
        assert re.search(rf"\b{label}\b", header), f"{label} is not described in the header"


def _fake_run(tmp_path: Path, *groups: str, budget: int = 540):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.txt"
    stub = bin_dir / "python3"
    # one line per call, written at once (groups run side by side): the arguments, shell-quoted
    log.write_text("")
    stub.write_text(f'#!/bin/bash\nline=$(printf "%q " "$@")\necho "$line" >> {log}\n')
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "DSPARK_GPU_GROUPS_BUDGET_S": str(budget),
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(out), *groups],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    calls = [shlex.split(line) for line in log.read_text().splitlines() if line.strip()]
    return proc, calls


def test_issue26_groups_start_the_leases_commands(tmp_path):
    proc, calls = _fake_run(tmp_path, "acceptance", "dsv4_check", "gsm8k_k3", "gsm8k_dsv4")
    rc = (tmp_path / "out" / "rc.txt").read_text()
    work = [c for c in calls if c[:3] != ["-m", "pip", "install"]]
    names = sorted(line.split()[0] for line in rc.splitlines())
    assert names == sorted(
        ["acceptance_k3", "acceptance_dsv4", "dsv4_check"]
        + [f"gsm8k_{f}-{a}" for f in ("k3", "dsv4") for a in ARMS]
    )
    assert all(line.endswith("rc=0") for line in rc.splitlines())
    acc = [c for c in work if c[0] == "benchmarks/tiny_pair_acceptance.py"]
    assert len(acc) == 2
    for c in acc:
        fam, pair = c[c.index("--family") + 1], c[c.index("--pair") + 1]
        assert (REPO / pair).is_dir() and c[c.index("--k") + 1] == "7"
        assert int(c[c.index("--timeout") + 1]) * 2 < 540  # both engines inside the budget
        assert c[c.index("--out-json") + 1].endswith(f"{fam}_acceptance.json")
    evals = [c for c in work if c[:4] == ["-m", "vllm_dspark_pp.cli.main", "eval", "gsm8k"]]
    assert len(evals) == 6
    for c in evals:
        config = c[c.index("--config") + 1]
        assert (REPO / config).is_file(), config
        assert ("--launchers" in c) is config.endswith("pp2-dspark.yaml"), c
    check = [c for c in work if c[:2] == ["-m", "dspark_dev.training.dsv4_check"]]
    assert len(check) == 1 and "--spec" in check[0]


def test_a_misspelt_group_fails_the_call_before_anything_starts(tmp_path):
    proc, calls = _fake_run(tmp_path, "acceptance", "gsm8k_k4")
    assert proc.returncode == 2 and "unknown group 'gsm8k_k4'" in proc.stderr
    assert calls == [] and not (tmp_path / "out").exists()
