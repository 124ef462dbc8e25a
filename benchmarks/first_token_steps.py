#!/usr/bin/env python3
"""Engine steps until every one of C simultaneous requests has its first token, plugin on vs off.

Written for the C=4 TTFT gap of docs/results/performance.md (plugin on vs
``VLLM_PLUGINS=dspark_bench``). One child process per case (own process group, hard timeout);
the engine core runs in the child's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so all C
requests are queued before the first ``schedule()`` and the batch composition does not depend on
how fast a front-end process hands requests to an engine-core process. That isolates what the
plugin itself could change: the sequence of ``SchedulerOutput``s (requests, tokens, draft
tokens per step) until every request has a token, and the host wall time per step of the
functions the plugin patches (timed from the outside, so the patches' own cost is inside).

With ``--mp`` the engine core runs in its own process as in the benchmark (``LLM.generate`` of
the C prompts at once); then only vLLM's per-request TTFT (``first_token_latency``) is recorded:
the composition is decided by the race between the two processes.

Cases: ``--engines nospec,dspark`` x ``--plugins on,off`` x ``--sched async,sync`` (the CPU
platform turns async scheduling off; ``async`` forces it back on with
``dspark_dev.engine_worker.force_async_scheduling``, CPU only). Defaults: the trained
tiny pair on the CPU platform. On a GPU pass ``--target``/``--draft`` (e.g. the config-only
shapes of benchmarks/real_shapes.py, ``--dummy``).

    .venv/bin/python -m benchmarks.first_token_steps --out /tmp/fts

Why hand-written: vLLM has no record of its scheduler outputs per step.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

PAIR = REPO / "models" / "tiny-pair"
# (module, class or None, attribute): the functions the plugin wraps that run per step
TIMED = (
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    ("vllm.v1.engine.core", "EngineCore", "step"),
    ("vllm.v1.engine.core", "EngineCore", "step_with_batch_queue"),
    ("vllm.v1.engine.core", "EngineCore", "post_step"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "sample_tokens"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "sample"),
    ("vllm.v1.worker.gpu.spec_decode.dspark.speculator", "DSparkSpeculator", "propose"),
)


def log(msg: str) -> None:
    print(f"[fts {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- pure helpers
def summarize_schedule(out) -> dict:
    """The parts of one ``SchedulerOutput`` that decide a step's shape."""
    spec = out.scheduled_spec_decode_tokens or {}
    new_ids = [r.req_id for r in out.scheduled_new_reqs]
    return {
        "num_reqs": len(out.num_scheduled_tokens),
        "tokens": int(out.total_num_scheduled_tokens),
        "per_req": dict(sorted(out.num_scheduled_tokens.items())),
        "new": sorted(new_ids),
        "draft_tokens": sum(len(v) for v in spec.values()),
        "num_spec_tokens_to_schedule": int(getattr(out, "num_spec_tokens_to_schedule", 0)),
    }


def first_token_steps(steps: list[dict], req_ids: list[str]) -> dict:
    """Per request, the 1-based engine step whose outputs first carried a token for it."""
    got: dict[str, int] = {}
    for i, s in enumerate(steps, 1):
        for r in s.get("first_token", []):
            got.setdefault(r, i)
    return {r: got.get(r) for r in req_ids}


def compare(cases: list[dict]) -> list[str]:
    """Lines: per (engine, sched), on vs off step counts, schedules and step times."""
    lines = []
    by = {(c["engine"], c["sched"], c["plugin"], c.get("mp", False)): c for c in cases}
    for (engine, sched, plugin, mp), c in sorted(by.items()):
        if plugin != "on":
            continue
        off = by.get((engine, sched, "off", mp))
        tag = f"{engine}/{sched}{'/mp' if mp else ''}"
        if not c.get("ok") or off is None or not off.get("ok"):
            lines.append(f"{tag}: incomplete (on ok={c.get('ok')}, off ok={off and off.get('ok')})")
            continue
        if mp:
            lines.append(
                f"{tag}: TTFT ms on {c['ttft_ms']} vs off {off['ttft_ms']} "
                f"(mean {c['ttft_ms_mean']:.2f} vs {off['ttft_ms_mean']:.2f}); front-end GCs "
                f"(gen, ms) on {c.get('gc')} vs off {off.get('gc')}; tracked objects on "
                f"{c.get('gc_objects')} vs off {off.get('gc_objects')}"
            )
            continue
        same = c["schedules_until_all_first"] == off["schedules_until_all_first"]
        lines.append(
            f"{tag}: steps until all first tokens on {c['steps_until_all_first']} / off "
            f"{off['steps_until_all_first']}; schedules identical: {same}"
        )
        for name in sorted(set(c["timing_us"]) | set(off["timing_us"])):
            a, b = c["timing_us"].get(name), off["timing_us"].get(name)
            if a and b:
                lines.append(
                    f"  {name:<40} median us on {a['median']:>9.1f} off {b['median']:>9.1f} "
                    f"(n {a['n']}/{b['n']})"
                )
    return lines


# --------------------------------------------------------------------------- child
def _install_timers(rec: dict) -> None:
    import importlib

    from vllm_dspark_pp.patches import when_imported

    def timed(name, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                rec.setdefault(name, []).append(time.perf_counter() - t0)

        return call

    def patch(mod_name, cls_name, attr):
        def cb(module):
            owner = getattr(module, cls_name)
            if attr in vars(owner):
                setattr(owner, attr, timed(f"{cls_name}.{attr}", vars(owner)[attr]))

        return cb

    for mod_name, cls_name, attr in TIMED:
        # after the plugin: vLLM loads general plugins before it builds the engine, and the
        # plugin patches at import; the timers must sit outside the plugin's wraps
        when_imported(mod_name, patch(mod_name, cls_name, attr))
    del importlib


def child_main(spec_path: str, result_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result: dict = {**spec["case"], "ok": False}

    def dump():
        Path(result_path).write_text(json.dumps(result, default=str))

    try:
        if spec["case"]["sched"] == "async" and spec.get("force_async"):
            from dspark_dev.engine_worker import force_async_scheduling

            force_async_scheduling()
        import vllm.v1.core.sched.scheduler as sched_mod
        from vllm import LLM, SamplingParams
        from vllm.plugins import load_general_plugins
        from vllm.sampling_params import RequestOutputKind

        load_general_plugins()  # so our timers wrap the plugin's patches, not the reverse
        import vllm_dspark_pp.patches as reg

        result["patches_applied"] = reg.applied_patches()
        schedules: list[dict] = []
        timing: dict[str, list[float]] = {}
        if not spec["case"].get("mp"):
            orig_schedule = sched_mod.Scheduler.schedule

            def schedule(self, *a, **k):
                out = orig_schedule(self, *a, **k)
                schedules.append(summarize_schedule(out))
                return out

            sched_mod.Scheduler.schedule = schedule
            _install_timers(timing)
        llm_kw = dict(spec["llm"])
        if spec["case"]["sched"] == "sync":
            llm_kw["async_scheduling"] = False
        llm = LLM(**{"disable_log_stats": False, **llm_kw})
        vc = llm.llm_engine.vllm_config
        result["async_scheduling"] = bool(vc.scheduler_config.async_scheduling)
        result["scheduler_dynamic_sd_lookup"] = None
        c, n_in, vocab = spec["concurrency"], spec["input_len"], spec["vocab"]
        import random

        def prompts(seed):
            rng = random.Random(seed)
            lo, hi = min(1000, vocab // 4), max(vocab - 1000, vocab // 2)
            return [[rng.randrange(lo, hi) for _ in range(n_in)] for _ in range(c)]

        sp = SamplingParams(
            temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True, detokenize=False
        )
        # warm-up, as benchmarks/perf_real_shapes.py does
        llm.generate([{"prompt_token_ids": p} for p in prompts(1)], sp, use_tqdm=False)
        runs = []
        for rep in range(spec["repeats"]):
            ps = prompts(100 + rep)
            if spec["case"].get("mp"):
                # front-end garbage collections during the call (a pause while the C requests
                # are being added splits them over more engine steps)
                gcs, t_gc = [], {}

                def on_gc(phase, info, gcs=gcs, t_gc=t_gc):
                    if phase == "start":
                        t_gc["t"] = time.perf_counter()
                    elif "t" in t_gc:
                        gcs.append((info["generation"], time.perf_counter() - t_gc.pop("t")))

                gc.callbacks.append(on_gc)
                t0 = time.perf_counter()
                try:
                    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
                finally:
                    gc.callbacks.remove(on_gc)
                wall = time.perf_counter() - t0
                ttft = [1e3 * o.metrics.first_token_latency for o in outs if o.metrics]
                runs.append(
                    {
                        "ttft_ms": [round(x, 2) for x in ttft],
                        "wall_ms": round(1e3 * wall, 2),
                        "gc": [(g, round(1e3 * d, 3)) for g, d in gcs],
                        "gc_objects": len(gc.get_objects()),
                    }
                )
                continue
            schedules.clear()
            for v in timing.values():
                v.clear()
            engine = llm.llm_engine
            # LLM.generate set the warm-up params to FINAL_ONLY; every step's tokens are needed
            step_sp = sp.clone()
            step_sp.output_kind = RequestOutputKind.DELTA
            ids = [f"r{rep}-{i}" for i in range(c)]
            for rid, p in zip(ids, ps, strict=True):
                engine.add_request(rid, {"prompt_token_ids": p}, step_sp)
            steps, seen = [], set()
            while engine.has_unfinished_requests():
                n_sched = len(schedules)
                t0 = time.perf_counter()
                outs = engine.step()
                wall = time.perf_counter() - t0
                first = [o.request_id for o in outs if o.outputs and o.outputs[0].token_ids]
                first = [r for r in first if r not in seen]
                seen.update(first)
                steps.append(
                    {
                        "wall_ms": round(1e3 * wall, 3),
                        "schedules": schedules[n_sched:],
                        "first_token": first,
                    }
                )
            fts = first_token_steps(steps, ids)
            last = max(v for v in fts.values() if v is not None) if all(fts.values()) else None
            runs.append(
                {
                    "first_token_step": fts,
                    "steps_until_all_first": last,
                    "steps": steps if last is None else steps[: last + 1],
                    "timing_us": {
                        k: {"n": len(v), "median": 1e6 * statistics.median(v)}
                        for k, v in timing.items()
                        if v
                    },
                }
            )
        result["runs"] = runs
        sched = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
        sched = getattr(sched, "scheduler", None)
        if sched is not None:
            result["scheduler_dynamic_sd_lookup"] = repr(getattr(sched, "dynamic_sd_lookup", None))
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - everything goes to the parent
        import traceback

        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-3000:]
    dump()
    sys.stdout.flush()
    os._exit(0)


def case_summary(res: dict) -> dict:
    """One case's result reduced to what ``compare`` reads (median over repeats)."""
    out = {k: res.get(k) for k in ("engine", "plugin", "sched", "mp", "ok", "error")}
    out["async_scheduling"] = res.get("async_scheduling")
    out["dynamic_sd_lookup"] = res.get("scheduler_dynamic_sd_lookup")
    runs = res.get("runs") or []
    if not res.get("ok") or not runs:
        return out
    if res.get("mp"):
        ttft = [x for r in runs for x in r["ttft_ms"]]
        out["ttft_ms"] = [r["ttft_ms"] for r in runs]
        out["ttft_ms_mean"] = statistics.mean(ttft) if ttft else float("nan")
        out["gc"] = [r.get("gc") for r in runs]
        out["gc_objects"] = runs[-1].get("gc_objects")
        return out
    out["steps_until_all_first"] = [r["steps_until_all_first"] for r in runs]
    out["schedules_until_all_first"] = [
        [
            {k: s[k] for k in ("num_reqs", "tokens", "draft_tokens")}
            for st in r["steps"][: r["steps_until_all_first"] or 0]
            for s in st["schedules"]
        ]
        for r in runs
    ]
    names = sorted({k for r in runs for k in r["timing_us"]})
    out["timing_us"] = {
        k: {
            "median": statistics.median(
                r["timing_us"][k]["median"] for r in runs if k in r["timing_us"]
            ),
            "n": sum(r["timing_us"][k]["n"] for r in runs if k in r["timing_us"]),
        }
        for k in names
    }
    return out


# --------------------------------------------------------------------------- parent
def run_case(case: dict, a, env_base: dict, work: Path) -> dict:
    from dspark_dev.proc import kill_group, start_in_session

    name = f"{case['engine']}-{case['plugin']}-{case['sched']}{'-mp' if case.get('mp') else ''}"
    llm = {
        "model": a.target,
        "max_model_len": a.max_model_len,
        "max_num_seqs": 64,
        "seed": 0,
        "skip_tokenizer_init": True,
        "enforce_eager": a.eager,
    }
    if a.dummy:
        llm["load_format"] = "dummy"
    if a.dtype:
        llm["dtype"] = a.dtype
    if case["engine"] == "dspark":
        sc = {"method": "dspark", "model": a.draft, "num_speculative_tokens": a.k}
        if a.acceptance_length:
            sc["rejection_sample_method"] = "synthetic"
            sc["synthetic_acceptance_length"] = a.acceptance_length
        llm["speculative_config"] = sc
    spec = {
        "case": case,
        "llm": llm,
        "concurrency": a.concurrency,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "vocab": a.vocab,
        "repeats": a.repeats,
        "force_async": a.cpu,
    }
    sp, rp, lp = (work / f"{name}.{x}" for x in ("spec.json", "result.json", "log"))
    sp.write_text(json.dumps(spec))
    env = dict(env_base)
    env["VLLM_PLUGINS"] = "dspark_pp" if case["plugin"] == "on" else "none"
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if case.get("mp") else "0"
    log(f"case {name} ...")
    t0 = time.monotonic()
    with open(lp, "wb") as logf:
        proc = start_in_session(
            [sys.executable, "-m", "benchmarks.first_token_steps", "--child", str(sp), str(rp)],
            env=env,
            stdout=logf,
            stderr=subprocess.STDOUT,
        )
        try:
            proc.wait(timeout=a.case_timeout_s)
        except subprocess.TimeoutExpired:
            log(f"case {name}: TIMEOUT after {a.case_timeout_s} s")
        finally:
            kill_group(proc)
    try:
        res = json.loads(rp.read_text())
    except (OSError, ValueError):
        res = {**case, "ok": False, "error": f"no result (log {lp})"}
    log(f"case {name}: ok={res.get('ok')} in {time.monotonic() - t0:.0f} s {res.get('error', '')}")
    return res


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child_main(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--engines", default="nospec,dspark")
    ap.add_argument("--plugins", default="on,off")
    ap.add_argument("--sched", default="async,sync")
    ap.add_argument("--mp", action="store_true", help="also the multi-process cases (TTFT only)")
    ap.add_argument("--target", default=str(PAIR / "target"))
    ap.add_argument("--draft", default=str(PAIR / "dspark-draft"))
    ap.add_argument("--dummy", action="store_true", help="load_format=dummy")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("-k", type=int, default=7)
    ap.add_argument("--acceptance-length", type=float, default=None)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=448)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--case-timeout-s", type=float, default=240)
    ap.add_argument("--cpu", action="store_true", help="vLLM's CPU platform environment")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if a.cpu:
        from dspark_dev.cpu_env import CPU_ENGINE_EXTRA, CPU_ENV

        env.update(CPU_ENV)
        env.update(CPU_ENGINE_EXTRA)
    env["PYTHONPATH"] = os.pathsep.join(
        dict.fromkeys([str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    )
    cases = []
    mps = [False, True] if a.mp else [False]
    for mp in mps:
        for engine in a.engines.split(","):
            for sched in a.sched.split(","):
                if mp and sched == "sync":
                    continue
                for plugin in a.plugins.split(","):
                    cases.append({"engine": engine, "plugin": plugin, "sched": sched, "mp": mp})
    results = []
    with tempfile.TemporaryDirectory(prefix="fts-") as tmp:
        for case in cases:
            res = run_case(case, a, env, Path(tmp))
            results.append(res)
            (out / "first_token_steps_raw.json").write_text(json.dumps(results, default=str))
    summaries = [case_summary(r) for r in results]
    (out / "first_token_steps.json").write_text(json.dumps(summaries, indent=1, default=str))
    print("\n".join(compare(summaries)), flush=True)
    return 0 if all(s.get("ok") for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
