"""The one engine-in-a-child runner: ``vllm.LLM`` in a fresh process group with a hard deadline.

:func:`run_engine` writes the spec (see :mod:`dspark_dev.engine_worker`), starts
``python -m dspark_dev.engine_worker`` in its own session, waits at most ``timeout_s``
(start-up, warm-up, generation and shutdown included), then kills the whole process group
whatever happened, so no engine core or PP worker outlives the case; a case past its deadline
first prints every process's Python stacks into its log (:mod:`vllm_dspark_pp.stack_dumps`).
With ``return_at_shutdown`` (the CPU e2e tier) it returns once the result is written and leaves
vLLM's shutdown, and the kill after it, to a background thread (:func:`wait_for_shutdowns`).
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
import threading
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


# The child's module (tests/unit/dspark_dev/test_engine_runner.py runs a stand-in).
WORKER_MODULE = "dspark_dev.engine_worker"
# How long a child that reported its result may take over vLLM's own shutdown before its group is
# killed (return_at_shutdown): vLLM 0.34.0 gives its workers 15 s
# (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS) plus 4 s after a SIGTERM.
SHUTDOWN_WAIT_S = 30.0
_POLL_S = 0.2
_shutdowns: list[threading.Thread] = []


def _reported_shutdown(result_path: str) -> bool:
    """The worker's result file says it generated everything and is shutting the engine down."""
    try:
        result = json.loads(Path(result_path).read_text())
    except (OSError, ValueError):
        return False
    return bool(result.get("ok")) and result.get("phase") == "shutdown"


def _finish_in_background(proc: subprocess.Popen, tmp: str) -> None:
    """Let the child finish vLLM's shutdown by itself (at most :data:`SHUTDOWN_WAIT_S`), then kill
    its group and remove its files, in a thread the interpreter joins before it exits."""

    def finish() -> None:
        try:
            proc.wait(timeout=SHUTDOWN_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        finally:
            kill_group(proc)
            shutil.rmtree(tmp, ignore_errors=True)

    thread = threading.Thread(target=finish, name=f"engine-shutdown-{proc.pid}")
    thread.start()
    _shutdowns.append(thread)


def wait_for_shutdowns() -> None:
    """Wait until every engine handed to the background (``return_at_shutdown``) has ended."""
    while _shutdowns:
        _shutdowns.pop().join()


def run_engine(
    spec: dict,
    *,
    timeout_s: float,
    env: dict,
    name: str = "engine",
    own_cache: bool = False,
    return_at_shutdown: bool = False,
) -> EngineRun:
    """Run one engine case (``spec``) in a child with the full environment ``env``.

    ``own_cache``: give the child its own ``VLLM_CACHE_ROOT`` (engines started together must not
    race on one torch.compile cache).

    ``return_at_shutdown``: return as soon as the child's result says it generated everything
    and is shutting the engine down (``ok``, phase ``shutdown``), instead of waiting for vLLM's
    shutdown (3-4 s on the 2-core CPU; about 20 s when a worker outlives its grace period); the
    child then finishes in the background and its group is killed there as here
    (:func:`wait_for_shutdowns`; the interpreter waits for it before it exits). The log then ends
    where the result was written. Nothing checks the shutdown (the worker ignores its outcome);
    for engines that must not overlap the next one (a GPU's memory), leave it off.
    """
    tmp = tempfile.mkdtemp(prefix=f"dspark-{name}-")
    in_background = False
    try:
        paths = [os.path.join(tmp, n) for n in ("spec.json", "result.json", "log.txt")]
        spec_path, result_path, log_path = paths
        Path(spec_path).write_text(json.dumps(spec))
        env = dict(env)
        if own_cache:
            env.setdefault("VLLM_CACHE_ROOT", os.path.join(tmp, "vllm_cache"))
        cmd = [sys.executable, "-m", WORKER_MODULE, spec_path, result_path]
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        timed_out = False
        with open(log_path, "wb") as log:
            proc = start_in_session(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                step = _POLL_S if return_at_shutdown else timeout_s
                while True:
                    try:
                        proc.wait(timeout=max(0.0, min(step, deadline - time.monotonic())))
                        break  # the child exited
                    except subprocess.TimeoutExpired:
                        pass
                    if return_at_shutdown and _reported_shutdown(result_path):
                        in_background = True
                        break
                    if time.monotonic() >= deadline:
                        timed_out = True
                        n = dump_group_stacks(proc.pid)
                        note = (
                            f"\n[run_engine] deadline {timeout_s:.0f} s passed: asked {n} "
                            "process(es) for their Python stacks (above), killing the group\n"
                        )
                        log.write(note.encode())
                        break
            except BaseException:
                kill_group(proc)
                raise
            if not in_background:
                kill_group(proc)  # whatever happened, nothing of this case survives it
        wall = time.monotonic() - t0
        log_text = Path(log_path).read_text(errors="replace")
        try:
            result = json.loads(Path(result_path).read_text())
        except (OSError, ValueError):
            result = {}
        if in_background:  # read above, so the files can go with the child
            _finish_in_background(proc, tmp)
        return EngineRun(result, log_text, timed_out, proc.returncode, round(wall, 2), proc.pid)
    finally:
        if not in_background:
            shutil.rmtree(tmp, ignore_errors=True)
