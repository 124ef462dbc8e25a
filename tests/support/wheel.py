"""What ``pip install .`` puts in the wheel: pyproject's ``packages.find``, read with setuptools
(namespace packages included, as setuptools' pyproject discovery does by default), and the file
list of a wheel really built from a copy of the checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
# not copied for a build: the bundled weights (20 MB, no package), hidden folders (.git, .venv, a
# GPU kit's pieces, caches) and what git ignores anyway
SKIPPED_IN_COPY = ("models", ".*", "build", "__pycache__", "*.egg-info")


def wheel_packages() -> list[str]:
    """The packages of the wheel, sorted (dotted names)."""
    from setuptools import find_namespace_packages

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    find = pyproject["tool"]["setuptools"]["packages"]["find"]
    found = find_namespace_packages(str(REPO), include=find["include"], exclude=find["exclude"])
    return sorted(found)


def build_wheel(workdir: Path, repo: Path = REPO) -> Path:
    """Build the wheel of ``repo`` (copied into ``workdir`` first, so that setuptools' ``build/``
    and ``*.egg-info`` stay out of the checkout) with this interpreter's setuptools; its path."""
    src = workdir / "src"
    shutil.copytree(repo, src, ignore=shutil.ignore_patterns(*SKIPPED_IN_COPY))
    out = workdir / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    p = subprocess.run(
        [*cmd, "--disable-pip-version-check", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    (wheel,) = out.glob("*.whl")
    return wheel


def wheel_files(wheel: Path) -> list[str]:
    """The file names inside ``wheel``, sorted."""
    with zipfile.ZipFile(wheel) as zf:
        return sorted(zf.namelist())
