"""One-GPU engine runs: ``vllm.LLM`` over *waves* of prompts in a fresh process group.

:func:`run_llm` runs the one engine runner (``dspark_dev.engine.run_engine``) with the
GPU defaults and returns tokens, top-k logprobs, per-wave spec-decode counters and the resolved
config; a child that passes its deadline is killed with its whole process group and the failure
names the phase it was in (its log is saved under ``DSPARK_GPU_ARTIFACTS``). Servers, ports and
the metrics reader are in ``dspark_dev``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark_dev.engine import child_env, run_engine
from dspark_dev.metrics import EMPTY, counter_sum
from dspark_dev.serve import GPU_CHILD_ENV, CaseFailure, save_artifact

GPUCaseFailure = CaseFailure

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


@dataclass
class LLMResult:
    name: str
    waves: list[dict]  # each: {"tokens", "logprobs" (or None), "metrics", "finish_reasons", ...}
    config: dict
    probe: list | None
    startup_s: float
    wall_s: float
    log_tail: str = ""
    log_path: str | None = None
    log_text: str = ""

    @property
    def tokens(self) -> list[list[int]]:
        return [t for w in self.waves for t in w["tokens"]]

    @property
    def logprobs(self) -> list:
        return [lp for w in self.waves for lp in (w.get("logprobs") or [None] * len(w["tokens"]))]

    def metrics(self, wave: int | None = None) -> dict:
        """Spec-decode counters of one wave (a delta) or of all waves together, accepted tokens
        per draft position included."""
        ws = self.waves if wave is None else [self.waves[wave]]
        out = dict(EMPTY, accepted_per_pos=[])
        for w in ws:
            out = counter_sum(out, w["metrics"])
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
    llm_kwargs = {**DEFAULT_LLM_KWARGS, **cfg}
    llm_kwargs = {k: v for k, v in llm_kwargs.items() if v is not None}  # None drops a default
    sp = {"max_tokens": 48, **(sampling or {})}
    if logprobs:
        sp["logprobs"] = int(logprobs)
    spec = {"name": name, "llm": llm_kwargs, "waves": waves, "sampling": sp, "probe": probe}
    extra = dict(env or {})
    if probe:  # collective_rpc with a callable needs pickled functions
        extra.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    run = run_engine(
        spec, timeout_s=timeout_s, env=child_env(GPU_CHILD_ENV, extra), name=name, own_cache=True
    )
    result = run.result
    saved = save_artifact(f"llm_{name}.log", run.log_text) if not run.ok else None
    where = f" (full log: {saved})" if saved else ""
    if run.timed_out:
        raise GPUCaseFailure(
            f"[{name}] HUNG: killed after {timeout_s:.0f} s in phase {run.phase!r}{where}\n"
            f"--- log tail ---\n{run.log_text[-5000:]}"
        )
    if not run.ok:
        raise GPUCaseFailure(
            f"[{name}] failed (exit {run.returncode}) in phase {run.phase!r}: "
            f"{result.get('error', 'no result written')}{where}\n{result.get('traceback', '')}"
            f"\n--- log tail ---\n{run.log_text[-5000:]}"
        )
    return LLMResult(
        name=name,
        waves=result["waves"],
        config=result.get("config", {}),
        probe=result.get("probe"),
        startup_s=result.get("startup_s", 0.0),
        wall_s=round(run.wall_s, 1),
        log_tail=run.log_text[-3000:],
        log_text=run.log_text,
    )
