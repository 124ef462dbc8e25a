"""CPU end-to-end harness: one vLLM generation per fresh subprocess, with a hard wall-clock limit.

Public API (stable; other test tiers and benchmarks import it)::

    from e2e.harness import run_generate, Result, E2EFailure

    res = run_generate(
        {"model": target, "speculative_config": {"model": draft}, "pipeline_parallel_size": 2},
        prompts=["the quick brown fox", [5, 6, 7]],      # text or token-id lists
        timeout_s=90,                                    # hard limit for the whole process tree
        sampling={"max_tokens": 24},                     # SamplingParams kwargs (greedy by default)
        async_scheduling=False,                          # True: forced on after the CPU hook
        abort={"index": 1, "after_tokens": 5},           # optional: abort a request mid-stream
    )
    res.tokens            # list[list[int]], one per prompt
    res.metrics           # {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos"}

``cfg`` is passed to ``vllm.LLM(**cfg)`` after the harness's defaults (float32, eager mode,
``distributed_executor_backend="mp"``, small KV cache, ``disable_log_stats=False``).

Hang protection: the child runs in its own process group (session); when ``timeout_s`` passes
(start-up, warm-up and shutdown included) the whole group is killed with SIGKILL and
:class:`E2EFailure` is raised with the log tail. Inside vLLM, ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``
(default here 45 s) bounds each execute/sample/draft call so a stuck PP rank surfaces as an
engine error before the hard limit. Set ``DSPARK_E2E_LOG_DIR`` to keep every case's full log.
The child's environment is the CPU test environment
(``tests/conftest.py``) plus ``env``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

WORKER = Path(__file__).with_name("_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[2]

CPU_TEST_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "TRITON_INTERPRET": "1",
    "CUDA_VISIBLE_DEVICES": "",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "45",
    "VLLM_ENGINE_READY_TIMEOUT_S": "120",
}

DEFAULT_LLM_KWARGS = {
    "dtype": "float32",
    "enforce_eager": True,
    "distributed_executor_backend": "mp",
    "max_model_len": 512,
    "max_num_seqs": 8,
    "seed": 0,
    "disable_log_stats": False,
}

DEFAULT_TIMEOUT_S = 90.0


class E2EFailure(AssertionError):
    """The case failed, crashed or hung; the message carries the reason and the log tail.

    ``hung`` tells a hard-limit kill from a failure; ``pgid`` is the killed process group.
    """

    def __init__(self, msg: str, *, hung: bool = False, pgid: int | None = None):
        super().__init__(msg)
        self.hung = hung
        self.pgid = pgid


@dataclass
class Result:
    tokens: list[list[int]]
    metrics: dict
    finish_reasons: list[str | None]
    config: dict
    wall_s: float
    startup_s: float
    logprobs: list = field(default_factory=list)
    aborted: bool = False
    log_tail: str = ""

    @property
    def acceptance(self) -> tuple[int, int, int]:
        m = self.metrics
        return m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"]


def _tail(text: str, n: int = 6000) -> str:
    return text[-n:]


def live_group_members(pgid: int) -> list[int]:
    """PIDs in process group ``pgid`` that are still running (zombies count as dead).

    A SIGKILLed vLLM worker whose parent died first is reparented to PID 1 and stays a zombie
    until PID 1 reaps it; ``os.killpg(pgid, 0)`` still succeeds then, although nothing runs.
    """
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


def _kill_group(proc: subprocess.Popen, settle_s: float = 10.0) -> None:
    """SIGKILL the whole group, reap our child, and wait until no member of the group runs."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=settle_s)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + settle_s
    while live_group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def run_generate(
    cfg: dict,
    prompts: list,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    sampling: dict | None = None,
    async_scheduling: bool = False,
    abort: dict | None = None,
    env: dict | None = None,
) -> Result:
    """Run ``vllm.LLM(**cfg)`` on ``prompts`` in a fresh process tree; see the module docstring."""
    llm_kwargs = dict(DEFAULT_LLM_KWARGS)
    llm_kwargs.update(cfg)
    spec = {
        "llm": llm_kwargs,
        "prompts": prompts,
        "sampling": sampling or {},
        "async_scheduling": bool(async_scheduling),
        "abort": abort,
    }
    child_env = dict(os.environ)
    child_env.update(CPU_TEST_ENV)
    child_env.update(env or {})
    pypath = [str(REPO_ROOT)] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    child_env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(pypath))

    with tempfile.TemporaryDirectory(prefix="dspark-e2e-") as tmp:
        spec_path, result_path, log_path = (os.path.join(tmp, n) for n in ("spec.json", "result.json", "log.txt"))
        Path(spec_path).write_text(json.dumps(spec))
        t0 = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, str(WORKER), spec_path, result_path],
                env=child_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # own process group: the kill reaches every vLLM child
            )
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                # Whatever happened, nothing of this case survives it (stray workers included).
                _kill_group(proc)
        wall = time.monotonic() - t0
        log_text = Path(log_path).read_text(errors="replace")
        keep = os.environ.get("DSPARK_E2E_LOG_DIR")
        if keep:  # debugging aid: keep every case's full log
            os.makedirs(keep, exist_ok=True)
            Path(keep, f"case-{int(time.time() * 1000)}.log").write_text(log_text)
        result = json.loads(Path(result_path).read_text()) if os.path.exists(result_path) else {}

    desc = (
        f"pp={llm_kwargs.get('pipeline_parallel_size', 1)} "
        f"spec={'yes' if llm_kwargs.get('speculative_config') else 'no'} "
        f"async={async_scheduling}"
    )
    if timed_out:
        raise E2EFailure(
            f"e2e case [{desc}] HUNG: killed after {timeout_s:.0f} s in phase "
            f"{result.get('phase', 'import')!r}.\n--- log tail ---\n{_tail(log_text)}",
            hung=True,
            pgid=proc.pid,
        )
    if not result.get("ok"):
        raise E2EFailure(
            f"e2e case [{desc}] failed (exit {proc.returncode}) in phase {result.get('phase')!r}: "
            f"{result.get('error', 'no result written')}\n{result.get('traceback', '')}"
            f"\n--- log tail ---\n{_tail(log_text)}",
            pgid=proc.pid,
        )
    return Result(
        tokens=result["tokens"],
        metrics=result["metrics"],
        finish_reasons=result["finish_reasons"],
        config=result["config"],
        wall_s=round(wall, 2),
        startup_s=result.get("startup_s", 0.0),
        logprobs=result.get("logprobs") or [],
        aborted=result.get("aborted", False),
        log_tail=_tail(log_text, 3000),
    )
