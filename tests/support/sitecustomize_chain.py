"""How every test probe's ``sitecustomize.py`` (``tests/support/*_probe/``) ends: install the
probe, then run the next ``sitecustomize`` on ``sys.path``, so a probe directory put first on
PYTHONPATH hides none (the GPU kit's, a venv's).

The ``support`` package is not importable in the processes a probe loads into, so a probe runs
this file by path: ``runpy.run_path(path)["install_then_chain"](__file__, install)``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


def run_next_sitecustomize(probe_file: str) -> None:
    """Execute the first ``sitecustomize.py`` on ``sys.path`` outside the probe's directory."""
    here = os.path.dirname(os.path.abspath(probe_file))
    for entry in sys.path:
        path = os.path.join(os.path.abspath(entry or "."), "sitecustomize.py")
        if os.path.dirname(path) != here and os.path.isfile(path):
            with open(path) as f:
                code = compile(f.read(), path, "exec")
            exec(code, {"__name__": "sitecustomize_next", "__file__": path})
            return


def install_then_chain(probe_file: str, install: Callable[[], None]) -> None:
    try:
        install()
    finally:
        run_next_sitecustomize(probe_file)
