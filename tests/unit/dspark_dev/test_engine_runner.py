"""The engine runner's ``return_at_shutdown`` (dspark_dev/engine.py; the CPU e2e tier uses it):
the call returns once the child's result says it is shutting down, the child finishes in the
background, and its whole group is gone after :func:`wait_for_shutdowns`, killed if it outlives
:data:`SHUTDOWN_WAIT_S`. A stand-in child (no vLLM) plays the worker: it writes a result in
phase ``shutdown``, starts a grandchild in its group and takes ``SHUTDOWN_S`` to exit."""

from __future__ import annotations

import os
import textwrap
import time

import pytest

from dspark_dev import engine
from dspark_dev.proc import live_group_members

STAND_IN = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    spec = json.load(open(sys.argv[1]))
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(sys.argv[2] + ".tmp", "w") as f:
        json.dump({"ok": spec["ok"], "phase": "shutdown", "waves": []}, f)
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    time.sleep(spec["shutdown_s"])
    """
)


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    (tmp_path / "stand_in_worker.py").write_text(STAND_IN)
    monkeypatch.setattr(engine, "WORKER_MODULE", "stand_in_worker")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))

    def run(shutdown_s: float, *, ok: bool = True, background: bool = True):
        spec = {"ok": ok, "shutdown_s": shutdown_s}
        t0 = time.monotonic()
        res = engine.run_engine(spec, timeout_s=60, env=env, return_at_shutdown=background)
        return res, time.monotonic() - t0

    yield run
    engine.wait_for_shutdowns()


def test_returns_at_the_result_and_the_group_ends_in_the_background(stand_in):
    run, took = stand_in(6.0)  # the call must return well before the child's 6 s are up
    assert run.ok and not run.timed_out and took < 5.0, took
    assert live_group_members(run.pgid), "the child was killed instead of finishing by itself"
    t0 = time.monotonic()
    engine.wait_for_shutdowns()
    assert 0.5 < time.monotonic() - t0 < 10
    assert live_group_members(run.pgid) == []  # the grandchild too


def test_a_child_that_outlives_the_shutdown_wait_is_killed_with_its_group(stand_in, monkeypatch):
    monkeypatch.setattr(engine, "SHUTDOWN_WAIT_S", 1.0)
    run, _ = stand_in(120.0)
    t0 = time.monotonic()
    engine.wait_for_shutdowns()
    assert time.monotonic() - t0 < 15
    assert live_group_members(run.pgid) == []


@pytest.mark.parametrize("ok, background", [(True, False), (False, True)])
def test_otherwise_the_call_waits_for_the_child_and_kills_its_group(stand_in, ok, background):
    """Without ``return_at_shutdown``, or with a result that is not ``ok``, nothing changes:
    the call returns after the child exited, its group killed."""
    run, took = stand_in(2.0, ok=ok, background=background)
    assert took >= 2.0 and run.returncode == 0
    assert live_group_members(run.pgid) == []
    assert run.ok is ok
