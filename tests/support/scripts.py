"""Import a repository script by its path (``tools/gpu/`` and ``tests/gpu/`` are not packages,
and tests insert nothing into ``sys.path``; ``benchmarks`` is a package, imported by name)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_script(rel: str) -> ModuleType:
    """The module of ``REPO/rel``, registered under its stem (dataclasses and sibling imports
    look modules up by name); loaded once."""
    path = REPO / rel
    if path.stem in sys.modules and getattr(sys.modules[path.stem], "__file__", None) == str(path):
        return sys.modules[path.stem]
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod
