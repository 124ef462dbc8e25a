"""The one engine-in-a-child runner: ``vllm.LLM`` in a fresh process group with a hard deadline.

:func:`run_engine` writes the spec (see :mod:`dspark_dev.engine_worker`), starts
``python -m dspark_dev.engine_worker`` in its own session, waits at most ``timeout_s``
(start-up, warm-up, generation and shutdown included), then kills the whole process group
whatever happened, so no engine core or PP worker outlives the case; a case past its deadline
first prints every process's Python stacks into its log (:mod:`vllm_dspark_pp.stack_dumps`).
It returns an :class:`EngineRun` (the worker's JSON, the log, whether it timed out); the CPU
e2e tier (``tests/support/e2e.py``) and the GPU tier (``tests/support/gpu.py``) turn that into
their results and failures.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dspark_dev.proc import dump_group_stacks, kill_group, start_in_session
from vllm_dspark_pp.stack_dumps import ENV as STACKS_ENV

# The checkout this package lives in (dspark_dev is never installed: it exists only in a checkout)
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class EngineRun:
    result: dict  # the worker's JSON ({} when it wrote none)
    log_text: str
    timed_out: bool
    returncode: int | None
    wall_s: float
    pgid: int

    @property
    def ok(self) -> bool:
        return bool(self.result.get("ok")) and not self.timed_out

    @property
    def phase(self) -> str:
        return self.result.get("phase", "import")


def child_env(base: dict, extra: dict | None = None) -> dict:
    """``os.environ`` + ``base`` + ``extra``, with the project root first on ``PYTHONPATH`` (the
    worker and vLLM's plugin entry point must import this checkout in every child)."""
    env = dict(os.environ)
    env[STACKS_ENV] = "1"  # a case that overruns its deadline prints every process's stacks
    env.update(base)
    env.update(extra or {})
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    parts.insert(0, str(REPO_ROOT))
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    return env


def run_engine(
    spec: dict, *, timeout_s: float, env: dict, name: str = "engine", own_cache: bool = False
) -> EngineRun:
    """Run one engine case (``spec``) in a child with the full environment ``env``.

    ``own_cache``: give the child its own ``VLLM_CACHE_ROOT`` (engines started together must not
    race on one torch.compile cache).
    """
    tmp = tempfile.mkdtemp(prefix=f"dspark-{name}-")
    try:
        paths = [os.path.join(tmp, n) for n in ("spec.json", "result.json", "log.txt")]
        spec_path, result_path, log_path = paths
        Path(spec_path).write_text(json.dumps(spec))
        env = dict(env)
        if own_cache:
            env.setdefault("VLLM_CACHE_ROOT", os.path.join(tmp, "vllm_cache"))
        cmd = [sys.executable, "-m", "dspark_dev.engine_worker", spec_path, result_path]
        t0 = time.monotonic()
        timed_out = False
        with open(log_path, "wb") as log:
            proc = start_in_session(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                n = dump_group_stacks(proc.pid)
                log.write(
                    f"\n[run_engine] deadline {timeout_s:.0f} s passed: asked {n} "
                    "process(es) for their Python stacks (above), killing the group\n".encode()
                )
            finally:
                kill_group(proc)  # whatever happened, nothing of this case survives it
        wall = time.monotonic() - t0
        log_text = Path(log_path).read_text(errors="replace")
        try:
            result = json.loads(Path(result_path).read_text())
        except (OSError, ValueError):
            result = {}
        return EngineRun(result, log_text, timed_out, proc.returncode, round(wall, 2), proc.pid)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
