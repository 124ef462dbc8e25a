#!/usr/bin/env python3
"""docs/results/perf_interleaved_gpu.md from the served benchmark's interleaved records (issue 44).

    python -m benchmarks.interleaved_page            # rewrite the page (and its SVG figure)
    python -m benchmarks.interleaved_page --check    # exit 1 when the committed page is stale

Reads every ``docs/results/serve_interleaved_gpu_*.json``: the JSON that
``benchmarks/serve_pp_one_gpu.py --interleave`` wrote in one call (every configuration served at
once, each point's runs in rotation, ``--repeats`` rotations), copied here unchanged but for a
``meta.commit`` the benchmark did not write before 2026-12-06 (``meta.commit_note`` then says
where it came from). One section per record, oldest first: the run (commit, date, GPU, command,
shape, workload), every server (launchers, start-up, the PD transport its engines were given and
the transports Mooncake's log lines name), then per acceptance length and concurrency:

* each configuration's runs: output tok/s of every repeat, their mean and spread
  ((max - min) / mean), the means of TTFT, TPOT and ITL at p50 and p99, the acceptance length the
  server's counters measured;
* every ratio against the record's baseline (``meta.interleave.baseline``), computed by the
  benchmark per rotation from runs of that rotation (never across calls): the ratio of means and
  the range over rotations, for output tok/s, TTFT p50 and TPOT p50;
* what shortened the point (``trimmed``: the budget cut every run of the point alike) and the runs
  that failed or were cut (``skipped``).

Issue 44's PD goal (served PD at least 50% of aggregated output tok/s at C = 64 on the one GPU)
is stated per PD configuration from the ratios: met or missed where C = 64 was measured, else
"not measured at C = 64" with the concurrencies that were; goal (b) (PP=2's DSpark / no-spec
speed-up at least 0.9 of PP=1's at every C) where a record served all four of pp1_nospec,
pp1_dspark, pp2_nospec, pp2_dspark, per rotation from runs of the same rotation; the balanced
split (``plan``'s layer split at least 1.15x the even one at C >= 16) where a record served
pp2_dspark and pp2_dspark_balanced, met or missed only when the stages ran under MPS; goal (g)
(PP=2 adaptive verification at least as fast as the best fixed k at C >= 16) where a record
served adaptive beside fixed k, settled only with the drafter's own confidences; goal (e)
(the last stage's critical-path bytes per row at most 40 % of raw taps' and its exchange wait
under 3 % of its step at C >= 8) where a record served raw taps beside tap partials. Under
each point, where every server's step goes: the benchmark hook's per-rank GPU timers (step,
target, draft, the exchange's wait share), averaged over the repeats. A run with failed
requests is left out of the tables and ratios, which are then recomputed from the rest by the
benchmark's own summary, and listed with the failed runs. A record
without a field the page needs is refused with :class:`RecordError`. The figure
(``perf_interleaved_gpu.svg``, text, written beside the page when matplotlib is there) plots
each record's output tok/s per configuration against concurrency with the repeats' range.
The same verdicts, one row per goal and record, also make the block between the
``ISSUE44_GOALS`` markers of docs/results/performance.md (:func:`goals_table`), so the goal
figures quoted there are generated too.
tests/unit/benchmarks/test_interleaved_page.py checks the committed page is this module's output.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from benchmarks.pages import page_main

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
PAGE = RESULTS / "perf_interleaved_gpu.md"
FIGURE = RESULTS / "perf_interleaved_gpu.svg"
PATTERN = "serve_interleaved_gpu_*.json"
#: issue 44: served PD at least this share of aggregated output tok/s at PD_GOAL_C
PD_GOAL, PD_GOAL_C = 0.5, 64
#: issue 44 goal (b): PP=2's DSpark / no-spec speed-up at least this share of PP=1's, every C
GOAL_B = 0.9
GOAL_B_CONFIGS = ("pp1_nospec", "pp1_dspark", "pp2_nospec", "pp2_dspark")
#: issue 44: plan's layer split at least this much above the even one at C >= SPLIT_GOAL_MIN_C
SPLIT_GOAL, SPLIT_GOAL_MIN_C = 1.15, 16
SPLIT_CONFIGS = ("pp2_dspark", "pp2_dspark_balanced")
#: issue 44 goal (g): PP=2 adaptive over the best fixed k at least this, at C >= GOAL_G_MIN_C
GOAL_G, GOAL_G_MIN_C = 1.0, 16
#: issue 44 goal (e): critical-path bytes per received row at most GOAL_E_BYTES of raw taps', and
#: the last stage's exchange wait under GOAL_E_WAIT of its step, at C >= GOAL_E_MIN_C
GOAL_E_BYTES, GOAL_E_WAIT, GOAL_E_MIN_C = 0.40, 0.03, 8
GOAL_E_RAW = "pp2_dspark"
GOAL_E_TAPS = ("pp2_dspark_taps_dict", "pp2_dspark_taps_side")
META_KEYS = ("commit", "date", "command", "configs", "shape", "workload", "interleave", "versions")
POINT_KEYS = ("acceptance_length", "concurrency", "num_prompts", "configs", "ratios")
#: (stats key, column title, format) of the per-configuration table
COLUMNS = (
    ("median_ttft_ms", "TTFT p50 ms", "{:.1f}"),
    ("p99_ttft_ms", "TTFT p99 ms", "{:.1f}"),
    ("median_tpot_ms", "TPOT p50 ms", "{:.2f}"),
    ("p99_tpot_ms", "TPOT p99 ms", "{:.2f}"),
    ("median_itl_ms", "ITL p50 ms", "{:.2f}"),
    ("p99_itl_ms", "ITL p99 ms", "{:.2f}"),
)
RATIO_METRICS = (
    ("output_throughput", "output tok/s"),
    ("median_ttft_ms", "TTFT p50"),
    ("median_tpot_ms", "TPOT p50"),
)


class RecordError(ValueError):
    """A record the page cannot be written from."""


def _need(obj, key: str, where: str):
    if not isinstance(obj, dict) or key not in obj:
        raise RecordError(f"{where}: no {key!r}")
    return obj[key]


def check(name: str, rec: dict) -> None:
    """Refuse a record without the fields the page reads."""
    meta = _need(rec, "meta", name)
    for key in META_KEYS:
        _need(meta, key, f"{name}: meta")
    _need(meta["interleave"], "baseline", f"{name}: meta.interleave")
    _need(meta["versions"], "gpu", f"{name}: meta.versions")
    _need(rec, "servers", name)
    points = _need(rec, "interleaved", name)
    if not points:
        raise RecordError(f"{name}: no interleaved point (not an --interleave run)")
    for i, pt in enumerate(points):
        where = f"{name}: interleaved[{i}]"
        for key in POINT_KEYS:
            _need(pt, key, where)
        for cfg, v in pt["configs"].items():
            for r in _need(v, "repeats", f"{where}: {cfg}"):
                _need(r, "output_throughput", f"{where}: {cfg} repeat")
            _need(v, "stats", f"{where}: {cfg}")
        for pair, v in pt["ratios"].items():
            out = _need(v, "output_throughput", f"{where}: ratio {pair}")
            for key in ("ratio_of_means", "per_rotation", "min", "max"):
                _need(out, key, f"{where}: ratio {pair} output_throughput")


def failed_request_runs(rec: dict) -> list[dict]:
    """The record's runs that had failed requests (``vllm bench serve``'s ``failed``); their
    throughput counts only what finished before the server broke. Until the benchmark refused
    them (2026-12-06) such a run could enter the record's comparison."""
    return [p for p in rec.get("points", []) if int((p.get("bench") or {}).get("failed") or 0)]


def without_failed_runs(rec: dict) -> dict:
    """``rec`` with its comparison recomputed by the benchmark's own summary from the runs
    whose every request completed; the left-out runs are listed among the failed ones."""
    bad = failed_request_runs(rec)
    if not bad:
        return rec
    from benchmarks.serve_pp_one_gpu import interleave_summary

    ids = {id(p) for p in bad}
    keep = [p for p in rec["points"] if id(p) not in ids]
    inter = rec["meta"]["interleave"]
    names = [inter["baseline"]] + [c for c in rec["meta"]["configs"] if c != inter["baseline"]]
    out = dict(rec)
    out["interleaved"] = interleave_summary(keep, names, inter.get("repeats", 3))
    out["skipped"] = [
        {"config": p["config"], "acceptance_length": p.get("acceptance_length"),
         "concurrency": p["concurrency"], "repeat": p.get("repeat"),
         "why": f"{p['bench']['failed']} of {p['bench']['failed'] + p['bench'].get('completed', 0)}"
                " requests failed: left out of the tables and ratios (recorded as a run)"}
        for p in bad
    ] + list(rec.get("skipped") or [])  # fmt: skip
    return out


def load(results: Path = RESULTS) -> list[tuple[str, dict]]:
    runs = []
    for path in sorted(results.glob(PATTERN)):
        rec = json.loads(path.read_text())
        check(path.name, rec)
        runs.append((path.name, without_failed_runs(rec)))
    return sorted(runs, key=lambda r: (r[1]["meta"]["date"], r[0]))


def _fmt(fmt: str, v) -> str:
    return "-" if v is None else fmt.format(v)


def _mean(stats: dict, key: str):
    s = stats.get(key)
    return s.get("mean") if isinstance(s, dict) else None


def _measured_al(v: dict):
    vals = [r["measured_acceptance_length"] for r in v["repeats"]
            if r.get("measured_acceptance_length") is not None]  # fmt: skip
    return statistics.mean(vals) if vals else None


def _servers(rec: dict) -> list[str]:
    lines = []
    transports = rec["meta"].get("pd_transport") or {}
    for name, s in rec["servers"].items():
        outcome = s.get("outcome", "outcome not recorded")
        text = (f"* `{name}`: {s.get('launchers', '?')} launcher(s), ready after "
                f"{_fmt('{:.0f}', s.get('ready_s'))} s, {outcome}")  # fmt: skip
        t = transports.get(name)
        if t:
            envs = sorted({f"{k}={v}" for e in t.get("engines", {}).values()
                           for k, v in e.get("env", {}).items()})  # fmt: skip
            shown = ", ".join(f"`{e}`" for e in envs) or "none"
            text += (f"; PD over {t.get('connector')}, protocol `{t.get('mooncake_protocol')}`"
                     f", engine environment {shown}")  # fmt: skip
        mc = s.get("mooncake_transport")
        if mc is not None:
            got = ", ".join(f"`{x}`" for x in mc.get("transports", [])) or "none logged"
            text += f"; transports in Mooncake's log lines: {got}"
        lines.append(text)
    return lines


def _config_rows(pt: dict) -> list[str]:
    head = ["config", "runs", "output tok/s per repeat", "mean", "spread"]
    head += [t for _, t, _ in COLUMNS] + ["AL measured"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cfg, v in pt["configs"].items():
        reps = [r["output_throughput"] for r in v["repeats"]]
        st = v["stats"].get("output_throughput") or {}
        cells = [f"`{cfg}`", str(len(reps)), ", ".join(f"{x:.0f}" for x in reps) or "-",
                 _fmt("{:.0f}", st.get("mean")),
                 _fmt("{:.1%}", st.get("spread")) if len(reps) > 1 else "-"]  # fmt: skip
        cells += [_fmt(f, _mean(v["stats"], k)) for k, _, f in COLUMNS]
        cells.append(_fmt("{:.2f}", _measured_al(v)))
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _ratio_rows(pt: dict) -> list[str]:
    head = ["ratio", "rotations"]
    head += [f"{t} (ratio of means; range over rotations)" for _, t in RATIO_METRICS]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for pair, v in pt["ratios"].items():
        cells = [f"`{pair}`", str(v.get("rotations", len(v["output_throughput"]["per_rotation"])))]
        for key, _ in RATIO_METRICS:
            r = v.get(key)
            cells.append("-" if not r or r.get("ratio_of_means") is None or not r["min"] else
                         f"{r['ratio_of_means']:.3f} ({r['min']:.3f}-{r['max']:.3f})")  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _why(skipped: dict) -> str:
    why = str(skipped.get("why") or "").rstrip()
    return why if why.rstrip(":") not in ("", "bench failed") else why + " (no error text recorded)"


class Stated(list):
    """A goal as a record states it: the page's lines (``head: verdict``, a blank line, one line
    per point), with the verdict and the per-point lines also kept apart for :func:`goals_table`
    (so the table never re-parses the page's text)."""

    def __init__(self, head: str, verdict: str, points: list[str]):
        super().__init__([f"{head}: {verdict}", "", *points])
        self.verdict = verdict
        self.points = [p.removeprefix("* ") for p in points]


def pd_rows(rec: dict) -> list[tuple[str, str, str, str]]:
    """Issue 44's PD goal per PD configuration of the record, from its ratios: (configuration,
    baseline, verdict, what was measured)."""
    base = rec["meta"]["interleave"]["baseline"]
    pds = [c for c in rec["meta"]["configs"] if c.startswith("pd_") and c != base]
    rows = []
    for cfg in pds:
        key = f"{cfg}/{base}"
        seen = {pt["concurrency"]: pt["ratios"][key]["output_throughput"]
                for pt in rec["interleaved"] if key in pt["ratios"]}  # fmt: skip
        seen = {c: r for c, r in seen.items() if r["per_rotation"]}  # runs of both in a rotation
        got = ", ".join(
            f"C = {c}: {r['ratio_of_means']:.3f} ({r['min']:.3f}-{r['max']:.3f}, "
            f"{len(r['per_rotation'])} rotation(s))"
            for c, r in sorted(seen.items())
        )
        if PD_GOAL_C in seen:
            low = seen[PD_GOAL_C]["min"]
            verdict = "**met**" if low >= PD_GOAL else "**missed**"
            verdict += f" at C = {PD_GOAL_C} (lowest rotation {low:.3f})"
        else:
            verdict = f"**not measured at C = {PD_GOAL_C}**"
        rows.append((cfg, base, verdict, got or "nothing"))
    return rows


def pd_goal(rec: dict) -> list[str]:
    """Issue 44's PD goal per PD configuration of the record, one line each (empty: no PD)."""
    goal = f"goal: at least {PD_GOAL:.0%} of its output tok/s at C = {PD_GOAL_C}"
    return [f"* `{cfg}` against `{base}` ({goal}): {verdict}; measured {got}"
            for cfg, base, verdict, got in pd_rows(rec)]  # fmt: skip


def _rank_means(worker: dict) -> dict | None:
    """One worker's timers over one run: step, target and draft GPU ms averaged over every step
    (weighted by the steps of each batch size), and the exchange's wait share of a step."""
    per = worker.get("per_num_reqs") or {}
    steps = sum(v.get("steps", 0) for v in per.values())
    if not steps:
        return None
    out = {"steps": steps}
    for key in ("step_ms", "target_ms", "draft_ms"):
        out[key] = sum(v["steps"] * (v.get(key) or 0.0) for v in per.values()) / steps
    out["wait_share"] = (worker.get("exchange") or {}).get("stall_share")
    graphs = worker.get("graphs") or {}
    if graphs:  # the graph most steps replayed (records from 2026-12-07 on), with its share
        kind, g = max(graphs.items(), key=lambda kv: kv[1]["steps"])
        slots = f", {g['graph_reqs']:.0f} slots" if g.get("graph_reqs") else ""
        out["graph"] = (
            f"{kind}{slots} ({g['steps'] / sum(v['steps'] for v in graphs.values()):.0%})"
        )
    return out


def stage_rows(rec: dict, pt: dict) -> list[str]:
    """Per configuration and worker rank (PP stage for TP=1), the benchmark hook's timers at
    this point, averaged over the repeats: where a PP step's time goes (the cause behind a
    ratio). Empty when the record has no step timers here."""
    by: dict[tuple[str, int], list[dict]] = {}
    for p in rec.get("points", []):
        here = (p.get("concurrency"), p.get("point_al"))
        if here != (pt["concurrency"], pt["acceptance_length"]):
            continue
        if p.get("repeat") is None or not isinstance(p.get("step_times"), list):
            continue
        run_s = (p.get("bench") or {}).get("duration")
        for rank, w in enumerate(p["step_times"]):
            m = _rank_means(w) if isinstance(w, dict) else None
            if m:
                # the share of the run the rank spent inside its steps (1.0: never idle)
                m["busy"] = m["steps"] * m["step_ms"] / (1e3 * run_s) if run_s else None
                by.setdefault((p["config"], rank), []).append(m)
    if not by:
        return []
    head = ["config", "rank", "runs", "steps per run", "step ms", "target ms", "draft ms",
            "exchange wait / step", "in steps / run"]  # fmt: skip
    graphs = any(m.get("graph") for ms in by.values() for m in ms)
    if graphs:
        head.append("graph most steps ran")
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = {c: i for i, c in enumerate(pt["configs"])}
    for (cfg, rank), ms in sorted(by.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1])):
        waits = [m["wait_share"] for m in ms if m["wait_share"] is not None]
        busy = [m["busy"] for m in ms if m.get("busy") is not None]
        cells = [f"`{cfg}`", str(rank), str(len(ms)),
                 f"{statistics.mean(m['steps'] for m in ms):.0f}",
                 *(f"{statistics.mean(m[k] for m in ms):.2f}"
                   for k in ("step_ms", "target_ms", "draft_ms")),
                 _fmt("{:.1%}", statistics.mean(waits) if waits else None),
                 _fmt("{:.0%}", statistics.mean(busy) if busy else None)]  # fmt: skip
        if graphs:
            cells.append(" / ".join(sorted({m.get("graph") or "-" for m in ms})))
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _by_repeat(pt: dict, cfg: str) -> dict[int, float]:
    runs = pt["configs"].get(cfg, {}).get("repeats", [])
    return {r["repeat"]: r["output_throughput"] for r in runs if "repeat" in r}


def _per_point(rec: dict, quotients, none_text: str, min_c: int = 0):
    """Per interleaved point from ``min_c`` on, ``quotients(pt)`` (one per rotation) as a line of
    mean and range; returns (lines, each point's lowest rotation)."""
    lines, lows = [], []
    for pt in rec["interleaved"]:
        if pt["concurrency"] < min_c:
            continue
        qs = quotients(pt)
        where = f"AL {pt['acceptance_length']}, C = {pt['concurrency']}"
        if not qs:
            lines.append(f"* {where}: {none_text}")
            continue
        lows.append(min(qs))
        lines.append(f"* {where}: {statistics.mean(qs):.3f} (rotations {min(qs):.3f}-"
                     f"{max(qs):.3f}, {len(qs)})")  # fmt: skip
    return lines, lows


def _verdict(lows: list[float], goal: float) -> str:
    if not lows:
        return "**not measured**"
    word = "met" if min(lows) >= goal else "missed"
    return f"**{word}** (lowest rotation {min(lows):.3f})"


def goal_b(rec: dict) -> list[str]:
    """Issue 44 goal (b) where the record served PP=1 and PP=2, each with and without DSpark:
    per point and rotation the quotient (pp2_dspark / pp2_nospec) / (pp1_dspark / pp1_nospec)
    of output tok/s, from runs of the same rotation; met when every rotation of every point is
    at least :data:`GOAL_B`."""
    if not set(GOAL_B_CONFIGS) <= set(rec["meta"]["configs"]):
        return []

    def quotients(pt):
        runs = [_by_repeat(pt, c) for c in GOAL_B_CONFIGS]
        rotations = sorted(set.intersection(*(set(r) for r in runs)))
        return [(runs[3][i] / runs[2][i]) / (runs[1][i] / runs[0][i]) for i in rotations]

    lines, lows = _per_point(rec, quotients, "no rotation with all four configurations")
    head = (f"Issue 44 goal (b), PP=2's DSpark / no-spec speed-up at least {GOAL_B} of PP=1's "
            f"at every C, per rotation")  # fmt: skip
    return Stated(head, _verdict(lows, GOAL_B), lines)


def split_goal(rec: dict) -> list[str]:
    """Issue 44's balanced-split goal where a record served PP=2 DSpark with the even layer
    split and with ``plan``'s (``pp2_dspark`` and ``pp2_dspark_balanced``): per point at
    C >= :data:`SPLIT_GOAL_MIN_C` and per rotation, plan's split over the even one; met when
    every rotation is at least :data:`SPLIT_GOAL` on a testbed where the stages ran concurrently
    (``meta.mps.used``)."""
    even, plan = SPLIT_CONFIGS
    if not set(SPLIT_CONFIGS) <= set(rec["meta"]["configs"]):
        return []
    split = ((rec["meta"].get("stage_split") or {}).get(plan) or {}).get("partition")
    mps = rec["meta"].get("mps") or {}

    def quotients(pt):
        a, b = _by_repeat(pt, even), _by_repeat(pt, plan)
        return [b[r] / a[r] for r in sorted(set(a) & set(b))]

    lines, lows = _per_point(rec, quotients, "no rotation with both splits", SPLIT_GOAL_MIN_C)
    if lows and not mps.get("used"):
        verdict = (f"**not settled**: the stages time-sliced the GPU (no MPS); lowest rotation "
                   f"{min(lows):.3f}")  # fmt: skip
    else:
        verdict = _verdict(lows, SPLIT_GOAL)
    shares = f"MPS thread shares {mps.get('requested')}" if mps.get("used") else "no MPS"
    head = (f"Issue 44's balanced split, PP=2 DSpark with plan's layer split "
            f"{split or '?'} over the even split, at least {SPLIT_GOAL:.2f}x at C >= "
            f"{SPLIT_GOAL_MIN_C} per rotation ({shares})")  # fmt: skip
    return Stated(head, verdict, lines)


def goal_g(rec: dict) -> list[str]:
    """Issue 44 goal (g) where the record served adaptive verification beside fixed k (the
    benchmark's ``adaptive_vs_best_fixed`` per point: the fixed k of the highest mean output
    tok/s at the same PP size, and adaptive over it per rotation): at PP > 1 and C >=
    :data:`GOAL_G_MIN_C` adaptive at least as fast as the best fixed k in every rotation, settled
    only with non-oracle confidences (``meta.adaptive_confidences`` ``draft``: the drafter's own;
    ``synthetic`` hands adaptive the sampler's own rates)."""
    from benchmarks.serve_pp_one_gpu import CONFIGS

    rows = [(pt, name, v) for pt in rec["interleaved"]
            for name, v in (pt.get("adaptive_vs_best_fixed") or {}).items()]  # fmt: skip
    if not rows:
        return []
    conf = rec["meta"].get("adaptive_confidences")
    lines, lows = [], []
    for pt, name, v in rows:
        where = f"`{name}` AL {pt['acceptance_length']}, C = {pt['concurrency']}"
        per = v.get("per_rotation") or []
        if not v.get("best_fixed") or not per:
            lines.append(f"* {where}: {v.get('why', 'no rotation with both')}")
            continue
        counts = CONFIGS[name].pp > 1 and pt["concurrency"] >= GOAL_G_MIN_C
        if counts:
            lows.append(min(per))
        lines.append(f"* {where}: {statistics.mean(per):.3f} of `{v['best_fixed']}` (k = "
                     f"{v.get('best_fixed_k')}; rotations {min(per):.3f}-{max(per):.3f}, "
                     f"{len(per)})" + ("" if counts else " (outside the goal)"))  # fmt: skip
    if lows and conf != "draft":
        verdict = f"**not settled**: confidences `{conf}` (the goal asks for the drafter's own)"
    else:
        verdict = _verdict(lows, GOAL_G)
    head = (f"Issue 44 goal (g), PP=2 adaptive verification at least as fast as the best fixed k "
            f"at C >= {GOAL_G_MIN_C}, per rotation, confidences `{conf}`")  # fmt: skip
    return Stated(head, verdict, lines)


def _last_stage_exchange(rec: dict, cfg: str, pt: dict) -> list[dict]:
    """Per repeat of ``cfg`` at ``pt``: the last PP stage's exchange (the last worker whose
    exchange received stage-to-stage tensors): critical-path bytes per received row (every
    ``pp_recv_bytes:<key>`` over ``pp_recv_rows``, medians per step), the side channel's bytes
    per row, the keys, the wait share of its step (``stall_share``) and, where the record has
    the first stage's send span (``pp_send_ms``, recorded since 2026-12-07), the link's bound:
    the smaller of the last stage's median wait and the first stage's median send span, over
    the last stage's main step (the hook's docstring says why the smaller bounds the transfer
    time the last stage is exposed to; the first and last workers are one link's ends at PP=2
    only, so the bound is left out at other PP sizes)."""
    out = []
    for p in rec.get("points", []):
        here = (p.get("concurrency"), p.get("point_al"))
        if p.get("config") != cfg or here != (pt["concurrency"], pt["acceptance_length"]):
            continue
        if p.get("repeat") is None or not isinstance(p.get("step_times"), list):
            continue
        found = [w["exchange"] for w in p["step_times"] if isinstance(w, dict)
                 and (w.get("exchange") or {}).get("median", {}).get("pp_recv_rows")]  # fmt: skip
        if not found:
            continue
        med, rows = found[-1]["median"], found[-1]["median"]["pp_recv_rows"]
        keys = sorted(k.split(":", 1)[1] for k in med if k.startswith("pp_recv_bytes:"))
        side = sum(v for k, v in med.items() if k.startswith("side_recv_bytes:"))
        workers = [w for w in p["step_times"] if isinstance(w, dict)]
        send = ((workers[0].get("exchange") or {}).get("median") or {}).get("pp_send_ms")
        if p.get("pp") not in (None, 2):
            send = None
        step = ((workers[-1].get("main") or {}).get("step_ms")) or 0
        link = (min(send, med.get("pp_recv_wait_ms", send)) / step
                if send is not None and step > 0 else None)  # fmt: skip
        out.append({
            "bytes_per_row": sum(med[f"pp_recv_bytes:{k}"] for k in keys) / rows,
            "side_per_row": side / rows,
            "keys": keys,
            "wait": found[-1].get("stall_share"),
            "send_ms": send,
            "link": link,
        })  # fmt: skip
    return out


def short_runs(rec: dict, pt: dict) -> str:
    """A sentence when a point's counted runs lasted less than the ``--min-run-s`` its record
    asked and the budget did not shorten them (that case has its own ``trimmed`` text): the
    prompt count came from a TPOT estimate that was too slow (before the driver's probe wave,
    from ``--guess-tpot-ms``). Empty otherwise."""
    asked = ((rec["meta"].get("interleave") or {}).get("min_run_s")) or 0
    secs = [r["duration"] for c in pt["configs"].values() for r in c.get("repeats", [])
            if isinstance(r.get("duration"), (int, float))]  # fmt: skip
    if not asked or not secs or min(secs) >= asked or pt.get("trimmed"):
        return ""
    here = (pt["acceptance_length"], pt["concurrency"])
    points = rec.get("points", [])
    probed = any(p.get("probe") and _point_key(p) == here for p in points)
    # the record's first measured run is this point's: nothing measured came before it
    first = next((_point_key(p) for p in points if p.get("repeat") is not None), None) == here
    if probed:
        why = "the probe's TPOT, before this point"
    elif first:
        why = "the guessed TPOT (no probe wave in this record)"
    else:
        why = "the TPOT and calibration of the points before it"
    return (f" Runs lasted {min(secs):.1f}-{max(secs):.1f} s, under the {asked:.0f} s asked "
            f"(`--min-run-s`): the prompt count came from {why}.")  # fmt: skip


def _point_key(p: dict) -> tuple:
    return (p.get("point_al"), p.get("concurrency"))


def _link_text(got: list[dict]) -> str:
    """The first stage's send span and the link's bound of :func:`_last_stage_exchange`'s
    repeats, where the record has them ("" otherwise: records before 2026-12-07)."""
    links = [g["link"] for g in got if g.get("link") is not None]
    if not links:
        return ""
    sends = [g["send_ms"] for g in got if g.get("send_ms") is not None]
    return (f"; stage 0's sends {statistics.mean(sends):.2f} ms from its forward's end, the "
            f"exposed transfer at most {statistics.mean(links):.1%} of a step (repeats "
            f"{min(links):.1%}-{max(links):.1%})")  # fmt: skip


def goal_e(rec: dict) -> list[str]:
    """Issue 44 goal (e) where a record served raw taps (``pp2_dspark``) beside a tap-partials
    deployment: per point at C >= :data:`GOAL_E_MIN_C` and configuration, the last stage's
    critical-path bytes per received row against raw taps' (at most :data:`GOAL_E_BYTES`) and
    its exchange wait share of a step in every repeat (under :data:`GOAL_E_WAIT`); met by a
    configuration that meets both at every such point. A deployment whose launchers kept raw taps
    shows raw taps' keys and a ratio of 1."""
    cfgs = [c for c in GOAL_E_TAPS if c in rec["meta"]["configs"]]
    if GOAL_E_RAW not in rec["meta"]["configs"] or not cfgs:
        return []
    lines, ok = [], {c: None for c in cfgs}
    for pt in rec["interleaved"]:
        if pt["concurrency"] < GOAL_E_MIN_C:
            continue
        raw = _last_stage_exchange(rec, GOAL_E_RAW, pt)
        for cfg in [GOAL_E_RAW, *cfgs]:
            got = raw if cfg == GOAL_E_RAW else _last_stage_exchange(rec, cfg, pt)
            where = f"`{cfg}` AL {pt['acceptance_length']}, C = {pt['concurrency']}"
            waits = [g["wait"] for g in got if g["wait"] is not None]
            if not got or not raw or not waits:
                lines.append(f"* {where}: no exchange timers")
                if cfg != GOAL_E_RAW:
                    ok[cfg] = False
                continue
            share = statistics.mean(g["bytes_per_row"] for g in got) / statistics.mean(
                g["bytes_per_row"] for g in raw
            )
            side = statistics.mean(g["side_per_row"] for g in got)
            lines.append(
                f"* {where}: {statistics.mean(g['bytes_per_row'] for g in got):.0f} B per row on "
                f"the critical path ({', '.join(got[0]['keys'])}), {share:.2f} of raw taps'"
                + (f", {side:.0f} B per row on the side channel" if side else "")
                + f"; wait {statistics.mean(waits):.1%} of a step (repeats {min(waits):.1%}-"
                f"{max(waits):.1%}, {len(waits)})" + _link_text(got)
            )
            if cfg != GOAL_E_RAW:
                meets = share <= GOAL_E_BYTES + 1e-9 and max(waits) < GOAL_E_WAIT
                ok[cfg] = meets if ok[cfg] is None else ok[cfg] and meets
    met = [c for c, v in ok.items() if v]
    if all(v is None for v in ok.values()):
        verdict = f"**not measured** (no point at C >= {GOAL_E_MIN_C})"
    elif met:
        verdict = "**met** by " + ", ".join(f"`{c}`" for c in met)
    else:
        verdict = "**missed** by every tap-partials deployment"
    head = (f"Issue 44 goal (e), the last stage's critical-path bytes per row at most "
            f"{GOAL_E_BYTES:.0%} of raw taps' and its exchange wait under {GOAL_E_WAIT:.0%} of "
            f"its step in every repeat, at C >= {GOAL_E_MIN_C}")  # fmt: skip
    return Stated(head, verdict, lines)


def section(name: str, rec: dict) -> list[str]:
    m = rec["meta"]
    v = m["versions"]
    wl = m["workload"]
    lines = [
        f"## {m['date']}: {', '.join(m['configs'])} ([{name}]({name}))",
        "",
        f"* commit `{m['commit']}`" + (f" ({m['commit_note']})" if m.get("commit_note") else ""),
        f"* GPU: {v['gpu']} ({v.get('gpus', 1)}); vLLM {v.get('vllm')}, torch {v.get('torch')}",
        f"* command (on the GPU machine): `{m['command']}`",
        f"* shape `{m['shape']}`, workload `{wl.get('name')}` ({wl.get('input_len')} in / "
        f"{wl.get('output_len')} out), k = {m.get('k')}, acceptance lengths "
        f"{m.get('acceptance_lengths')}, servers started {m.get('start', '?')}, layout "
        f"`{m.get('gpu_layout', '?')}`; baseline of the ratios `{m['interleave']['baseline']}`, "
        f"{m['interleave'].get('repeats')} repeats asked, rotation "
        f"`{m['interleave'].get('rotation')}`",
        "",
        "Servers:",
        "",
        *_servers(rec),
    ]
    for pt in rec["interleaved"]:
        prompts = pt["num_prompts"]
        lines += [
            "",
            f"### AL {pt['acceptance_length']}, C = {pt['concurrency']}",
            "",
            f"{', '.join(map(str, prompts))} prompts per run"
            + ("" if pt.get("equal_prompts", True) else " (NOT equal across configurations)")
            + (f"; shortened: {pt['trimmed']}" if pt.get("trimmed") else "")
            + "."
            + short_runs(rec, pt),
            "",
            *_config_rows(pt),
            "",
            *_ratio_rows(pt),
        ]
        stages = stage_rows(rec, pt)
        if stages:
            lines += ["", "Where each server's step goes (the benchmark hook's GPU timers per "
                      "worker rank, PP stage order at TP = 1; means over the repeats; *in steps "
                      "/ run*: steps x step time over the run's duration, 100 % for a rank that "
                      "is never idle):", "", *stages]  # fmt: skip
    skipped = rec.get("skipped") or []
    lines += ["", "Runs that failed or were cut:" if skipped else "No run failed or was cut."]
    if skipped:
        lines += [""] + [f"* `{s.get('config')}` AL {s.get('acceptance_length')} C = "
                         f"{s.get('concurrency')} repeat {s.get('repeat', '?')}: {_why(s)}"
                         for s in skipped]  # fmt: skip
    goal = pd_goal(rec)
    if goal:
        lines += ["", "Issue 44's PD goal, from the ratios above:", "", *goal]
    for goal in (goal_b(rec), split_goal(rec), goal_e(rec), goal_g(rec)):
        if goal:
            lines += ["", *goal]
    return lines + [""]


def markdown(runs: list[tuple[str, dict]]) -> str:
    head = [
        f"<!-- generated by benchmarks/interleaved_page.py from {PATTERN}; do not edit -->",
        "# Served comparisons measured in one call, interleaved (issue 44)",
        "",
        "Each section is one record of `benchmarks/serve_pp_one_gpu.py --interleave`: every "
        "configuration started at once on the one GPU, then each point's runs in rotation (one "
        "run of every configuration per rotation, `--repeats` rotations), so a ratio divides "
        "runs of the same rotation of the same call. Spread: (max - min) / mean over the "
        "repeats. Runs are shortened alike when the call's budget is short (`shortened`); "
        "such points are a few seconds long and say so. All deployments share the one GPU, so "
        "absolute figures are this testbed's; the ratios are the result.",
        "",
    ]
    if not runs:
        return "\n".join(head + ["No record yet.", ""])
    if FIGURE.exists():
        head += [f"![output tok/s per configuration]({FIGURE.name})", ""]
    body = [line for name, rec in runs for line in section(name, rec)]
    return "\n".join(head + body)


def figure(runs: list[tuple[str, dict]], path: Path = FIGURE) -> bool:
    """Output tok/s per configuration against concurrency, the repeats' range as error bars;
    one panel per record and acceptance length. SVG (text), deterministic. False without
    matplotlib or records."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [(name, rec, al) for name, rec in runs
              for al in sorted({pt["acceptance_length"] for pt in rec["interleaved"]})]  # fmt: skip
    if not panels:
        return False
    plt.rcParams["svg.hashsalt"] = "interleaved"
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (_name, rec, al) in zip(axes[0], panels, strict=True):
        pts = [pt for pt in rec["interleaved"] if pt["acceptance_length"] == al]
        for cfg in rec["meta"]["configs"]:
            xs, ys, lo, hi = [], [], [], []
            for pt in pts:
                reps = [
                    r["output_throughput"] for r in pt["configs"].get(cfg, {}).get("repeats", [])
                ]
                if reps:
                    m = statistics.mean(reps)
                    xs.append(pt["concurrency"])
                    ys.append(m)
                    lo.append(m - min(reps))
                    hi.append(max(reps) - m)
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=cfg)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tok/s")
        ax.set_title(f"{rec['meta']['date'][:10]} {rec['meta']['shape']} AL {al}", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    return True


def text() -> str:
    runs = load()
    return markdown(runs)


#: issue 44's goals in the order the issue lists them: (label, what it asks, the function that
#: states it from one record; None: the PD goal, a row per PD configuration from pd_rows)
GOALS = (
    ("(b)", f"PP=2's DSpark / no-spec speed-up at least {GOAL_B} of PP=1's at every C", goal_b),
    ("balanced split", f"plan's layer split at least {SPLIT_GOAL:.2f}x the even one at C >= "
     f"{SPLIT_GOAL_MIN_C}, stages concurrent", split_goal),
    ("(e)", f"critical-path bytes per row at most {GOAL_E_BYTES:.0%} of raw taps'; the last "
     f"stage's exchange wait under {GOAL_E_WAIT:.0%} at C >= {GOAL_E_MIN_C}", goal_e),
    ("(g)", f"PP=2 adaptive at least as fast as the best fixed k at C >= {GOAL_G_MIN_C}, "
     "non-oracle confidences", goal_g),
    ("PD", f"served PD at least {PD_GOAL:.0%} of aggregated output tok/s at C = {PD_GOAL_C}",
     None),
)  # fmt: skip
PERFORMANCE = RESULTS / "performance.md"
GOALS_BEGIN = "<!-- BEGIN ISSUE44_GOALS (benchmarks/interleaved_page.py; do not edit) -->"
GOALS_END = "<!-- END ISSUE44_GOALS -->"


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def goals_table(runs: list[tuple[str, dict]]) -> list[str]:
    """Every issue 44 goal as each record states it (the same functions as the record's section
    of the page): goal, record (date, commit), verdict, the figures per point. A goal no record
    states gets one row saying so."""
    rows = ["| goal | record | verdict | per point (ratio of means, range over rotations) |",
            "|---|---|---|---|"]  # fmt: skip
    for label, asks, fn in GOALS:
        found = 0
        for name, rec in runs:
            mps = rec["meta"].get("mps") or {}
            bed = f"MPS {mps.get('requested')}" if mps.get("used") else "no MPS"
            where = (f"[{name}]({name}) ({rec['meta']['date'][:10]}, `{rec['meta']['commit']}`, "
                     f"{bed})")  # fmt: skip
            if fn is None:
                cells = [(f"{where}, `{cfg}`", verdict, got)
                         for cfg, _, verdict, got in pd_rows(rec)]  # fmt: skip
            else:
                stated = fn(rec)
                cells = [(where, stated.verdict, "; ".join(stated.points))] if stated else []
            for record, verdict, points in cells:
                rows.append(f"| {label}: {asks} | {record} | {_cell(verdict)} | {_cell(points)} |")
                found += 1
        if not found:
            rows.append(f"| {label}: {asks} | none | **no record states it** | - |")
    return rows


def performance_text() -> str:
    """docs/results/performance.md with its issue 44 goals block rewritten from the records."""
    text_now = PERFORMANCE.read_text()
    head, sep, rest = text_now.partition(GOALS_BEGIN)
    _, sep2, tail = rest.partition(GOALS_END)
    if not sep or not sep2:
        raise RecordError(f"{PERFORMANCE} has no {GOALS_BEGIN} ... {GOALS_END} block")
    block = "\n".join(goals_table(load()))
    return f"{head}{GOALS_BEGIN}\n{block}\n{GOALS_END}{tail}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--check" not in argv:
        figure(load())
    rc = page_main(PAGE, text, __doc__.splitlines()[0], argv)
    return page_main(PERFORMANCE, performance_text, __doc__.splitlines()[0], argv) or rc


if __name__ == "__main__":
    sys.exit(main())
