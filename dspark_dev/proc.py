"""Run a command in its own session with a deadline; kill its whole process group afterwards.

vLLM starts an engine core and one worker per rank as children; killing only the direct child
leaves them running. Every helper here starts the command with ``start_new_session=True`` (its own
process group) and ends by SIGKILLing the group and waiting until no member still runs. A worker
whose parent died first is reparented to PID 1 and stays a zombie until PID 1 reaps it, so
``os.killpg(pgid, 0)`` still succeeds then although nothing runs: :func:`live_group_members`
counts zombies as dead.

``DSPARK_PGID_DIR`` (optional): each started group is noted there as a file named after its
pgid while it runs, so an outer script (tools/gpu/run_gpu_suite.sh) can kill the groups if the
Python process itself dies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def live_group_members(pgid: int) -> list[int]:
    """PIDs in process group ``pgid`` that are still running (zombies count as dead)."""
    live = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path("/proc", d, "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces or parentheses
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            live.append(int(d))
    return live


def _pgid_file(proc: subprocess.Popen) -> Path | None:
    d = os.environ.get("DSPARK_PGID_DIR")
    return Path(d) / str(proc.pid) if d else None


def start_in_session(cmd: list[str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, start_new_session=True, ...)``, noted in ``DSPARK_PGID_DIR``."""
    popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
    proc = subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)
    f = _pgid_file(proc)
    if f is not None:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(str(proc.pid))
    return proc


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


def dump_group_stacks(pgid: int, settle_s: float = 3.0) -> int:
    """Send SIGUSR1 to every running member of group ``pgid`` and give them ``settle_s`` to
    write their Python stacks (members started with ``VLLM_DSPARK_PP_STACKS_ON_SIGUSR1=1`` that
    loaded the plugin or registered the dump themselves: :mod:`vllm_dspark_pp.stack_dumps`; any
    other member ends, as SIGUSR1's default action, which is fine right before the group is
    killed). Returns how many members were signalled."""
    members = live_group_members(pgid)
    for pid in members:
        try:
            os.kill(pid, signal.SIGUSR1)
        except (ProcessLookupError, PermissionError):
            pass
    if members:
        time.sleep(settle_s)
    return len(members)


def kill_group(proc: subprocess.Popen, grace_s: float = 0.0, settle_s: float = 10.0) -> bool:
    """End the child's whole process group and wait (up to ``settle_s``) until no member of it
    still runs. With ``grace_s`` > 0 the group gets SIGTERM first and up to ``grace_s`` to exit;
    then SIGKILL. Returns True when no SIGKILL was needed (the group had ended by itself or on
    SIGTERM)."""
    pgid = proc.pid
    if grace_s > 0 and live_group_members(pgid):
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while live_group_members(pgid) and time.monotonic() < deadline:
            proc.poll()
            time.sleep(0.1)
    clean = not live_group_members(pgid)
    # stragglers (engine core, workers) die with the group even if the leader exited
    _signal_group(pgid, signal.SIGKILL)
    _wait(proc, settle_s)
    deadline = time.monotonic() + settle_s
    while live_group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    f = _pgid_file(proc)
    if f is not None:
        f.unlink(missing_ok=True)
    return clean


def run_with_timeout(
    cmd: list[str],
    *,
    timeout: float,
    env: dict | None = None,
    cwd: str | None = None,
    capture: bool = False,
    stdout=None,
):
    """Run ``cmd`` in its own session and always kill its process group at the end.

    Returns ``(returncode, stdout, stderr)`` (the streams are None unless ``capture``; ``stdout``
    may instead be an open file, which then gets stderr too). On timeout the group is killed and
    ``subprocess.TimeoutExpired`` is raised.
    """
    if capture:
        out_kw = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    elif stdout is not None:
        out_kw = {"stdout": stdout, "stderr": subprocess.STDOUT}
    else:
        out_kw = {}
    proc = start_in_session(cmd, env=env, cwd=cwd, **out_kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)  # on timeout, on success (stray workers) and on KeyboardInterrupt
    return proc.returncode, out, err
