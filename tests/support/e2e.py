"""CPU end-to-end runs: one vLLM generation per fresh process group, with a hard deadline.

::

    from support.e2e import run_generate, Result, E2EFailure

    res = run_generate(
        {"model": target, "speculative_config": {"model": draft}, "pipeline_parallel_size": 2},
        prompts=["the quick brown fox", [5, 6, 7]],      # text or token-id lists
        timeout_s=90,                                    # hard limit for the whole process tree
        sampling={"max_tokens": 24},                     # SamplingParams kwargs (greedy by default)
        async_scheduling=False,                          # True: forced on after the CPU hook
        abort={"index": 1, "after_tokens": 5},           # optional: abort a request mid-stream
        extra_waves=[{"prompts": [[5, 6]] * 4,           # optional: more waves after the first,
                      "sampling": [{"temperature": 1.0, "seed": s} for s in range(4)]}],
    )
    res.tokens            # list[list[int]], one per prompt
    res.metrics           # {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
    "accepted_per_pos"}
    res.waves             # every wave's raw result (tokens, metrics, step_lengths, ...), first
                          # wave included

Independent cases a fixture needs together run two at a time (``run_together``; the knob
``DSPARK_E2E_PARALLEL``, default 2, 1 = one at a time): a case's start-up imports vLLM in three
processes one after the other, keeping one core of the two busy, so two cases overlap there
(two pair runs: 72-80 s together against 100-112 s one after the other, 2026-12-05, load 3-7).

An extra wave's ``sampling`` is merged over ``sampling`` (a dict: for all its requests; a list:
one dict per request), so one engine start serves a greedy wave and then, say, many seeded
sampled requests (``wave_sampling`` of :mod:`dspark_dev.engine_worker`).

``cfg`` goes to ``vllm.LLM(**cfg)`` after the defaults below (float32, eager mode,
``distributed_executor_backend="mp"``, small KV cache, ``disable_log_stats=False``). The child is
``dspark_dev.engine_worker`` run by ``dspark_dev.engine.run_engine`` (the one
runner, shared with the GPU tier): own process group, SIGKILLed when ``timeout_s`` passes
(start-up, warm-up and generation included) and after every case anyway; a case returns as soon
as its result is written, and vLLM's shutdown (3-4 s, nothing checks it) finishes in the
background before the group is killed (``return_at_shutdown`` of ``run_engine``). Set
``DSPARK_E2E_LOG_DIR`` to keep every case's full log (shutdown included: then each case waits for
it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dspark_dev.engine import child_env, run_engine
from support.env import CPU_E2E_EXTRA, CPU_ENV

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
PARALLEL_ENV = "DSPARK_E2E_PARALLEL"


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
    texts: list[str]
    metrics: dict
    finish_reasons: list[str | None]
    config: dict
    wall_s: float
    startup_s: float
    logprobs: list = field(default_factory=list)
    aborted: bool = False
    waves: list = field(default_factory=list)
    log_tail: str = ""
    log_text: str = ""  # the whole log of the case (engine core and workers included)

    @property
    def acceptance(self) -> tuple[int, int, int]:
        m = self.metrics
        return m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"]


def run_generate(
    cfg: dict,
    prompts: list,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    sampling: dict | None = None,
    async_scheduling: bool = False,
    abort: dict | None = None,
    env: dict | None = None,
    extra_waves: list[dict] | None = None,
) -> Result:
    """Run ``vllm.LLM(**cfg)`` on ``prompts`` in a fresh process tree; see the module docstring."""
    llm_kwargs = {**DEFAULT_LLM_KWARGS, **cfg}
    spec = {
        "name": "e2e",
        "llm": llm_kwargs,
        "waves": [prompts] + [w["prompts"] for w in extra_waves or []],
        "wave_sampling": [None] + [w.get("sampling") for w in extra_waves or []],
        "sampling": {"max_tokens": 32, **(sampling or {})},
        "async_scheduling": bool(async_scheduling),
        "abort": abort,
    }
    keep = os.environ.get("DSPARK_E2E_LOG_DIR")
    run = run_engine(
        spec,
        timeout_s=timeout_s,
        env=child_env({**CPU_ENV, **CPU_E2E_EXTRA}, env),
        return_at_shutdown=not keep,  # a kept log runs to the end of vLLM's shutdown
    )
    if keep:  # debugging aid: keep every case's full log
        os.makedirs(keep, exist_ok=True)
        Path(keep, f"case-{int(time.time() * 1000)}.log").write_text(run.log_text)
    desc = (
        f"pp={llm_kwargs.get('pipeline_parallel_size', 1)} "
        f"spec={'yes' if llm_kwargs.get('speculative_config') else 'no'} "
        f"async={async_scheduling}"
    )
    res = run.result
    if run.timed_out:
        raise E2EFailure(
            f"e2e case [{desc}] HUNG: killed after {timeout_s:.0f} s in phase {run.phase!r}.\n"
            f"--- log tail ---\n{run.log_text[-6000:]}",
            hung=True,
            pgid=run.pgid,
        )
    if not run.ok:
        raise E2EFailure(
            f"e2e case [{desc}] failed (exit {run.returncode}) in phase {run.phase!r}: "
            f"{res.get('error', 'no result written')}\n{res.get('traceback', '')}"
            f"\n--- log tail ---\n{run.log_text[-6000:]}",
            pgid=run.pgid,
        )
    wave = res["waves"][0]
    return Result(
        tokens=wave["tokens"],
        texts=wave["texts"],
        metrics=wave["metrics"],
        finish_reasons=wave["finish_reasons"],
        config=res["config"],
        wall_s=run.wall_s,
        startup_s=res.get("startup_s", 0.0),
        logprobs=wave.get("logprobs") or [],
        aborted=wave["aborted"],
        waves=res["waves"],
        log_tail=run.log_text[-3000:],
        log_text=run.log_text,
    )


def parallel_cases() -> int:
    """How many engine cases :func:`run_together` runs at once (``DSPARK_E2E_PARALLEL``, default
    2)."""
    return max(1, int(os.environ.get(PARALLEL_ENV, "2")))


def run_together(cases: dict[str, Callable[[], Result]]) -> dict[str, Result | BaseException]:
    """Run independent engine cases (name -> a call of :func:`run_generate`), at most
    :func:`parallel_cases` at a time, and return each one's result or the failure it raised (the
    caller raises it where that case is used). Only cases whose results do not depend on timing
    belong here: nothing else runs beside them, but each takes longer."""
    out: dict[str, Result | BaseException] = {}
    workers = min(parallel_cases(), len(cases))
    if workers <= 1:
        for name, case in cases.items():
            try:
                out[name] = case()
            except (Exception, pytest.fail.Exception) as exc:  # noqa: BLE001 - raised by the caller
                out[name] = exc
        return out
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="e2e-case") as pool:
        futures = {name: pool.submit(case) for name, case in cases.items()}
    for name, future in futures.items():
        exc = future.exception()
        out[name] = exc if exc is not None else future.result()
    return out


def result_of(results: dict[str, Result | BaseException], name: str) -> Result:
    """``results[name]`` of :func:`run_together`, raising the failure of that case."""
    res = results[name]
    if isinstance(res, BaseException):
        raise res
    return res
