"""Knobs in one registry: every environment variable of ours (``DSPARK_*``, ``VLLM_DSPARK_*``)
read in the checkout, in Python or shell, is registered (``vllm_dspark_pp/envs.py`` for the
runtime, ``dspark_dev/knobs.py`` for tests and tooling); no entry is stale; a literal default at
a read site is the registered one; the runtime package reads the environment only through
``envs.py``. What counts as a read: :mod:`dspark_dev.knob_scan`. The last test plants each kind
of violation in a scratch tree and checks that it is reported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from dspark_dev import knob_scan, knobs
from vllm_dspark_pp import envs

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parents[3]
RUNTIME = set(envs.environment_variables) | set(envs.deprecated_environment_variables)
#: Reads by a computed name outside envs.py, each with why it is no knob of ours.
DYNAMIC_OK = {
    ("tests/support/env.py", "os.environ.setdefault(k, v)"): "puts vLLM's CPU variables in place",
}
#: Environment reads the runtime package makes outside envs.py: (module, name) -> why.
RUNTIME_READS_OK = {
    ("vllm_dspark_pp/cli/plan.py", "VLLM_TARGET_DEVICE"): "vLLM's own knob, set before import",
    ("vllm_dspark_pp/cli/plan.py", "TRITON_INTERPRET"): "set (if unset) for the CPU plan",
    ("vllm_dspark_pp/cli/plan.py", "CUDA_VISIBLE_DEVICES"): "set (if unset) for the CPU plan",
}


def unregistered(scan: knob_scan.Scan) -> list[str]:
    known = RUNTIME | set(knobs.REGISTRY) | set(knobs.NOT_KNOBS)
    return sorted(
        f"{r.path}:{r.line}: {r.name}" for r in scan.reads + scan.named if r.name not in known
    )


def stale(scan: knob_scan.Scan) -> list[str]:
    return sorted(set(knobs.REGISTRY) - scan.all_names())


def default_mismatches(scan: knob_scan.Scan) -> list[str]:
    """Literal defaults at read sites that the registry's default text does not name (an empty
    default reads as ``unset``)."""
    bad = []
    for r in scan.reads:
        knob = knobs.REGISTRY.get(r.name)
        if knob is None:
            continue
        words = set(re.split(r"[\s;()]+", knob.default))
        for literal in r.defaults:
            if (literal or "unset") not in words:
                bad.append(
                    f"{r.path}:{r.line}: {r.name} defaults to {literal!r} there, "
                    f"registered {knob.default!r}"
                )
    return bad


def dynamic_reads(scan: knob_scan.Scan) -> list[str]:
    bad = []
    for row in scan.dynamic:
        path, _, expr = row.split(":", 2)
        if path == "vllm_dspark_pp/envs.py":
            continue
        if (path, expr.strip()) not in DYNAMIC_OK:
            bad.append(row)
    return bad


def runtime_reads_outside_envs(root: Path) -> list[str]:
    """Every environment read in the runtime package outside envs.py (any name)."""
    bad = []
    pkg = root / "vllm_dspark_pp"
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "vllm_dspark_pp/envs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            arg = knob_scan._environ_read_arg(node)
            if arg is None:
                continue
            name = arg.value if isinstance(arg, ast.Constant) else None
            if (rel, name) not in RUNTIME_READS_OK:
                bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return bad


@pytest.fixture(scope="module")
def scan() -> knob_scan.Scan:
    return knob_scan.scan(REPO)


def test_every_variable_read_is_registered(scan):
    assert scan.reads, "the scan found no read at all"
    missing = unregistered(scan)
    assert not missing, (
        "environment variables read outside the registries (add each to dspark_dev/knobs.py, or "
        f"a runtime knob to vllm_dspark_pp/envs.py, then regenerate docs/knobs.md): {missing}"
    )


def test_no_registered_knob_is_stale(scan):
    assert not stale(scan), f"registered in dspark_dev/knobs.py but named nowhere: {stale(scan)}"


def test_literal_defaults_at_read_sites_are_the_registered_ones(scan):
    assert not default_mismatches(scan), default_mismatches(scan)


def test_no_read_by_a_computed_name(scan):
    assert not dynamic_reads(scan), (
        f"environment reads whose name the scan cannot see (read a literal name): "
        f"{dynamic_reads(scan)}"
    )


def test_the_runtime_package_reads_the_environment_only_through_envs():
    bad = runtime_reads_outside_envs(REPO)
    assert not bad, f"read these through vllm_dspark_pp.envs: {bad}"


def test_one_prefix_for_runtime_knobs_and_none_of_it_for_tooling():
    assert all(n.startswith(envs.PREFIX) for n in envs.environment_variables)
    assert not [n for n in knobs.REGISTRY if n.startswith(envs.PREFIX)]
    assert not set(knobs.REGISTRY) & RUNTIME
    assert all(k.meaning and k.default for k in knobs.KNOBS), "every knob says what it does"
    assert len(knobs.REGISTRY) == len(knobs.KNOBS), "a knob registered twice"
    assert all(k.meaning for k in knobs.runtime_knobs()), "a runtime knob without its comment"


def test_the_checks_catch_planted_violations(tmp_path):
    planted = "DSPARK_" + "PLANTED"  # built here so that this file names no unknown knob
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text(
        "import os\n"
        f"A = os.environ.get('{planted}_PY')\n"
        f"NAME_ENV = '{planted}_CONST'\n"
        "B = os.getenv(NAME_ENV)\n"
        "def _num(name, default):\n"
        "    return int(os.environ.get(name, default))\n"
        f"C = _num('{planted}_HELPER', 3)\n"
        f"CHILD = 'import os; os.environ[\"{planted}_EMBEDDED\"]'\n"
        "D = os.environ.get('DSPARK_GPU_BUDGET_S', '999')\n"
        "E = os.environ.get(__name__)\n"
    )
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "run.sh").write_text(f"#!/bin/bash\nX=${{{planted}_SH:-1}} $Y\n")
    (tmp_path / "vllm_dspark_pp").mkdir()
    (tmp_path / "vllm_dspark_pp" / "m.py").write_text(
        "import os\nT = os.environ.get('VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S')\n"
    )
    scan = knob_scan.scan(tmp_path)
    found = " ".join(unregistered(scan))
    reads = {r.name: r.defaults for r in scan.reads}
    for suffix in ("PY", "CONST", "HELPER", "EMBEDDED", "SH"):
        assert f"{planted}_{suffix}" in found, (suffix, found)
        assert f"{planted}_{suffix}" in reads, (suffix, reads)  # seen as a read, not a mention
    assert reads[f"{planted}_HELPER"] == ("3",) and reads[f"{planted}_SH"] == ("1",), reads
    assert [m for m in default_mismatches(scan) if "'999'" in m], default_mismatches(scan)
    assert dynamic_reads(scan) == ["tests/t.py:10: os.environ.get(__name__)"]
    assert runtime_reads_outside_envs(tmp_path) == [
        "vllm_dspark_pp/m.py:2: os.environ.get('VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S')"
    ]
    assert stale(scan), "a registry entry named nowhere in the scratch tree is reported"


def test_docs_knobs_md_is_the_generated_page(scan):
    doc = (REPO / "docs" / "knobs.md").read_text()
    assert doc == knobs.markdown(scan), (
        "docs/knobs.md is stale: run `python -m dspark_dev.knobs --markdown > docs/knobs.md`"
    )
    for name in [*envs.environment_variables, *knobs.REGISTRY]:
        assert f"| `{name}` |" in doc, name
