"""A hung case can say where it waits: SIGUSR1 prints every thread's Python stack (opt-in)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dspark_dev.proc import dump_group_stacks, kill_group, start_in_session
from vllm_dspark_pp.stack_dumps import ENV

pytestmark = pytest.mark.quick

# Registers the dump the way a vLLM process does (through the plugin's register()), then waits
# in a named function so the stack shows where it was.
CHILD = """
import sys, time
import vllm_dspark_pp
vllm_dspark_pp.register()
def waiting_for_a_peer_that_never_answers():
    print("ready", flush=True)
    time.sleep(60)
waiting_for_a_peer_that_never_answers()
"""

# The server helpers' tests below check their own part (the environment they give the child asks
# for the dump; a late server is signalled and its log keeps the stacks). Their child installs the
# dump with the function register() calls first, without importing vLLM (5-8 s per child on the
# CI machine); that register() installs it in a plugin process is the first test's check.
SERVER_CHILD = """
import time
from vllm_dspark_pp.stack_dumps import install_if_requested
install_if_requested()
def waiting_for_a_peer_that_never_answers():
    print("ready", flush=True)
    time.sleep(60)
waiting_for_a_peer_that_never_answers()
"""


def _start(tmp_path, env_value: str | None):
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if env_value is not None:
        env[ENV] = env_value
    err = open(tmp_path / "stderr.txt", "wb")  # noqa: SIM115 (closed by the caller)
    proc = start_in_session(
        [sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, stderr=err
    )
    seen = []
    for line in proc.stdout:  # vLLM's logger writes to stdout first
        if line.strip() == b"ready":
            proc.seen = b"".join(seen).decode(errors="replace")
            return proc, err
        seen.append(line)
    raise AssertionError((tmp_path / "stderr.txt").read_text())


def test_plugin_processes_print_their_stacks_on_sigusr1_and_keep_running(tmp_path):
    proc, err = _start(tmp_path, "1")
    try:
        assert dump_group_stacks(proc.pid, settle_s=1.0) == 1
        assert proc.poll() is None, "the dump must not end the process"
        text = (tmp_path / "stderr.txt").read_text()
        assert "waiting_for_a_peer_that_never_answers" in text, text
        assert "most recent call first" in text, text
        # the log names the pid to signal (users signal those, not a whole group)
        assert f"pid {proc.pid} prints its Python stacks on SIGUSR1" in proc.seen, proc.seen
    finally:
        kill_group(proc)
        err.close()


def test_without_the_variable_sigusr1_keeps_its_default_meaning(tmp_path):
    proc, err = _start(tmp_path, None)
    try:
        os.kill(proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.returncode == -signal.SIGUSR1
        assert "waiting_for_a_peer" not in (tmp_path / "stderr.txt").read_text()
    finally:
        kill_group(proc)
        err.close()


def test_a_server_not_ready_by_its_deadline_leaves_its_stacks_in_its_log(tmp_path):
    from dspark_dev.serve import Server, ServerNotReady, free_port

    srv = Server(  # the dump installed, /health never answered
        [sys.executable, "-c", SERVER_CHILD], tmp_path / "never-ready.log", port=free_port(),
        name="never-ready", cpu=False, grace_s=1.0,
    )  # fmt: skip
    with srv:
        deadline = time.monotonic() + 20
        while "ready" not in srv.log_text().splitlines() and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(ServerNotReady, match="printed their Python stacks into its log"):
            srv.wait_ready(0.0)
        assert "waiting_for_a_peer_that_never_answers" in srv.log_text()
