"""Where a GPU record came from: the commit it ran at.

The GPU machine gets a copy of the working tree without git history, so a run names its commit
through ``DSPARK_GPU_COMMIT``; elsewhere the checkout's HEAD is asked. Used by the GPU tests'
records (tests/gpu/gpu_common.py) and the served benchmark's JSON (benchmarks/serve_pp_one_gpu.py).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

COMMIT_ENV = "DSPARK_GPU_COMMIT"


def record_commit(repo: str | Path) -> str:
    """``DSPARK_GPU_COMMIT``, else ``git rev-parse HEAD`` of ``repo``, else a string that starts
    with ``unknown`` and says how to set it."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
            timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({type(exc).__name__}; set {COMMIT_ENV})"
    return out.stdout.strip() or f"unknown (no git checkout here; set {COMMIT_ENV})"
