"""Synthetic run records of benchmarks/perf_real_shapes.py, for the driver's, plot's and
projection's CPU tests (one record = one ``LLM.generate`` of C prompts)."""

from __future__ import annotations

import json
import re
import shlex


def run_record(
    engine,
    plugin,
    al,
    c,
    rep,
    tok_s,
    *,
    tpot=5.0,
    ttft=20.0,
    tgt=4.0,
    dft=1.0,
    step=6.0,
    measured=None,
) -> dict:
    """A ``"type": "run"`` record; ``measured`` (the measured acceptance length) defaults to
    ``al``; ``draft_ms`` is set for DSpark engines only."""
    return {
        "type": "run",
        "engine": engine,
        "plugin": plugin,
        "acceptance_length": al,
        "concurrency": c,
        "repeat": rep,
        "output_tok_s": tok_s,
        "tpot_ms_mean": tpot,
        "ttft_ms_mean": ttft,
        "measured_acceptance_length": al if measured is None else measured,
        "target_ms": tgt,
        "draft_ms": dft if engine == "dspark" else None,
        "step_ms": step,
    }


def serve_point(config, al, c, tok_s, *, ttft=(50.0, 90.0), tpot=(5.0, 6.0), measured=None):
    """One measured point of benchmarks/serve_pp_one_gpu.py (``bench`` holds the fields of
    vLLM's ``vllm bench serve`` result JSON that the plot reads); ``ttft``/``tpot`` are
    (p50, p99) in ms."""
    pp = 2 if config.startswith("pp2") else 1
    return {
        "config": config,
        "pp": pp,
        "spec": "dspark" in config,
        "plugin": not config.endswith("_stock"),
        "acceptance_length": al,
        "concurrency": c,
        "num_prompts": max(16, 4 * c),
        "full_prompts": max(16, 4 * c),
        "trimmed": None,
        "bench": {
            "completed": max(16, 4 * c),
            "output_throughput": tok_s,
            "p50_ttft_ms": ttft[0],
            "p99_ttft_ms": ttft[1],
            "p50_tpot_ms": tpot[0],
            "p99_tpot_ms": tpot[1],
        },
        "measured_acceptance_length": measured if measured is not None else al,
    }


def serve_run(points, *, skipped=(), servers=None, concurrency=(1, 4), als=(3.99,)) -> dict:
    """A whole serve_pp_one_gpu.py result file around ``points``."""
    return {
        "meta": {
            "command": "serve_pp_one_gpu.py --configs test",
            "date": "2026-12-04 12:00:00 UTC",
            "concurrency": list(concurrency),
            "acceptance_lengths": list(als),
            "input_len": 1024,
            "output_len": 256,
            "versions": {"vllm": "0.34.0", "torch": "2.14.0", "gpu": "NVIDIA H200"},
        },
        "servers": servers or {},
        "points": list(points),
        "skipped": list(skipped),
    }


def dry_run_launchers(out: str) -> dict[str, dict]:
    """{launcher name: {"env": {...}, "argv": [...], "spec": {...}}} from the lines of
    benchmarks/serve_pp_one_gpu.py's ``--dry-run`` (``spec``: the ``--speculative-config`` JSON,
    which the dry run prints unquoted, so ``argv`` holds it split; absent without one)."""
    found: dict[str, dict] = {}
    for line in out.splitlines():
        m = re.match(r"  (.+?): env (.*)$", line)
        if m:
            found.setdefault(m.group(1), {})["env"] = dict(
                kv.split("=", 1) for kv in m.group(2).split(" ")
            )
            continue
        m = re.match(r"  (.+?): (/\S+ .*)$", line)
        if m:
            node = found.setdefault(m.group(1), {})
            node["argv"] = shlex.split(m.group(2).replace('"', '\\"'))
            if "--speculative-config " in line:
                raw = line.split("--speculative-config ", 1)[1]
                node["spec"] = json.JSONDecoder().raw_decode(raw)[0]
    return found
