"""Ports, HTTP and ``vllm serve`` in its own process group (GPU tier, PD runs, benchmarks).

* :func:`free_port`, :func:`free_port_block` (a base with free ports above it, for ``VLLM_PORT``);
* :func:`http_json`, :func:`http_text`;
* :class:`Server`: one launcher (``vllm serve`` or any command serving ``/health``) in its own
  process group, its output in a log file, always stopped with its whole group;
* :func:`wait_ready`: the one readiness wait of every launcher (a deadline in seconds, a progress
  line on long waits, an error naming the process with the tail of its log);
* :func:`save_artifact`: where failing cases leave logs (``DSPARK_GPU_ARTIFACTS``).
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dspark_dev import cpu_env
from dspark_dev.engine import child_env
from dspark_dev.proc import dump_group_stacks, kill_group, start_in_session

# Given to every GPU child (on top of the caller's environment).
GPU_CHILD_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # FlashInfer is not in the GPU kit
    "VLLM_HOST_IP": "127.0.0.1",  # loopback only: the GPU machine has no network
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "90",  # a stuck step becomes an engine error
    "VLLM_ENGINE_READY_TIMEOUT_S": "330",  # compile + graph capture of several engines at once
}

# vLLM's CPU platform from the CUDA-less wheel: the one CPU environment (dspark_dev/cpu_env.py),
# with the engine extras (small KV cache, step timeout); a CPU :class:`Server`'s base.
CPU_ENV = {**cpu_env.CPU_ENV, **cpu_env.CPU_ENGINE_EXTRA}


class CaseFailure(AssertionError):
    """A case crashed, hung or returned nothing; the message has the phase and the log tail."""


def tail(text: str, n: int = 5000) -> str:
    return text[-n:]


def artifact_dir() -> Path | None:
    d = os.environ.get("DSPARK_GPU_ARTIFACTS")
    if not d:
        return None
    p = Path(d)
    p.mkdir(parents=True, exist_ok=True)
    return p


def save_artifact(name: str, text: str, limit: int = 2_000_000) -> str | None:
    """Keep (the end of) a log for the lead; returns its path or None when no dir is set."""
    d = artifact_dir()
    if d is None:
        return None
    path = d / re.sub(r"[^A-Za-z0-9._-]", "_", name)
    path.write_text(text[-limit:])
    return str(path)


def free_port(tries: int = 200) -> int:
    """A port that is free now, drawn at random from 20000-59999 (not the kernel's ephemeral
    pick: two processes asking at once were handed the same port on the H200, 2026-12-05)."""
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(tries):
        port = rng.randrange(20000, 60000)
        if _can_bind(port):
            return port
    raise RuntimeError("no free port found")


def _can_bind(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def listening_pids(port: int) -> set[int] | None:
    """Pids with a TCP socket listening on ``port`` (Linux ``/proc``); None where ``/proc``
    cannot tell (another OS, or no permission)."""
    inodes = set()
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            if not os.path.exists(table):
                continue
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":
                        inodes.add(f"socket:[{cols[9]}]")
    except OSError:
        return None
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
            if any(os.readlink(f"/proc/{entry}/fd/{fd}") in inodes for fd in fds):
                pids.add(int(entry))
        except OSError:
            continue
    return pids


def port_served_by(port: int, group_leader: int) -> bool | None:
    """Whether a process of ``group_leader``'s process group listens on ``port`` (None: cannot
    tell). A ``/health`` that answers from another process means another server holds the port."""
    pids = listening_pids(port)
    if not pids:  # nothing readable listens there (another namespace, no permission)
        return None
    for pid in pids:
        try:
            if group_leader in (os.getpgid(pid), os.getsid(pid)):
                return True
        except OSError:
            continue
    return False


def free_port_block(width: int = 50, tries: int = 200) -> int:
    """A base port with ``width`` free ports above it (for VLLM_PORT, which vLLM counts up from)."""
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(tries):
        base = rng.randrange(20000, 60000 - width)
        if all(_can_bind(p) for p in range(base, base + width, 7)):
            return base
    raise RuntimeError("no free port block found")


def http_json(url: str, body: dict | None = None, timeout: float = 60.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


def greedy_completion_body(model: str, prompt, max_tokens: int, ignore_eos: bool = False) -> dict:
    """The ``/v1/completions`` body of a greedy request that returns token ids."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "return_token_ids": True,
    }


def http_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class ServerNotReady(CaseFailure, RuntimeError):
    """A launcher exited before its server was ready, or the server was not ready in time; the
    message names the process and ends with the tail of its log. A :class:`CaseFailure` for the
    test tiers, a ``RuntimeError`` for the tools that catch those."""


def _health_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, TimeoutError):
        return False


def _log_excerpt(server: Server) -> str:
    return f"last lines of its log ({server.log_path}):\n{tail(server.log_text())}"


def check_alive(launchers: Sequence[Server], waiting_for: str) -> None:
    """Raise :class:`ServerNotReady` naming the first of ``launchers`` that has exited (its exit
    code and the tail of its log); ``waiting_for`` names what was awaited."""
    for launcher in launchers:
        code = launcher.exited()
        if code is not None:
            raise ServerNotReady(
                f"{launcher.name} exited with code {code} before {waiting_for} was ready; "
                + _log_excerpt(launcher)
            )


def wait_ready(
    server: Server,
    timeout_s: float,
    *,
    watch: Sequence[Server] = (),
    progress_every_s: float = 15.0,
    poll_s: float = 0.5,
) -> float:
    """Wait until ``server`` answers ``/health`` with 200; the one readiness wait of every
    launcher (:class:`Server`, ``pp_launch.Deployment``, ``pd_launch.PDDeployment``).

    Only a ``/health`` served by a process of the server's own process group counts (two servers
    handed one port: the other one's answer is not ours). ``watch``: other launchers of the same
    deployment (headless PP stages, the other PD role) that must stay alive meanwhile. A line on
    stdout every ``progress_every_s`` while it waits. ``/health`` is asked at least once, even
    when ``timeout_s`` is not positive.

    Returns the seconds waited. Raises :class:`ServerNotReady` naming the process and quoting the
    tail of its log when ``server`` or a watched launcher exits first, or when ``timeout_s``
    passes; in that case every process of the server's group is first asked for its Python
    stacks, which land in its log (:mod:`vllm_dspark_pp.stack_dumps`).
    """
    if server.proc is None:
        raise ValueError(f"{server.name} was never started")
    if server.port is None:
        raise ValueError(f"{server.name} serves no API (headless): wait on its deployment's head")
    t0 = time.monotonic()
    next_note = t0 + progress_every_s
    foreign_noted = False
    while True:
        check_alive([server, *watch], server.name)
        if _health_answers(server.url):
            if port_served_by(server.port, server.proc.pid) is not False:
                return time.monotonic() - t0
            if not foreign_noted:  # another server answers on our port: keep waiting for ours
                foreign_noted = True
                print(
                    f"[serve] {server.url}/health answers, but no process of group "
                    f"{server.proc.pid} listens on that port (another server holds it); "
                    "waiting for ours",
                    file=sys.stderr,
                    flush=True,
                )
        now = time.monotonic()
        if now - t0 > timeout_s:
            dump_group_stacks(server.proc.pid)
            raise ServerNotReady(
                f"{server.name} not ready after {timeout_s:.0f} s (its processes printed their "
                f"Python stacks into its log); " + _log_excerpt(server)
            )
        if now >= next_note:
            print(
                f"[serve] {time.strftime('%H:%M:%S')} waiting for {server.name} "
                f"({now - t0:.0f} s of {timeout_s:.0f} s: loading models and warming up)",
                flush=True,
            )
            next_note = now + progress_every_s
        time.sleep(poll_s)


@dataclass
class Server:
    """One launcher (a ``vllm serve``, or any command that serves ``/health``) in its own
    process group, its output in ``log_path``; a context manager that always stops it.

    ``env`` goes on top of the base environment: ``base_env`` when given, else the CPU platform's
    (:data:`CPU_ENV`) when ``cpu``, else nothing (the caller's environment as it is); the
    checkout's root is put first on ``PYTHONPATH`` (:func:`dspark_dev.engine.child_env`).
    ``port`` None: a headless launcher (no API server). :meth:`stop` SIGTERMs the group, SIGKILLs
    it after ``grace_s`` and returns only when no member still runs.
    """

    argv: list[str]
    log_path: Path
    env: dict = field(default_factory=dict)
    port: int | None = None
    name: str = "vllm serve"
    cpu: bool = True
    base_env: dict | None = None
    grace_s: float = 15.0
    proc: subprocess.Popen | None = None

    @classmethod
    def vllm(
        cls,
        name: str,
        model: str,
        args: list[str],
        *,
        env: dict | None = None,
        port: int | None = None,
        base_env: dict | None = None,
    ) -> Server:
        """``python -m vllm.entrypoints.cli.main serve MODEL`` on loopback (no ``--host`` and
        ``--port`` when ``args`` hold ``--headless``) with ``base_env`` (default
        :data:`GPU_CHILD_ENV`), its log and its own vLLM cache (``VLLM_CACHE_ROOT``: servers
        started together must not race on torch.compile artifacts) in a fresh temporary folder;
        ``env`` goes on top. Not started."""
        port = port or free_port()
        folder = Path(tempfile.mkdtemp(prefix=f"dspark-srv-{name}-"))
        api = [] if "--headless" in args else ["--host", "127.0.0.1", "--port", str(port)]
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, *api, *args]
        return cls(
            argv,
            folder / "server.log",
            env={"VLLM_CACHE_ROOT": str(folder / "vllm_cache"), **(env or {})},
            port=port,
            name=name,
            cpu=False,
            base_env=GPU_CHILD_ENV if base_env is None else base_env,
            grace_s=8.0,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        base = self.base_env if self.base_env is not None else (CPU_ENV if self.cpu else {})
        env = child_env(base, self.env)  # this checkout first on PYTHONPATH
        self.log_path = Path(self.log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = start_in_session(self.argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout_s: float) -> float:
        """:func:`wait_ready` on this server; returns the seconds waited."""
        return wait_ready(self, timeout_s)

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_text(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 4000) -> str:
        return self.log_text()[-n:]

    def save_log(self, prefix: str = "server") -> str | None:
        return save_artifact(f"{prefix}_{self.name}.log", self.log_text())

    def wait_exit(self, timeout_s: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float | None = None) -> bool:
        """SIGTERM the group, SIGKILL it after ``grace_s`` (default :attr:`grace_s`); True if the
        SIGTERM sufficed. Returns only when no member of the group runs any more (or after 10 s
        more)."""
        if self.proc is None:
            return True
        return kill_group(self.proc, grace_s=self.grace_s if grace_s is None else grace_s)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class Timings:
    marks: list[tuple[str, float]] = field(default_factory=list)

    def mark(self, what: str) -> None:
        self.marks.append((what, time.monotonic()))

    def describe(self) -> str:
        if not self.marks:
            return ""
        t0 = self.marks[0][1]
        return ", ".join(f"{w} +{t - t0:.0f}s" for w, t in self.marks)
