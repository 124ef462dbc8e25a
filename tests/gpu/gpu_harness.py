"""One-GPU harness: vLLM engines and servers in their own process groups, each with a hard deadline.

* :func:`run_llm` runs ``vllm.LLM(**cfg)`` in a fresh subprocess (``_gpu_llm_worker.py``) over
  *waves* of prompts (each wave is submitted together and drained before the next, so the decode
  batch sizes are the wave sizes) and returns tokens, top-k logprobs, per-wave spec-decode
  counters and the resolved config. A child that passes its deadline is killed with its whole
  process group and the failure names the phase it was in.
* :class:`Server` starts ``vllm serve`` (``python -m vllm.entrypoints.cli.main serve``), waits for
  ``/health`` while checking the process is alive, and always kills its process group on exit.
* :func:`artifact_dir` is where failing cases leave their logs (``DSPARK_GPU_ARTIFACTS``; the suite
  script packs it into one archive under ``$OUT``).

Everything here is plain stdlib + the vLLM in the child; nothing is imported from vLLM in the
parent except by the tests that want to.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

GPU_DIR = Path(__file__).resolve().parent
REPO_ROOT = GPU_DIR.parents[1]
WORKER = GPU_DIR / "_gpu_llm_worker.py"

# Given to every child (on top of the caller's environment).
CHILD_ENV = {
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

DEFAULT_LLM_KWARGS = {
    "dtype": "bfloat16",
    "max_model_len": 512,
    "max_num_seqs": 8,
    "seed": 0,
    "gpu_memory_utilization": 0.12,
    # A fixed KV budget: several engines share the GPU, and this skips the memory profile
    # (which would count the other processes' allocations) and the extensible KV cache.
    "kv_cache_memory_bytes": 512 << 20,
    "disable_log_stats": False,
}


class GPUCaseFailure(AssertionError):
    """A case crashed, hung or returned nothing; the message has the phase and the log tail."""


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
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    path = d / safe
    path.write_text(text[-limit:])
    return str(path)


def tail(text: str, n: int = 5000) -> str:
    return text[-n:]


def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(CHILD_ENV)
    # The project and tests/gpu must be importable in every vLLM process of the child.
    parts = [str(REPO_ROOT), str(GPU_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    env.update(extra or {})
    return env


def _pgid_file(proc: subprocess.Popen) -> Path | None:
    d = os.environ.get("DSPARK_GPU_PGID_DIR")
    return Path(d) / str(proc.pid) if d else None


def register_group(proc: subprocess.Popen) -> None:
    """Note the child's process group so tools/gpu/run_gpu_suite.sh can kill it if pytest itself dies."""
    f = _pgid_file(proc)
    if f is not None:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(str(proc.pid))


def kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM then SIGKILL the child's whole process group (it was started with its own session)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:  # stragglers (engine core, workers) die with the group even if the leader exited
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    f = _pgid_file(proc)
    if f is not None:
        f.unlink(missing_ok=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_block(width: int = 50, tries: int = 200) -> int:
    """A base port with ``width`` free ports above it (for VLLM_PORT, which vLLM counts up from)."""
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(tries):
        base = rng.randrange(20000, 60000 - width)
        ok = True
        for p in range(base, base + width, 7):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port block found")


# ----------------------------------------------------------------------------------------- LLM
@dataclass
class LLMResult:
    name: str
    waves: list[dict]  # each: {"tokens": [[...]], "logprobs": [[{tok: lp}]] | None, "metrics": {...}}
    config: dict
    probe: list | None
    startup_s: float
    wall_s: float
    log_tail: str = ""
    log_path: str | None = None

    @property
    def tokens(self) -> list[list[int]]:
        return [t for w in self.waves for t in w["tokens"]]

    @property
    def logprobs(self) -> list:
        return [lp for w in self.waves for lp in (w.get("logprobs") or [None] * len(w["tokens"]))]

    def metrics(self, wave: int | None = None) -> dict:
        """Spec-decode counters of one wave (a delta) or of all waves together."""
        ws = self.waves if wave is None else [self.waves[wave]]
        out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        for w in ws:
            for k in out:
                out[k] += int(w["metrics"].get(k, 0))
        return out


def run_llm(
    name: str,
    cfg: dict,
    waves: list[list[list[int]]],
    *,
    timeout_s: float,
    sampling: dict | None = None,
    logprobs: int | None = None,
    probe: bool = False,
    env: dict | None = None,
) -> LLMResult:
    """Run one engine over ``waves`` of token-id prompts in a fresh process group."""
    llm_kwargs = dict(DEFAULT_LLM_KWARGS)
    llm_kwargs.update(cfg)
    llm_kwargs = {k: v for k, v in llm_kwargs.items() if v is not None}  # None drops a default
    spec = {
        "name": name,
        "llm": llm_kwargs,
        "waves": waves,
        "sampling": sampling or {},
        "logprobs": logprobs,
        "probe": probe,
    }
    extra = dict(env or {})
    if probe:  # collective_rpc with a callable needs pickled functions
        extra.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    tmp = tempfile.mkdtemp(prefix=f"dspark-gpu-{name}-")
    # own vLLM cache (torch.compile artifacts): engines that start together must not race on one
    extra.setdefault("VLLM_CACHE_ROOT", os.path.join(tmp, "vllm_cache"))
    spec_path, result_path, log_path = (os.path.join(tmp, n) for n in ("spec.json", "result.json", "log.txt"))
    Path(spec_path).write_text(json.dumps(spec))
    t0 = time.monotonic()
    timed_out = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), spec_path, result_path],
            env=child_env(extra),
            cwd=str(REPO_ROOT),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        register_group(proc)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_group(proc)
    wall = time.monotonic() - t0
    log_text = Path(log_path).read_text(errors="replace")
    try:
        result = json.loads(Path(result_path).read_text())
    except (OSError, ValueError):
        result = {}
    shutil.rmtree(tmp, ignore_errors=True)
    ok = result.get("ok") and not timed_out
    saved = save_artifact(f"llm_{name}.log", log_text) if not ok else None
    where = f" (full log: {saved})" if saved else ""
    if timed_out:
        raise GPUCaseFailure(
            f"[{name}] HUNG: killed after {timeout_s:.0f} s in phase {result.get('phase', 'import')!r}"
            f"{where}\n--- log tail ---\n{tail(log_text)}"
        )
    if not result.get("ok"):
        raise GPUCaseFailure(
            f"[{name}] failed (exit {proc.returncode}) in phase {result.get('phase', 'import')!r}: "
            f"{result.get('error', 'no result written')}{where}\n{result.get('traceback', '')}"
            f"\n--- log tail ---\n{tail(log_text)}"
        )
    return LLMResult(
        name=name,
        waves=result["waves"],
        config=result.get("config", {}),
        probe=result.get("probe"),
        startup_s=result.get("startup_s", 0.0),
        wall_s=round(wall, 1),
        log_tail=tail(log_text, 3000),
    )


# -------------------------------------------------------------------------------------- server
class Server:
    """``vllm serve`` in its own process group; use as a context manager (always killed)."""

    def __init__(self, name: str, model: str, args: list[str], env: dict | None = None, port: int | None = None):
        self.name = name
        self.model = model
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self._logdir = tempfile.mkdtemp(prefix=f"dspark-gpu-srv-{name}-")
        # own vLLM cache (torch.compile artifacts), as for run_llm
        self.env = child_env({"VLLM_CACHE_ROOT": os.path.join(self._logdir, "vllm_cache"), **(env or {})})
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(self._logdir, "server.log")
        self._log = None

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", self.model,
            "--host", "127.0.0.1", "--port", str(self.port), *self.args,
        ]  # fmt: skip

    def start(self) -> Server:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.command(),
            env=self.env,
            cwd=str(REPO_ROOT),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        register_group(self.proc)
        return self

    def log_text(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, deadline: float) -> None:
        """Poll /health until it answers 200; fail at once if the process dies."""
        while True:
            if not self.alive():
                rc = self.proc.returncode if self.proc else None
                raise GPUCaseFailure(f"server {self.name} exited (rc={rc}) during start-up\n{tail(self.log_text())}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise GPUCaseFailure(f"server {self.name} not ready before its deadline\n{tail(self.log_text())}")
            time.sleep(1.0)

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


def http_json(url: str, body: dict | None = None, timeout: float = 60.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


def http_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


_PROM_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum every sample of each metric over its label sets, keyed ``name`` and ``name{labels}``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _PROM_LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        out[name] = out.get(name, 0.0) + value
        if labels:
            out[name + labels] = value
    return out


SPEC_COUNTERS = {
    "num_drafts": "vllm:spec_decode_num_drafts_total",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}


_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total{"
_POSITION = re.compile(r'position="(\d+)"')


def spec_counters(metrics: dict[str, float]) -> dict:
    """The spec-decode totals of a /metrics page, plus ``accepted_per_pos`` (list by position)."""
    out: dict = {k: int(metrics.get(v, 0)) for k, v in SPEC_COUNTERS.items()}
    per_pos: dict[int, int] = {}
    for key, value in metrics.items():
        if key.startswith(_PER_POS) and (m := _POSITION.search(key)):
            per_pos[int(m.group(1))] = per_pos.get(int(m.group(1)), 0) + int(value)
    out["accepted_per_pos"] = [per_pos[i] for i in sorted(per_pos)]
    return out


def counter_delta(before: dict, after: dict) -> dict:
    out = {}
    for k, v in after.items():
        if isinstance(v, list):
            b = before.get(k) or [0] * len(v)
            out[k] = [y - x for x, y in zip(b, v, strict=False)]
        else:
            out[k] = v - before.get(k, 0)
    return out


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
