#!/usr/bin/env python3
"""Throughput, latency, plugin overhead, draft/target step split and producer memory of DSpark
at real model shapes on one GPU (config-only folders, dummy weights, synthetic acceptance).

One command per shape on the GPU machine (see docs/results/performance.md for the exact lines):

    python3 -m benchmarks.perf_real_shapes --shape qwen3-8b --phases nospec,producer \\
        --out $OUT --budget-s 380

What runs: one child process (own process group, hard timeout) per *phase*, in the order of
``--phases`` (default ``producer,nospec,dspark,off``); children append records to a JSONL file
the parent turns into ONE JSON, ``OUT/perf_<shape>.json``, also when the budget or a timeout
stops them early:

* ``producer`` (plugin on): the prefill-only producer engine (``kv_role=kv_producer`` through the
  test file connector of tests/e2e/producer, eager, no requests): the context-KV-only drafter's
  memory at load, and what ``vllm-dspark-pp plan`` predicts for both drafters;
* ``nospec`` (plugin on): the target alone, same runs as ``dspark``;
* ``dspark`` (plugin on, ``VLLM_PLUGINS=dspark_pp,dspark_bench``): DSpark k=7
  (``rejection_sample_method="synthetic"``); for each repeat, each acceptance length
  (``--acceptance-lengths``, default 3.99 and 6.1; switched in place on the worker between runs,
  see ``dspark_bench_hooks._set_acceptance_length``, so one engine serves both), each
  concurrency C: ``LLM.generate`` of C random 128-token prompts at once, 512 output tokens,
  ``ignore_eos``. Per run: output tok/s (tokens / wall time), TTFT and TPOT per request from
  ``RequestOutput.metrics``, the spec-decode counters (measured acceptance length), and the
  per-step target/draft GPU times (``dspark_bench_hooks``). The full drafter's
  allocator-measured memory at load comes from the same engine;
* ``off`` (plugin off, ``VLLM_PLUGINS=dspark_bench``): the ``dspark`` engine and runs again, so
  the plugin's cost is the on/off ratio at every concurrency.

Budget: every phase has a reserved minimum (``PHASE_MIN_S``: engine start with a cold compile
cache, one pass over the runs, shutdown). A phase may use the budget left minus the minimums of
the phases after it (``phase_allotment``), so a long phase can never starve a later one; the
phases are in priority order, so when the budget is short the LAST ones are skipped (the parent
prints the schedule first; ``--print-schedule`` prints it without running anything). Repeats
are the outer loop within a phase, so a budget cut loses repeats, not rows. Results of several
calls for one shape (e.g. ``--phases nospec,producer`` after a run that measured ``dspark,off``)
are combined with ``--merge A.json B.json``; plot_perf.py and pp_projection.py merge same-shape
JSONs by themselves.

Why not ``vllm bench throughput``/``serve``: neither switches the synthetic acceptance length
within one engine, reports the draft/target split or the drafter's memory, and each engine
start costs 40-90 s at these shapes (torch.compile + CUDA graphs); offline ``LLM.generate``
with C prompts at once is what ``vllm bench throughput`` does, and its per-request metrics give
TTFT/TPOT. CPU dry run (tiny pair, eager):

    VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= \\
    VLLM_CPU_OMP_THREADS_BIND=nobind VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=. \\
    python -m benchmarks.perf_real_shapes --shape tiny -k 4 --acceptance-lengths 2.5,3.5 \\
        --concurrency 1,2 --output-len 16 --input-len 16 --repeats 1 --eager --out /tmp/perf \\
        --budget-s 900
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.real_shapes import SHAPES, ShapePaths, engine_kwargs, write_shape

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

PLUGIN = "dspark_pp"
BENCH_PLUGIN = "dspark_bench"
CONNECTOR_DIR = REPO / "tests" / "e2e" / "producer"


def log(msg: str) -> None:
    print(f"[perf {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- pure helpers
def request_latencies(
    arrival: float, first_ts: float, last_ts: float, num_gen: int, first_latency: float
) -> tuple[float, float | None]:
    """(TTFT s, TPOT s) of one finished request from vLLM's RequestStateStats fields: TTFT is
    vLLM's ``first_token_latency``; TPOT the mean gap after the first token."""
    tpot = (last_ts - first_ts) / (num_gen - 1) if num_gen > 1 else None
    return first_latency, tpot


def aggregate_runs(records: list[dict]) -> list[dict]:
    """Median over repeats of every (engine, plugin, acceptance length, concurrency) run."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r.get("type") != "run":
            continue
        key = (r["engine"], r["plugin"], r.get("acceptance_length"), r["concurrency"])
        groups.setdefault(key, []).append(r)

    def med(rs, k):
        xs = [x[k] for x in rs if x.get(k) is not None]
        return statistics.median(xs) if xs else None

    rows = []
    for (engine, plugin, al, c), rs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0, kv[0][3])
    ):
        rows.append(
            {
                "engine": engine,
                "plugin": plugin,
                "acceptance_length": al,
                "concurrency": c,
                "repeats": len(rs),
                "output_tok_s": med(rs, "output_tok_s"),
                "output_tok_s_all": [x["output_tok_s"] for x in rs],
                "tpot_ms": med(rs, "tpot_ms_mean"),
                "ttft_ms": med(rs, "ttft_ms_mean"),
                "measured_acceptance_length": med(rs, "measured_acceptance_length"),
                "target_ms": med(rs, "target_ms"),
                "draft_ms": med(rs, "draft_ms"),
                "step_ms": med(rs, "step_ms"),
            }
        )
    return rows


def plugin_ratios(rows: list[dict]) -> list[dict]:
    """Plugin on / off output tok/s at every (acceptance length, concurrency) both measured."""
    on = {
        (r["acceptance_length"], r["concurrency"]): r
        for r in rows
        if r["engine"] == "dspark" and r["plugin"] == "on"
    }
    out = []
    for r in rows:
        if r["engine"] != "dspark" or r["plugin"] != "off":
            continue
        key = (r["acceptance_length"], r["concurrency"])
        if key in on and r["output_tok_s"]:
            out.append(
                {
                    "acceptance_length": key[0],
                    "concurrency": key[1],
                    "on_tok_s": on[key]["output_tok_s"],
                    "off_tok_s": r["output_tok_s"],
                    "ratio": on[key]["output_tok_s"] / r["output_tok_s"],
                }
            )
    return out


def speedups(rows: list[dict]) -> list[dict]:
    """DSpark (plugin on) over no speculation, per acceptance length and concurrency."""
    base = {r["concurrency"]: r for r in rows if r["engine"] == "nospec"}
    out = []
    for r in rows:
        if r["engine"] == "dspark" and r["plugin"] == "on" and r["concurrency"] in base:
            b = base[r["concurrency"]]["output_tok_s"]
            if b:
                out.append(
                    {
                        "acceptance_length": r["acceptance_length"],
                        "concurrency": r["concurrency"],
                        "speedup": r["output_tok_s"] / b,
                    }
                )
    return out


def build_result(meta: dict, records: list[dict]) -> dict:
    rows = aggregate_runs(records)
    mem = {r["engine"]: r for r in records if r.get("type") == "memory"}
    return {
        **meta,
        "engines": [r for r in records if r.get("type") == "engine"],
        "rows": rows,
        "plugin_ratio": plugin_ratios(rows),
        "speedup": speedups(rows),
        "memory": mem,
        # the last one: a merge lists the later call's records after the earlier one's, as for
        # "memory" (keyed by engine, the later record wins)
        "plan": next((r for r in reversed(records) if r.get("type") == "plan"), None),
        "skipped": [r for r in records if r.get("type") == "skip"],
        "errors": [r for r in records if r.get("type") == "error"],
        "runs": [r for r in records if r.get("type") == "run"],
    }


def phase_measured(result: dict, phase: str) -> bool:
    """Whether a phase left its result: rows of its engine and plugin, or, for ``producer``
    (no requests), the context-KV-only drafter's memory at load."""
    engine, plugin = PHASE_ENGINE[phase], PHASE_PLUGIN[phase]
    if phase == "producer":
        mem = (result.get("memory") or {}).get(f"{engine}/{plugin}") or {}
        return bool(mem.get("draft_load"))
    return any(r["engine"] == engine and r["plugin"] == plugin for r in result.get("rows") or [])


def exit_status(result: dict) -> int:
    """The driver's exit status: 0 when some phase measured something and every phase that ran
    (``child_status`` has its engine) left its result (``phase_measured``); a phase the budget
    skipped whole is not a failure. A ``--phases producer`` call has no rows and succeeds on its
    memory record."""
    ran = result.get("child_status") or {}
    phases = result.get("phase_order") or []
    measured = [p for p in phases if phase_measured(result, p)]
    failed = [
        p
        for p in phases
        if f"{PHASE_ENGINE[p]}/{PHASE_PLUGIN[p]}" in ran and not phase_measured(result, p)
    ]
    return 0 if measured and not failed else 1


def summary_table(result: dict) -> str:
    head = (
        f"{'engine':<7} {'plug':<4} {'AL':>5} {'C':>3} {'tok/s':>9} {'TPOT ms':>8} "
        f"{'TTFT ms':>8} {'AL meas':>7} {'tgt ms':>7} {'dft ms':>7} {'n':>2}"
    )
    lines = [head, "-" * len(head)]

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    for r in result["rows"]:
        lines.append(
            f"{r['engine']:<7} {r['plugin']:<4} {f(r['acceptance_length'], '5.2f'):>5} "
            f"{r['concurrency']:>3} {f(r['output_tok_s'], '9.1f'):>9} {f(r['tpot_ms'], '8.2f'):>8} "
            f"{f(r['ttft_ms'], '8.1f'):>8} {f(r['measured_acceptance_length'], '7.2f'):>7} "
            f"{f(r['target_ms'], '7.2f'):>7} {f(r['draft_ms'], '7.2f'):>7} {r['repeats']:>2}"
        )
    for p in result["plugin_ratio"]:
        lines.append(
            f"plugin on/off AL={p['acceptance_length']} C={p['concurrency']}: {p['ratio']:.3f}"
        )
    for name, m in result["memory"].items():
        d = m.get("draft_load") or {}
        lines.append(
            f"memory {name}: draft allocated {d.get('allocated_delta_bytes')} B, "
            f"own params {d.get('param_bytes_own')} B ({d.get('draft_class')})"
        )
    for s in result["skipped"]:
        lines.append(f"SKIPPED {s.get('what')}: {s.get('why')}")
    for e in result["errors"]:
        lines.append(f"ERROR {e.get('what')}: {str(e.get('error'))[:200]}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- phases / budget
PHASES = ("producer", "nospec", "dspark", "off")
DEFAULT_PHASES = "producer,nospec,dspark,off"
# Seconds a phase needs at least (child start + vLLM import ~15 s, engine start with a cold
# compile cache: DSpark 149 s / warm 100 s on the H200 at the Qwen3-8B shape (2026-12-03), one
# pass over 2 ALs x 5 concurrencies ~12 s (no spec ~20 s), shutdown ~10 s); the producer engine is
# eager (no compile, no CUDA graphs) and runs no requests.
PHASE_MIN_S = {"producer": 90.0, "nospec": 190.0, "dspark": 190.0, "off": 190.0}
PHASE_PLUGIN = {"producer": "on", "nospec": "on", "dspark": "on", "off": "off"}
PHASE_ENGINE = {"producer": "producer", "nospec": "nospec", "dspark": "dspark", "off": "dspark"}
GRACE_S = 45.0  # hard-kill margin past a phase's deadline (an engine start or shutdown in flight)


OFF_MODES = ("exclude", "skip")


def phase_env(plugin: str, off_mode: str = "exclude", skip_patches: str = "") -> dict:
    """Environment a phase's child gets on top of the common one.

    Plugin on: ``VLLM_PLUGINS`` names both plugins; ``skip_patches`` (comma-separated patch names,
    diagnosis only) goes to ``VLLM_DSPARK_PP_SKIP_PATCHES``. Plugin off, ``off_mode``:
    ``exclude`` leaves the plugin out of ``VLLM_PLUGINS`` (what users do); ``skip`` loads it with
    every patch skipped but the start-up config check (``config_vllm``), so ``VLLM_PLUGINS`` --
    a torch.compile cache key in vLLM (``envs.compile_factors``) -- is the same as plugin on and
    both engines share one compile cache."""
    from vllm_dspark_pp.patches import SKIP_ENV, registry

    both = f"{PLUGIN},{BENCH_PLUGIN}"
    if plugin == "on":
        out = {"VLLM_PLUGINS": both}
        out[SKIP_ENV] = skip_patches
        return out
    if off_mode == "exclude":
        return {"VLLM_PLUGINS": BENCH_PLUGIN, SKIP_ENV: ""}
    if off_mode == "skip":
        names = [i.name for i in registry() if i.name != "config_vllm"]
        return {"VLLM_PLUGINS": both, SKIP_ENV: ",".join(names)}
    raise ValueError(f"unknown off mode {off_mode!r}: choose from {', '.join(OFF_MODES)}")


def parse_phase_mins(text: str) -> dict:
    """``--phase-min-s off=120,dspark=120`` as PHASE_MIN_S overrides."""
    out = {}
    for part in (p.strip() for p in (text or "").split(",")):
        if not part:
            continue
        name, _, value = part.partition("=")
        if name not in PHASES or not value:
            raise ValueError(f"--phase-min-s: {part!r} is not PHASE=SECONDS ({','.join(PHASES)})")
        out[name] = float(value)
    return out


def parse_phases(text: str) -> list[str]:
    """``--phases`` as a list in priority order; unknown or repeated names raise ValueError."""
    out = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in out if p not in PHASES]
    if bad:
        raise ValueError(f"unknown phase(s) {bad}: choose from {','.join(PHASES)}")
    if len(set(out)) != len(out):
        raise ValueError(f"phase listed twice in {text!r}")
    if not out:
        raise ValueError(f"no phase in {text!r}: choose from {','.join(PHASES)}")
    return out


def phase_allotment(remaining_s: float, mins: list[float]) -> float:
    """Seconds the first of ``mins`` (this phase, then the later ones) may use when
    ``remaining_s`` of the budget are left: everything but the later phases' minimums, at least
    its own minimum (earlier phases have priority); 0 = skip (not even its minimum is left)."""
    own, later = mins[0], sum(mins[1:])
    if remaining_s < own:
        return 0.0
    return max(own, remaining_s - later)


def schedule(budget_s: float, phases: list[str], mins: dict | None = None) -> list[dict]:
    """The plan the parent follows, assuming every phase takes exactly its minimum: per phase
    its minimum, the seconds it may use (``allot_s``; 0 = skipped) and when it would start."""
    mins = mins or PHASE_MIN_S
    out, t = [], 0.0
    for i, p in enumerate(phases):
        allot = phase_allotment(budget_s - t, [mins[x] for x in phases[i:]])
        out.append({"phase": p, "min_s": mins[p], "allot_s": allot, "start_s": t})
        if allot:
            t += mins[p]
    return out


def schedule_text(budget_s: float, phases: list[str]) -> str:
    rows = schedule(budget_s, phases)
    need = sum(r["min_s"] for r in rows)
    lines = [f"phases in priority order, budget {budget_s:.0f} s, minimums {need:.0f} s:"]
    for r in rows:
        lines.append(
            f"  {r['phase']:<8} plugin {PHASE_PLUGIN[r['phase']]:<3} min {r['min_s']:.0f} s"
            + (f", may use {r['allot_s']:.0f} s" if r["allot_s"] else ", SKIPPED")
        )
    if need > budget_s:
        lines.append(
            f"  WARNING: budget {budget_s:.0f} s < {need:.0f} s of minimums: the last "
            "phases may be skipped; raise --budget-s or split --phases over two calls"
        )
    return "\n".join(lines)


def result_records(result: dict) -> list[dict]:
    """The records a result JSON was built from (inverse of ``build_result``)."""
    recs = list(result.get("runs") or []) + list((result.get("memory") or {}).values())
    recs += list(result.get("engines") or [])
    if result.get("plan"):
        recs.append(result["plan"])
    return recs + list(result.get("skipped") or []) + list(result.get("errors") or [])


def _skip_key(rec: dict) -> tuple[str, str] | None:
    """(engine, plugin) a skip record is about, from its fields or its ``what`` text."""
    import re

    if rec.get("engine") and rec.get("plugin"):
        return rec["engine"], rec["plugin"]
    what = str(rec.get("what") or "")
    head = what.split(" ", 1)[0]
    if "/" in head:
        e, p = head.split("/", 1)
        return e, p
    m = re.search(r"\(plugin (\w+)\)", what)
    return (head, m.group(1)) if head and m else None


def _measured_keys(result: dict) -> set[tuple[str, str]]:
    keys = {(r["engine"], r["plugin"]) for r in result.get("runs") or []}
    for name in result.get("memory") or {}:
        if "/" in name:
            keys.add(tuple(name.split("/", 1)))
    return keys


def merge_results(results: list[dict]) -> dict:
    """One result from several runs of ONE shape (e.g. ``dspark,off`` in one call and
    ``nospec,producer`` in the next): all records rebuilt together (medians over every repeat of
    both); a skip record of one run is dropped when another run measured that engine."""
    if not results:
        raise ValueError("nothing to merge")
    shapes = {r.get("shape") for r in results}
    if len(shapes) != 1:
        raise ValueError(f"cannot merge results of different shapes {sorted(map(str, shapes))}")
    if len(results) == 1:
        return results[0]
    recs = []
    for i, r in enumerate(results):
        others = set().union(*(_measured_keys(o) for j, o in enumerate(results) if j != i))
        for rec in result_records(r):
            if rec.get("type") == "skip" and _skip_key(rec) in others:
                continue
            recs.append(rec)
    derived = {
        "engines",
        "rows",
        "plugin_ratio",
        "speedup",
        "memory",
        "plan",
        "skipped",
        "errors",
        "runs",
        "child_status",
        "wall_s",
        "_path",
    }
    meta = {k: v for k, v in results[0].items() if k not in derived}

    def joined(key):
        vals = []
        for r in results:
            if r.get(key) is not None and str(r[key]) not in vals:
                vals.append(str(r[key]))
        return "; ".join(vals) or None

    meta["command"] = joined("command")
    meta["date_utc"] = joined("date_utc")
    meta["merged_from"] = len(results)
    out = build_result(meta, recs)
    out["child_status"] = {k: v for r in results for k, v in (r.get("child_status") or {}).items()}
    out["wall_s"] = round(sum(r.get("wall_s") or 0 for r in results), 1)
    return out


# --------------------------------------------------------------------------- child
def _spec_counters(llm) -> dict:
    from dspark_dev.metrics import spec_metrics_from_llm  # the one metrics reader

    return spec_metrics_from_llm(llm)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    import random

    rng = random.Random(seed)
    lo, hi = min(1000, vocab // 4), max(vocab - 1000, vocab // 2)
    return [{"prompt_token_ids": [rng.randrange(lo, hi) for _ in range(length)]} for _ in range(n)]


def _one_run(llm, sp, c: int, a: dict, seed: int) -> dict:
    before = _spec_counters(llm)
    llm.collective_rpc("dspark_bench_ctl", args=("enable",))
    prompts = _prompts(c, a["input_len"], a["vocab"], seed)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    per_worker = llm.collective_rpc("dspark_bench_ctl", args=("collect",))
    steps = per_worker[-1]  # the last PP stage samples and drafts
    after = _spec_counters(llm)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    ttfts, tpots = [], []
    for o in outs:
        m = o.metrics
        if m is None:
            continue
        ttft, tpot = request_latencies(
            m.arrival_time,
            m.first_token_ts,
            m.last_token_ts,
            m.num_generation_tokens,
            m.first_token_latency,
        )
        ttfts.append(ttft)
        if tpot is not None:
            tpots.append(tpot)
    from dspark_dev.metrics import counter_delta

    d = counter_delta(before, after)
    main = (steps.get("summary") or {}).get("main") or {}
    return {
        "concurrency": c,
        "wall_s": wall,
        "output_tokens": n_out,
        "output_tok_s": n_out / wall if wall > 0 else None,
        "ttft_ms_mean": 1e3 * statistics.mean(ttfts) if ttfts else None,
        "tpot_ms_mean": 1e3 * statistics.mean(tpots) if tpots else None,
        "tpot_ms_median": 1e3 * statistics.median(tpots) if tpots else None,
        "spec_counters": d,
        "measured_acceptance_length": (1 + d["num_accepted_tokens"] / d["num_drafts"])
        if d["num_drafts"]
        else None,
        "target_ms": main.get("target_ms"),
        "draft_ms": main.get("draft_ms"),
        "step_ms": main.get("step_ms"),
        "step_num_reqs": (steps.get("summary") or {}).get("main_num_reqs"),
        "step_summary": steps.get("summary"),
        "first_steps": steps.get("first_steps"),
        "step_summary_per_worker": [w.get("summary") for w in per_worker]
        if len(per_worker) > 1
        else None,
    }


def _shutdown(llm) -> None:
    import gc
    import threading

    t = threading.Thread(target=llm.llm_engine.engine_core.shutdown, daemon=True)
    t.start()
    t.join(30)
    del llm
    gc.collect()
    _wait_gpu_released()


def _wait_gpu_released(limit_s: float = 60.0, below_mib: int = 4096) -> None:
    """Wait until the finished engine's processes gave the GPU memory back (nvidia-smi; this
    process never initialises CUDA, so vLLM keeps forking its engine core)."""
    t_end = time.monotonic() + limit_s
    while time.monotonic() < t_end:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            used = [int(x) for x in out.split() if x.strip().isdigit()]
        except (OSError, subprocess.TimeoutExpired, ValueError):
            return  # no nvidia-smi (CPU dry run)
        if not used or max(used) < below_mib:
            return
        time.sleep(1)


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["records"])
    deadline = spec["deadline_unix"]
    a = spec["args"]

    def emit(rec: dict) -> None:
        rec["t_unix"] = time.time()
        with out.open("a") as f:
            f.write(json.dumps(rec, default=str) + "\n")

    def left() -> float:
        return deadline - time.time()

    from vllm import LLM, SamplingParams

    for phase in spec["phases"]:
        name, plugin = phase["engine"], spec["plugin"]
        if left() < phase.get("min_s", 15):
            emit(
                {
                    "type": "skip",
                    "what": f"{name} engine (plugin {plugin})",
                    "engine": name,
                    "plugin": plugin,
                    "why": f"budget: {left():.0f} s left",
                }
            )
            continue
        t0 = time.monotonic()
        try:
            llm = LLM(**{"disable_log_stats": False, **phase["llm"]})
        except Exception as e:  # noqa: BLE001
            emit(
                {
                    "type": "error",
                    "what": f"{name} engine start (plugin {plugin})",
                    "error": f"{type(e).__name__}: {e}",
                }
            )
            continue
        start_s = time.monotonic() - t0
        emit({"type": "engine", "engine": name, "plugin": plugin, "start_s": round(start_s, 1)})
        try:
            mem = llm.collective_rpc("dspark_bench_ctl", args=("memory",))[-1]
            emit({"type": "memory", "engine": f"{name}/{plugin}", **mem})
            if phase.get("plan"):
                emit({"type": "plan", **_plan_prediction(phase["plan"])})
            if phase.get("runs", True):
                sp = SamplingParams(
                    temperature=0.0, max_tokens=a["output_len"], ignore_eos=True, detokenize=False
                )
                warm = SamplingParams(
                    temperature=0.0, max_tokens=32, ignore_eos=True, detokenize=False
                )
                llm.generate(
                    _prompts(max(a["concurrency"]), a["input_len"], a["vocab"], 1),
                    warm,
                    use_tqdm=False,
                )
                als = phase.get("acceptance_lengths") or [None]
                seed = 100
                stop = False
                for rep in range(a["repeats"]):
                    for al in als:
                        if al is not None:
                            got = llm.collective_rpc(
                                "dspark_bench_ctl", args=("set_acceptance_length", al)
                            )
                            if not any(g.get("applied") for g in got):
                                raise RuntimeError(f"no worker switched to AL {al}: {got}")
                        for c in a["concurrency"]:
                            if left() < phase.get("run_reserve_s", 10):
                                emit(
                                    {
                                        "type": "skip",
                                        "what": f"{name}/{plugin} rep {rep} AL {al} "
                                        f"C {c} and later",
                                        "why": f"budget: {left():.0f} s left",
                                    }
                                )
                                stop = True
                                break
                            seed += 1
                            r = _one_run(llm, sp, c, a, seed)
                            r.update(
                                type="run",
                                engine=name,
                                plugin=plugin,
                                acceptance_length=al,
                                repeat=rep,
                            )
                            emit(r)
                        if stop:
                            break
                    if stop:
                        break
        except Exception as e:  # noqa: BLE001
            import traceback

            emit(
                {
                    "type": "error",
                    "what": f"{name} runs (plugin {plugin})",
                    "error": f"{type(e).__name__}: {e}",
                    "trace": traceback.format_exc()[-3000:],
                }
            )
        finally:
            _shutdown(llm)
    os._exit(0)  # do not linger in vLLM's atexit handlers


def _plan_prediction(p: dict) -> dict:
    """What ``vllm-dspark-pp plan`` predicts for the drafter of this shape (both roles)."""
    from vllm_dspark_pp.deployment_plan import make_plan

    out = {}
    for role in ("kv_both", "kv_producer"):
        kvt = {
            "kv_connector": "DSparkDraftKVFileConnector",
            "kv_connector_module_path": "dspark_pp_draft_kv_connector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": p["store"]},
        }
        plan = make_plan(
            p["target"],
            speculative_config=p["speculative_config"],
            kv_transfer_config=kvt,
            extra_engine_args={"max_model_len": 1024},
        )
        out[role] = plan.extra
    return out


# --------------------------------------------------------------------------- parent
def make_hook_dist(root: Path) -> Path:
    """A throw-away distribution that registers benchmarks/dspark_bench_hooks.py as a vLLM
    general plugin named ``dspark_bench`` (found through importlib.metadata on PYTHONPATH)."""
    d = root / "dspark_bench_hooks-0.0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: dspark-bench-hooks\nVersion: 0.0\n")
    (d / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{BENCH_PLUGIN} = dspark_bench_hooks:register\n"
    )
    return root


def run_child(
    spec: dict, work: Path, env: dict, timeout_s: float, log_path: Path, records: Path
) -> str:
    from dspark_dev.proc import kill_group, start_in_session

    spec_path = work / f"child_{spec['plugin']}_{int(time.time() * 1000)}.json"
    spec_path.write_text(json.dumps(spec))
    seen = records.read_text().count("\n") if records.exists() else 0
    with log_path.open("ab") as logf:
        proc = start_in_session(
            [sys.executable, "-m", "benchmarks.perf_real_shapes", "--_child", str(spec_path)],
            env=env,
            stdout=logf,
            stderr=subprocess.STDOUT,
        )
        t_end = time.monotonic() + timeout_s
        status = "ok"
        try:
            while proc.poll() is None:
                if time.monotonic() > t_end:
                    status = f"killed after {timeout_s:.0f} s"
                    break
                time.sleep(2)
                seen = _progress(records, seen)
        finally:
            kill_group(proc)  # the whole process group, engine core and workers included
    _progress(records, seen)
    if status == "ok" and proc.returncode not in (0, None):
        status = f"exit code {proc.returncode}"
    return status


def _progress(records: Path, seen: int) -> int:
    if not records.exists():
        return seen
    lines = records.read_text().splitlines()
    for line in lines[seen:]:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        t = r.get("type")
        if t == "run":
            al = r.get("acceptance_length")
            log(
                f"{r['engine']}/{r['plugin']} AL={al} C={r['concurrency']} rep={r['repeat']}: "
                f"{(r['output_tok_s'] or 0):.1f} tok/s, TPOT {r['tpot_ms_mean']}, "
                f"AL meas {r['measured_acceptance_length']}, target {r['target_ms']} ms, "
                f"draft {r['draft_ms']} ms"
            )
        elif t == "engine":
            log(f"engine {r['engine']} (plugin {r['plugin']}) up in {r['start_s']} s")
        elif t in ("skip", "error"):
            log(f"{t.upper()}: {r.get('what')}: {r.get('why') or str(r.get('error'))[:300]}")
        elif t == "memory":
            log(f"memory {r['engine']}: {r.get('draft_load')}")
    return len(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES) + ["tiny"], default="qwen3-8b")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/perf-out"))
    ap.add_argument("--concurrency", default="1,4,16,32,64")
    ap.add_argument("--acceptance-lengths", default="3.99,6.1")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=7)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (CPU dry runs)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument(
        "--phases",
        default=DEFAULT_PHASES,
        help=f"which of {','.join(PHASES)} to run, in priority order (each in its "
        "own child process with a reserved share of --budget-s)",
    )
    ap.add_argument(
        "--print-schedule",
        action="store_true",
        help="print the phases' budget schedule and exit (no engine, no GPU)",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="merge result JSONs of one shape into OUT/perf_<shape>.json and exit",
    )
    ap.add_argument(
        "--off-mode",
        choices=OFF_MODES,
        default="exclude",
        help="plugin off = left out of VLLM_PLUGINS (exclude) or loaded with every patch but "
        "config_vllm skipped (skip: same VLLM_PLUGINS, so the torch.compile cache is shared)",
    )
    ap.add_argument(
        "--skip-patches",
        default="",
        help="plugin-on phases: patch names not applied (VLLM_DSPARK_PP_SKIP_PATCHES; diagnosis)",
    )
    ap.add_argument(
        "--phase-min-s",
        default="",
        help="override the phases' reserved minimum seconds, e.g. off=110,dspark=110",
    )
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._child:
        return child_main(a._child)
    try:
        phase_names = parse_phases(a.phases)
        PHASE_MIN_S.update(parse_phase_mins(a.phase_min_s))
        for plugin in ("on", "off"):
            phase_env(plugin, a.off_mode, a.skip_patches)
        from vllm_dspark_pp.patches import skipped_patches

        skipped_patches(value=a.skip_patches)  # unknown names fail here, before any engine
    except ValueError as e:
        ap.error(str(e))
    if a.print_schedule:
        print(schedule_text(a.budget_s, phase_names))
        return 0
    if a.merge:
        merged = merge_results([json.loads(Path(x).read_text()) for x in a.merge])
        Path(a.out).mkdir(parents=True, exist_ok=True)
        dest = Path(a.out) / f"perf_{merged['shape']}.json"
        dest.write_text(json.dumps(merged, indent=1, default=str))
        log(f"merged {len(a.merge)} results into {dest}")
        print(summary_table(merged), flush=True)
        return 0

    t_start = time.time()
    deadline = t_start + a.budget_s
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dspark-perf-"))
    records = out / f"perf_{a.shape}.jsonl"
    log_path = out / f"perf_{a.shape}.log"
    for p in (records, log_path):
        if p.exists():
            p.unlink()

    if a.shape == "tiny":
        from vllm_dspark_pp.tiny_models import make_tiny_models

        tp = make_tiny_models(work / "tiny", dtype="float32")
        paths = ShapePaths("tiny", tp.target, tp.draft)
        vocab = json.loads((Path(tp.target) / "config.json").read_text())["vocab_size"]
    else:
        paths = write_shape(a.shape, work / "shapes")
        vocab = SHAPES[a.shape].vocab_size
    concurrency = [int(x) for x in a.concurrency.split(",") if x]
    als = [float(x) for x in a.acceptance_lengths.split(",") if x]
    common = dict(
        max_model_len=max(1024, a.input_len + a.output_len + 64),
        max_num_seqs=max(concurrency),
        pipeline_parallel_size=a.pipeline_parallel_size,
    )
    if a.eager:
        common.update(enforce_eager=True, dtype="float32")
    else:
        common["gpu_memory_utilization"] = a.gpu_memory_utilization
    k = a.num_speculative_tokens
    spec_llm = engine_kwargs(paths, spec=True, k=k, acceptance_length=als[0], **common)
    nospec_llm = engine_kwargs(paths, spec=False, **common)
    store = work / "producer-kv"
    store.mkdir()
    kvt = {
        "kv_connector": "DSparkDraftKVFileConnector",
        "kv_connector_module_path": "dspark_pp_draft_kv_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    prod_common = dict(common, enforce_eager=True)
    if not a.eager:
        prod_common["gpu_memory_utilization"] = 0.35
    producer_llm = engine_kwargs(
        paths, spec=True, k=k, kv_transfer_config=kvt, **{kk: v for kk, v in prod_common.items()}
    )
    plan_req = {
        "target": paths.target,
        "store": str(store),
        "speculative_config": {
            "method": "dspark",
            "model": paths.draft,
            "num_speculative_tokens": k,
        },
    }
    run_args = {
        "concurrency": concurrency,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "repeats": a.repeats,
        "vocab": vocab,
    }
    phase_specs = {
        "producer": {"engine": "producer", "llm": producer_llm, "runs": False, "plan": plan_req},
        "nospec": {"engine": "nospec", "llm": nospec_llm},
        "dspark": {"engine": "dspark", "llm": spec_llm, "acceptance_lengths": als},
        "off": {"engine": "dspark", "llm": spec_llm, "acceptance_lengths": als},
    }

    hooks_root = make_hook_dist(work / "hooks")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(hooks_root), str(REPO), str(CONNECTOR_DIR), env.get("PYTHONPATH", "")]
    )
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if a.pipeline_parallel_size > 1:  # several GPUs of one host: no NVLink multicast
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    meta = {
        "shape": a.shape,
        "shape_config": SHAPES[a.shape].__dict__ if a.shape in SHAPES else _tiny_shape(paths),
        "k": k,
        "acceptance_lengths": als,
        "concurrency": concurrency,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "repeats": a.repeats,
        "pipeline_parallel_size": a.pipeline_parallel_size,
        "eager": a.eager,
        "budget_s": a.budget_s,
        "off_mode": a.off_mode,
        "skip_patches": a.skip_patches or None,
        "phase_order": phase_names,
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "engine_kwargs": {"dspark": spec_llm, "nospec": nospec_llm, "producer": producer_llm},
    }
    meta.update(_versions())
    log(f"shape {a.shape}: target {paths.target}, draft {paths.draft}; budget {a.budget_s:.0f} s")

    log(schedule_text(a.budget_s, phase_names))
    statuses = {}
    for i, name in enumerate(phase_names):
        engine, plugin = PHASE_ENGINE[name], PHASE_PLUGIN[name]
        remaining = deadline - time.time()
        allot = phase_allotment(remaining, [PHASE_MIN_S[p] for p in phase_names[i:]])
        if not allot:
            with records.open("a") as f:
                f.write(
                    json.dumps(
                        {
                            "type": "skip",
                            "what": f"{engine} engine (plugin {plugin})",
                            "engine": engine,
                            "plugin": plugin,
                            "t_unix": time.time(),
                            "why": f"budget: {remaining:.0f} s left, phase {name} "
                            f"needs {PHASE_MIN_S[name]:.0f} s",
                        }
                    )
                    + "\n"
                )
            log(f"SKIP phase {name}: {remaining:.0f} s left < {PHASE_MIN_S[name]:.0f} s")
            continue
        log(
            f"phase {name} (engine {engine}, plugin {plugin}): may use {allot:.0f} s "
            f"of {remaining:.0f} s left"
        )
        cenv = dict(env, **phase_env(plugin, a.off_mode, a.skip_patches))
        spec = {
            "plugin": plugin,
            "phases": [phase_specs[name]],
            "records": str(records),
            "deadline_unix": time.time() + allot,
            "args": run_args,
        }
        statuses[f"{engine}/{plugin}"] = run_child(
            spec, work, cenv, allot + GRACE_S, log_path, records
        )
        log(f"phase {name}: {statuses[f'{engine}/{plugin}']}")
    recs = (
        [json.loads(x) for x in records.read_text().splitlines() if x.strip()]
        if records.exists()
        else []
    )
    result = build_result(meta, recs)
    result["child_status"] = statuses
    result["wall_s"] = round(time.time() - t_start, 1)
    res_path = out / f"perf_{a.shape}.json"
    res_path.write_text(json.dumps(result, indent=1, default=str))
    log(f"wrote {res_path} ({len(result['runs'])} runs) in {result['wall_s']} s")
    print(summary_table(result), flush=True)
    rc = exit_status(result)
    if rc:
        missing = [p for p in phase_names if not phase_measured(result, p)]
        log(f"exit 1: phase(s) {missing} measured nothing (child status {statuses})")
    return rc


def _tiny_shape(paths: ShapePaths) -> dict:
    t = json.loads((Path(paths.target) / "config.json").read_text())
    d = json.loads((Path(paths.draft) / "config.json").read_text())
    return {
        "name": "tiny",
        "hidden_size": t["hidden_size"],
        "num_layers": t["num_hidden_layers"],
        "vocab_size": t["vocab_size"],
        "draft_layers": d["num_hidden_layers"],
        "target_layer_ids": d["target_layer_ids"],
        "markov_rank": d["markov_rank"],
    }


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("vllm", "torch", "vllm-dspark-pp"):
        try:
            out[f"{pkg}_version"] = version(pkg)
        except PackageNotFoundError:
            out[f"{pkg}_version"] = None
    try:
        out["gpu"] = (
            subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,memory.total,driver_version",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.TimeoutExpired):
        out["gpu"] = None
    return out


if __name__ == "__main__":
    raise SystemExit(main())
