"""Ports, HTTP and ``vllm serve`` in its own process group (GPU tier, PD runs, benchmarks).

* :func:`free_port`, :func:`free_port_block` (a base with free ports above it, for ``VLLM_PORT``);
* :func:`http_json`, :func:`http_text`;
* :class:`Server`: ``python -m vllm.entrypoints.cli.main serve``, waits for ``/health`` while
  checking the process is alive, and always kills its process group on exit;
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
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

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


def wait_for_health(
    proc: subprocess.Popen,
    url: str,
    deadline: float,
    *,
    poll_s: float = 1.0,
    progress: Callable[[float], None] | None = None,
    progress_every_s: float = 15.0,
) -> str:
    """Poll ``url/health`` until it answers 200 (the one copy for every ``vllm serve`` helper).

    Returns "ready"; "exited" when ``proc`` ends first; "late" when the monotonic ``deadline``
    passes, after asking every process of ``proc``'s group for its Python stacks (they go into
    the server's log: :mod:`vllm_dspark_pp.stack_dumps`). ``progress(elapsed_s)`` is called every
    ``progress_every_s`` while waiting.
    """
    t0 = time.monotonic()
    next_note = t0 + progress_every_s
    port = urllib.parse.urlsplit(url).port
    foreign_noted = False
    while True:
        if proc.poll() is not None:
            return "exited"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                ours = None if port is None else port_served_by(port, proc.pid)
                if r.status == 200 and ours is not False:
                    return "ready"
                if r.status == 200 and not foreign_noted:  # not ours: keep waiting for ours
                    foreign_noted = True
                    print(
                        f"[serve] {url}/health answers, but no process of group {proc.pid} "
                        "listens on that port (another server holds it); waiting for ours",
                        file=sys.stderr,
                        flush=True,
                    )
        except (urllib.error.URLError, OSError, TimeoutError):
            pass
        now = time.monotonic()
        if now > deadline:
            dump_group_stacks(proc.pid)
            return "late"
        if progress is not None and now >= next_note:
            progress(now - t0)
            next_note = now + progress_every_s
        time.sleep(poll_s)


class Server:
    """``vllm serve`` in its own process group; use as a context manager (always killed)."""

    def __init__(
        self,
        name: str,
        model: str,
        args: list[str],
        env: dict | None = None,
        port: int | None = None,
        base_env: dict | None = None,
    ):
        self.name = name
        self.model = model
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self._logdir = tempfile.mkdtemp(prefix=f"dspark-srv-{name}-")
        # own vLLM cache (torch.compile artifacts): servers started together must not race
        extra = {"VLLM_CACHE_ROOT": os.path.join(self._logdir, "vllm_cache"), **(env or {})}
        self.env = child_env(GPU_CHILD_ENV if base_env is None else base_env, extra)
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(self._logdir, "server.log")
        self._log = None

    def command(self) -> list[str]:
        # a headless launcher (another node's PP stages) serves no API
        api = [] if "--headless" in self.args else ["--host", "127.0.0.1", "--port", str(self.port)]
        cli = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", self.model]
        return [*cli, *api, *self.args]

    def start(self) -> Server:
        self._log = open(self.log_path, "wb")
        self.proc = start_in_session(
            self.command(),
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        return self

    def log_text(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, deadline: float) -> None:
        """Poll /health until it answers 200; fail at once if the process dies."""
        state = wait_for_health(self.proc, self.url, deadline)
        if state == "exited":
            raise CaseFailure(
                f"server {self.name} exited (rc={self.proc.returncode}) during start-up\n"
                f"{tail(self.log_text())}"
            )
        if state == "late":
            raise CaseFailure(
                f"server {self.name} not ready before its deadline (its processes printed their "
                f"Python stacks into its log)\n{tail(self.log_text())}"
            )

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc, grace_s=8.0)
        if self._log is not None:
            self._log.close()
            self._log = None

    def save_log(self, prefix: str = "server") -> str | None:
        return save_artifact(f"{prefix}_{self.name}.log", self.log_text())

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
