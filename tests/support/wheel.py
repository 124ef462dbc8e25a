"""What ``pip install .`` puts in the wheel: pyproject's ``packages.find``, read with setuptools
(namespace packages included, as setuptools' pyproject discovery does by default)."""

from __future__ import annotations

from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]


def wheel_packages() -> list[str]:
    """The packages of the wheel, sorted (dotted names)."""
    from setuptools import find_namespace_packages

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    find = pyproject["tool"]["setuptools"]["packages"]["find"]
    found = find_namespace_packages(str(REPO), include=find["include"], exclude=find["exclude"])
    return sorted(found)
