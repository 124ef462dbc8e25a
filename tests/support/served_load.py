"""Sustained served load (issue 28, case 1): the parts of a load run that are not serving.

Used by tools/reliability_load.py (CPU scale) and tests/gpu/test_load_gpu.py (issue scale, two
launchers on GPU 0). Everything here is pure or reads ``/proc`` / ``/metrics``, so
tests/unit/support/test_served_load.py checks it on CPU:

* :func:`bench_argv`: the ``vllm bench serve`` arguments of one run (random dataset, streaming,
  ``--max-concurrency``, result JSON written where the caller says);
* :func:`bench_outcome`: what a run's result JSON says (completed, failed, the first errors);
* :func:`group_rss_mib`, :func:`gpu_memory_mib` (+ :func:`parse_gpu_apps`): the memory of the
  server's process groups, host and GPU;
* :func:`wait_idle`: KV-cache usage and running requests once the server is idle;
* :func:`error_lines`: the ERROR / Traceback lines of a launcher log;
* :func:`growth`: the run-over-run growth of a series (MiB) and whether it stays under a bound.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from dspark_dev.proc import live_group_members
from support.reliability import gauge, get_text


def bench_argv(
    *,
    base_url: str,
    model: str,
    num_prompts: int,
    concurrency: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    result_dir: str | Path,
    result_filename: str = "bench.json",
    temperature: float = 0.0,
    ignore_eos: bool = True,
    max_model_len: int | None = None,
) -> list[str]:
    """``vllm bench serve`` arguments (after ``bench serve``) of one run. ``max_model_len``:
    refuse lengths whose longest prompt plus longest output would not fit (the random dataset
    draws each length uniformly in ``[len * (1 - ratio), len * (1 + ratio)]``)."""
    if max_model_len is not None:
        longest = int(input_len * (1 + range_ratio)) + int(output_len * (1 + range_ratio))
        if longest > max_model_len:
            raise ValueError(
                f"random lengths up to {longest} tokens (input {input_len} + output {output_len},"
                f" range ratio {range_ratio}) exceed max_model_len {max_model_len}"
            )
    argv = [
        "--backend", "vllm", "--base-url", base_url, "--model", model,
        "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--random-range-ratio", str(range_ratio),
        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
        "--temperature", str(temperature), "--seed", str(seed),
        "--save-result", "--save-detailed", "--result-dir", str(result_dir),
        "--result-filename", result_filename, "--ready-check-timeout-sec", "0",
    ]  # fmt: skip
    if ignore_eos:
        argv.append("--ignore-eos")
    return argv


def bench_command(argv: list[str]) -> list[str]:
    """The ``vllm bench serve`` process of this interpreter (the same vLLM as the servers)."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", *argv]


def bench_outcome(result: dict | None, num_prompts: int) -> dict:
    """Completed / failed requests of one run from vLLM's result JSON (``--save-detailed``
    adds the per-request ``errors``); ``None`` (no JSON: the client itself failed) counts every
    request as failed."""
    if not result:
        return {"completed": 0, "failed": num_prompts, "errors": ["no result JSON"]}
    completed = int(result.get("completed") or 0)
    failed = int(result.get("failed", num_prompts - completed))
    errors = [e for e in (result.get("errors") or []) if e]
    lost = num_prompts - completed - failed  # neither counted: the client lost them
    return {
        "completed": completed,
        "failed": failed + max(0, lost),
        "errors": sorted(set(errors))[:5],
        "duration_s": round(float(result.get("duration") or 0.0), 1),
        "output_tok_s": round(float(result.get("output_throughput") or 0.0), 1),
        "total_output_tokens": int(result.get("total_output_tokens") or 0),
    }


def run_bench(argv: list[str], result_path: Path, log_path: Path, timeout_s: float) -> dict:
    """Run ``vllm bench serve`` with a deadline; returns rc, seconds and the parsed result
    (``None`` when the client failed or passed its deadline: then rc is ``"timeout"``)."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            bench_command(argv), capture_output=True, text=True, timeout=timeout_s
        )
        rc: int | str = proc.returncode
        log_path.write_text(proc.stdout[-20000:] + "\n--- stderr ---\n" + proc.stderr[-20000:])
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        log_path.write_text(f"cut after {timeout_s:.0f} s\n{(out or '')[-20000:]}")
    result = None
    if rc == 0 and result_path.exists():
        result = json.loads(result_path.read_text())
    return {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "result": result}


def group_rss_mib(pgids: list[int]) -> float:
    """Summed resident memory of every live process in the process groups ``pgids``."""
    total_kib = 0
    for pgid in pgids:
        for pid in live_group_members(pgid):
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total_kib += int(line.split()[1])
            except OSError:
                pass
    return round(total_kib / 1024.0, 1)


def parse_gpu_apps(text: str) -> dict[int, float]:
    """``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`` as
    {pid: MiB}; lines it cannot read ("[N/A]", blank) are left out."""
    out: dict[int, float] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2 or not parts[0].isdigit():
            continue
        try:
            out[int(parts[0])] = out.get(int(parts[0]), 0.0) + float(parts[1])
        except ValueError:
            continue
    return out


def _nvidia_smi(query: str) -> str | None:
    try:
        return subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30,
        ).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None


def apps_memory_mib(apps: dict[int, float], pids: set[int]) -> float | None:
    """GPU MiB of the processes ``pids`` among nvidia-smi's ``apps``; None when none of them is
    listed (no GPU process of ours, or nvidia-smi sees another PID namespace: a container)."""
    mine = [v for p, v in apps.items() if p in pids]
    return round(sum(mine), 1) if mine else None


def gpu_memory_mib(pgids: list[int]) -> float | None:
    """GPU memory used by the processes of ``pgids`` (nvidia-smi's per-process figure), None
    when nvidia-smi is not there (CPU dry runs) or lists none of them."""
    text = _nvidia_smi("--query-compute-apps=pid,used_memory")
    if text is None:
        return None
    pids = {p for g in pgids for p in live_group_members(g)}
    return apps_memory_mib(parse_gpu_apps(text), pids)


def gpu_device_used_mib() -> float | None:
    """Memory in use on GPU 0 as nvidia-smi reports it (every process on the device), None
    without nvidia-smi."""
    text = _nvidia_smi("--query-gpu=memory.used")
    try:
        return float(text.splitlines()[0]) if text else None
    except (ValueError, IndexError):
        return None


def wait_idle(port: int, timeout_s: float = 60.0) -> tuple[float | None, float | None]:
    """(``vllm:kv_cache_usage_perc``, ``vllm:num_requests_running``) once both read 0, or
    their last values when ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = get_text(port, "/metrics")
        usage = gauge(m, "vllm:kv_cache_usage_perc")
        running = gauge(m, "vllm:num_requests_running")
        if (usage, running) == (0.0, 0.0) or time.monotonic() > deadline:
            return usage, running
        time.sleep(0.5)


# vLLM's log prefix "(EngineCore pid=1) ERROR 12-04 ..." or a bare "ERROR 12-04 ..." line, and
# Python's traceback header; a WARNING line that quotes the word is not an error line.
_ERROR_LINE = re.compile(r"(^|\)\s|\s)ERROR\s|Traceback \(most recent call last\)")


def error_lines(text: str) -> list[str]:
    """The ERROR and traceback lines of a log."""
    return [ln for ln in text.splitlines() if _ERROR_LINE.search(ln)]


def growth(values: list[float], bound: float) -> dict:
    """Run-over-run growth of ``values`` (e.g. MiB after each run): the steps, the total
    (last minus first) and whether the total stays within ``bound``."""
    steps = [round(b - a, 1) for a, b in zip(values, values[1:], strict=False)]
    total = round(values[-1] - values[0], 1) if values else 0.0
    return {"values": values, "steps": steps, "total": total, "within": total <= bound}


def load_growth(rec: dict, bound_mib: float) -> dict:
    """Host RSS and GPU memory of a load record (:func:`growth` of the values after each run;
    the first run's warm-up, ready -> run 1, is stated apart): ``{"rss": ..., "gpu": ...}``,
    ``gpu`` None when no GPU figure was read."""
    out: dict = {}
    for key, ready in (("rss", "rss_mib_ready"), ("gpu", "gpu_mib_ready")):
        after = [r.get(f"{key}_mib_after") for r in rec.get("runs", []) if "skipped" not in r]
        if not after or any(v is None for v in after) or rec.get(ready) is None:
            out[key] = None if key == "gpu" else growth([], bound_mib)
            continue
        g = growth(after, bound_mib)
        g["ready"] = rec[ready]
        g["first_run_warmup"] = round(after[0] - rec[ready], 1)
        out[key] = g
    return out


def top_logprobs_by_id(choice: dict) -> list[dict[int, float]] | None:
    """A completion choice's per-position top logprobs keyed by token id (the request set
    ``return_tokens_as_token_ids``, so vLLM names each token ``token_id:N``)."""
    lp = choice.get("logprobs")
    if not lp or lp.get("top_logprobs") is None:
        return None
    out = []
    for pos in lp["top_logprobs"]:
        row: dict[int, float] = {}
        for key, value in (pos or {}).items():
            if not str(key).startswith("token_id:"):
                raise ValueError(f"top logprob key {key!r} is not 'token_id:N'")
            row[int(str(key).split(":", 1)[1])] = float(value)
        out.append(row)
    return out
