"""The wheel as built: runtime files only, the license in its metadata, and a build requirement
that can read that metadata."""

from __future__ import annotations

import re
import zipfile

import tomllib
from support.wheel import REPO, build_wheel, wheel_files

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# setuptools reads the SPDX string form of `project.license` (PEP 639) from this version on;
# 76 fails at metadata generation
SPDX_LICENSE_SETUPTOOLS = (77, 0)


def test_the_build_requirement_reads_the_spdx_license():
    assert isinstance(PYPROJECT["project"]["license"], str)
    (req,) = [r for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    m = re.fullmatch(r"setuptools>=(\d+)(?:\.(\d+))?", req.replace(" ", ""))
    assert m, f"{req!r}: expected a lower bound `setuptools>=N`"
    assert (int(m[1]), int(m[2] or 0)) >= SPDX_LICENSE_SETUPTOOLS, req


def test_the_license_file_is_the_apache_2_0_text():
    text = (REPO / "LICENSE").read_text()
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_the_built_wheel_holds_runtime_files_and_the_license_only(tmp_path):
    """A wheel built from a copy of this checkout: every file is under ``vllm_dspark_pp/`` or its
    ``.dist-info`` (development tooling, tests, benchmarks and tools stay in the checkout)."""
    wheel = build_wheel(tmp_path)
    files = wheel_files(wheel)
    dist_info = next(f.split("/")[0] for f in files if f.endswith(".dist-info/METADATA"))
    outside = [f for f in files if f.split("/")[0] not in ("vllm_dspark_pp", dist_info)]
    assert not outside, outside
    runtime = sorted(
        p.relative_to(REPO).as_posix()
        for p in (REPO / "vllm_dspark_pp").rglob("*.py")
        if "__pycache__" not in p.parts
    )
    assert [f for f in files if f.startswith("vllm_dspark_pp/")] == runtime
    assert f"{dist_info}/licenses/LICENSE" in files
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
