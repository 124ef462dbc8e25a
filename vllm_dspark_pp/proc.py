"""Run a command with a hard timeout that also ends every process it started."""

from __future__ import annotations

import os
import signal
import subprocess


def run_with_timeout(cmd: list[str], *, timeout: float, env: dict | None = None, capture: bool = False):
    """Run ``cmd`` in its own session; on timeout SIGKILL the whole process group (vLLM workers
    included) and raise ``subprocess.TimeoutExpired``. Returns ``(returncode, stdout, stderr)``
    (the streams are None unless ``capture``)."""
    pipe = subprocess.PIPE if capture else None
    proc = subprocess.Popen(cmd, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise
    finally:
        if proc.poll() is None:
            _kill_group(proc)
    _kill_group(proc, only_leftovers=True)
    return proc.returncode, out, err


def _kill_group(proc: subprocess.Popen, only_leftovers: bool = False) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    if not only_leftovers:
        proc.wait()
