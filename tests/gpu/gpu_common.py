"""Shared constants and helpers of the one-GPU tier (imported by tests/gpu/conftest.py and
tests)."""

from __future__ import annotations

import datetime
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from support.env import CPU_ENV

from dspark_dev.provenance import record_commit  # a GPU record's commit

WAVE_SIZES = (3, 5, 7)  # against decode graphs of 4 and 8 requests: every wave is padded
MAX_TOKENS = 48
GRAPH_COMPILATION_CONFIG = {
    "decode_cudagraph_capture_request_sizes": [4, 8],
    "prefill_cudagraph_capture_token_sizes": [8, 16, 32, 64, 128, 256, 512],
}
TIMEOUTS = {"eager": 300, "graphs": 380, "pd": 420}
# DSPARK_GPU_JOBS=a,b: start only these engine jobs (a partial GPU run within a short lease).
ONLY_JOBS = frozenset(j for j in os.environ.get("DSPARK_GPU_JOBS", "").split(",") if j) or None
PD_EAGER = os.environ.get("DSPARK_GPU_PD_EAGER", "0") == "1"
# Developer knob: run the engine jobs on vLLM's CPU platform (float32, eager, no PD) to check the
# tier's plumbing without a GPU. Never set on the GPU machine; graph assertions fail under it.
DRYRUN_CPU = os.environ.get("DSPARK_GPU_DRYRUN_CPU") == "1"
CPU_DRYRUN_ENV = {**CPU_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}
if DRYRUN_CPU:  # the CPU is far slower: short outputs, long deadlines
    MAX_TOKENS = 8
    TIMEOUTS = {k: 3 * v for k, v in TIMEOUTS.items()}
CPU_DRYRUN_LLM = {
    "dtype": "float32",
    "enforce_eager": True,
    "kv_cache_memory_bytes": None,
    "gpu_memory_utilization": None,
}

# The trained tiny pair (models/tiny-pair, docs/tiny-pair.md) for the PD acceptance comparison: the
# random pair above accepts only at draft position 0, so its decoder-vs-aggregated acceptance
# proves little. Float32 by default: the pair (head dim 32) was run on the H200 in float32 only
# (tests/gpu/test_tiny_pair_gpu.py, TRITON_ATTN); DSPARK_GPU_PAIR_DTYPE=bfloat16 switches it.
PAIR_DTYPE = os.environ.get("DSPARK_GPU_PAIR_DTYPE", "float32")
PAIR_NUM_PROMPTS = 7  # one wave, sent concurrently to PD like the random pair's last wave
PAIR_MAX_TOKENS = 64  # the held-out answers end at EOS after 23-56 tokens
PAIR_SAMPLING = {"max_tokens": PAIR_MAX_TOKENS, "ignore_eos": False}


def cuda_status() -> tuple[bool, str]:
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return False, f"torch not importable: {e}"
    if not torch.cuda.is_available():
        return (
            False,
            "torch.cuda.is_available() is False (no GPU, or CUDA_VISIBLE_DEVICES hides it)",
        )
    return True, torch.cuda.get_device_name(0)


def require_cuda() -> None:
    if DRYRUN_CPU:
        return
    ok, why = cuda_status()
    if not ok:
        pytest.skip(f"needs a CUDA GPU: {why}")


def make_prompts(seed: int = 1234, sizes=WAVE_SIZES, vocab: int = 512) -> list[list[list[int]]]:
    """Distinct token-id prompts (no special ids 0-3), 6-40 tokens, one list per wave."""
    import random

    rng = random.Random(seed)
    return [
        [[rng.randrange(4, vocab) for _ in range(rng.randrange(6, 41))] for _ in range(n)]
        for n in sizes
    ]


def pair_prompts(n: int = PAIR_NUM_PROMPTS) -> list[list[int]]:
    """The first ``n`` held-out prompts of the pair's corpus, as token ids
    (tests/support/tiny_pair.py)."""
    from support import tiny_pair

    return tiny_pair.heldout_prompts(n)


def fixed_graph_batch_key() -> str | None:
    if importlib.util.find_spec("vllm_dspark_pp.protocol.graph_batch") is None:
        return None
    from vllm_dspark_pp.protocol import graph_batch

    return getattr(graph_batch, "KEY", None)


def select_jobs(
    raw: str, knob: str, all_jobs: tuple[str, ...], default_jobs: tuple[str, ...]
) -> frozenset[str]:
    """The jobs a ``knob=a,b`` value selects (``raw``, read by the caller): ``all`` for every one,
    empty for ``default_jobs``; an unknown name is a usage error."""
    raw = raw.strip()
    if raw == "all":
        return frozenset(all_jobs)
    chosen = frozenset(j for j in raw.split(",") if j) or frozenset(default_jobs)
    unknown = sorted(chosen - set(all_jobs))
    if unknown:
        raise pytest.UsageError(f"{knob}: unknown jobs {unknown}; known: {list(all_jobs)}")
    return chosen


def record_date() -> str:
    """A GPU record's date (UTC, to the minute)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def record_command() -> str:
    """The pytest command line a GPU record came from."""
    return " ".join([os.path.basename(sys.executable), "-m", "pytest", *sys.argv[1:]])


def source_sha256(repo, extra: tuple[str, ...] = ()) -> str:
    """A fingerprint of the code under test: the plugin's sources and ``extra`` (paths relative to
    ``repo``: the launcher composition, the tests), to match a record with a commit where the GPU
    machine has no git history."""
    repo = Path(repo)
    h = hashlib.sha256()
    files = sorted((repo / "vllm_dspark_pp").rglob("*.py")) + [repo / f for f in extra]
    for f in files:
        h.update(str(f.relative_to(repo)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


class GpuRecord:
    """A GPU group's JSON record (the form of tests/gpu/test_tp_pp_one_gpu.py's ``tp_pp.json``):
    every check's verdict, set before its test asserts it, then written with the run's provenance
    and its jobs when the module's jobs shut down. ``file``: the record's name."""

    def __init__(self, file: str):
        self.file = file
        self.verdicts: dict[str, dict] = {}

    def verdict(self, check: str, ok: bool | None, detail: str) -> None:
        """``ok`` None: an outcome recorded without a verdict (a stock control's)."""
        self.verdicts[check] = {"ok": None if ok is None else bool(ok), "detail": detail[:4000]}

    def write(self, repo, test: str, fields: dict, *, out, fallback, sources=()) -> Path:
        """Writes ``{provenance, **fields, verdicts}`` into ``out`` (the value of the module's
        ``*_OUT`` knob, which the caller reads by its literal name), else
        ``$DSPARK_GPU_ARTIFACTS``, else ``fallback`` (None: a new temporary folder); ``sources``:
        what :func:`source_sha256` hashes beside the plugin (``test`` always)."""
        out_dir = Path(
            out
            or os.environ.get("DSPARK_GPU_ARTIFACTS")
            or fallback
            or tempfile.mkdtemp(prefix=f"dspark-{Path(self.file).stem}-")
        )
        out_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "test": test,
            "commit": record_commit(repo),
            "source_sha256": source_sha256(repo, (*sources, test)),
            "date": record_date(),
            "gpu": "CPU dry run" if DRYRUN_CPU else cuda_status()[1],
            "command": record_command(),
            "knobs": {k: v for k, v in os.environ.items() if k.startswith("DSPARK_GPU_")},
            **fields,
            "verdicts": self.verdicts,
        }
        path = out_dir / self.file
        path.write_text(json.dumps(record, indent=1, default=str))
        print(f"GPU record: {path}")
        return path


def llm_result_summary(res) -> dict:
    """What a record keeps of an ``LLMResult`` (a PP=1 reference run)."""
    return {
        "startup_s": res.startup_s,
        "num_tokens": sum(len(t) for t in res.tokens),
        "counters": res.metrics(),
    }


def recorded_result(jobs: Jobs, name: str, into: dict, summarize, timeout: float = 1200):
    """``jobs.result(name)``, with what it gave (``summarize(result)``) or the failure it raised
    kept in ``into[name]`` for the record; a skipped job's skip goes on unrecorded."""
    try:
        res = jobs.result(name, timeout=timeout)
    except pytest.skip.Exception:
        raise
    except Exception as e:
        into[name] = {"error": f"{type(e).__name__}: {e}"[:4000]}
        raise
    into.setdefault(name, summarize(res))
    return res


def job_summary(jobs: Jobs, name: str, *, selected: bool, summarize, shape=None) -> dict:
    """One job's part of a record: its shape, whether it was selected, how long it ran, and what
    ``summarize(result)`` keeps of its result (else why it has none: skipped, or the error it
    raised, or still running)."""
    out: dict = {"selected": selected, "elapsed_s": jobs.elapsed(name)}
    if shape is not None:
        out["shape"] = shape
    if not selected:
        return out
    try:
        res = jobs.result(name, timeout=0)
    except pytest.skip.Exception as exc:
        out["skipped"] = str(exc)[:2000]
        return out
    except BaseException as exc:  # noqa: BLE001 - recorded
        out["error"] = f"{type(exc).__name__}: {str(exc)[:3000]}"
        return out
    out.update(summarize(res))
    return out


class Jobs:
    """Named background jobs; ``result(name)`` waits for one and re-raises its failure."""

    def __init__(
        self,
        only: frozenset[str] | None = None,
        max_workers: int = 8,
        knob: str = "DSPARK_GPU_JOBS",
    ):
        self._only = only
        self._knob = knob
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="gpu-job")
        self._futures: dict[str, Future] = {}
        self._skipped: dict[str, str] = {}
        self._started: dict[str, float] = {}
        self._ended: dict[str, float] = {}
        self._lock = threading.Lock()

    def submit(self, name: str, fn, *args, **kwargs) -> None:
        if self._only is not None and name not in self._only:
            self.skip(
                name, f"job {name!r} not selected by {self._knob}={','.join(sorted(self._only))}"
            )
            return

        def run():
            self._started[name] = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                self._ended[name] = time.monotonic()

        self._futures[name] = self._pool.submit(run)

    def skip(self, name: str, reason: str) -> None:
        self._skipped[name] = reason

    def result(self, name: str, timeout: float = 600):
        if name in self._skipped:
            pytest.skip(self._skipped[name])
        fut = self._futures[name]
        return fut.result(timeout=timeout)

    def elapsed(self, name: str) -> float | None:
        if name in self._started and name in self._ended:
            return round(self._ended[name] - self._started[name], 1)
        return None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def spec_config(models, **extra) -> dict:
    cfg = {"method": "dspark", "model": models.draft}
    cfg.update(extra)
    return cfg


def pd_fault_args() -> list[str]:
    """``vllm serve`` arguments of both sides of the PD fault groups (``pd_kill``,
    ``pd_decoder_kill``): the trained pair, 512 tokens, CUDA graphs, async scheduling, a small
    share of the GPU (eager float32 on the CPU dry run)."""
    if DRYRUN_CPU:
        return ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
                "--max-num-seqs", "16", "--seed", "0"]  # fmt: skip
    return [
        "--dtype", PAIR_DTYPE, "--max-model-len", "512", "--max-num-seqs", "16", "--seed", "0",
        "--gpu-memory-utilization", "0.05", "--kv-cache-memory-bytes", str(512 << 20),
        "--compilation-config", json.dumps(GRAPH_COMPILATION_CONFIG), "--async-scheduling",
    ]  # fmt: skip
