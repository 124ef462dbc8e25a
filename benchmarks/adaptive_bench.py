"""Adaptive verification in the served-curve benchmark (issue 30, item 4), and the record of
the one-GPU test group ``pp_adaptive`` (issue 30, item 3: ``gpu-record`` below).

benchmarks/serve_pp_one_gpu.py's configurations ``pp1_dspark_adaptive`` and
``pp2_dspark_adaptive`` are ``pp1_dspark`` / ``pp2_dspark`` with
``"enable_adaptive_verification": true`` in the speculative config; this module holds what they
add: the servers' environment (the plugin's PP opt-in on every launcher; which confidences
adaptive verification ranks with, benchmarks/dspark_bench_hooks.py), the start-time check
(adaptive verification needs full CUDA graphs, so not ``--cpu``), and the "adaptive
verification" table that benchmarks/plot_pp_one_gpu.py renders from the recorded JSON: with and
without it, per PP size, acceptance length and concurrency.

Verified draft tokens per step come from the benchmark hooks' step timers (every step's
``InputBatch.num_draft_tokens``, after trimming; ``summary.verify`` of each worker's
``step_times``); the draft's own confidences over the same steps from ``summary.confidences``.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import sys
from pathlib import Path

from benchmarks.dspark_bench_hooks import CONFIDENCES_ENV
from vllm_dspark_pp.protocol.adaptive import SUMMARY_LINE

SUFFIX = "_adaptive"
CONFIDENCE_CHOICES = ("synthetic", "draft")


def adaptive_env(adaptive: bool, pp: int) -> dict[str, str]:
    """What an adaptive configuration's launchers get (all of them: the opt-in must be on every
    node, docs/protocol.md); nothing for the others. The synthetic confidences by default (the
    driver's ``--env DSPARK_BENCH_CONFIDENCES=draft``, applied after this, keeps the draft's).
    Under PP the last stage waits for every stage's profiled step cost for at most the handshake
    timeout; while the deployments of a group compile and capture at once on the one GPU it gets
    the 300 s the one-GPU test gives."""
    if not adaptive:
        return {}
    # here, not at the top: the plot tool imports this module where the plugin may be absent
    from vllm_dspark_pp.protocol.adaptive_config import OPT_IN_ENV
    from vllm_dspark_pp.protocol.handshake import TIMEOUT_ENV as HANDSHAKE_TIMEOUT_ENV

    env = {OPT_IN_ENV: "1", CONFIDENCES_ENV: "synthetic"}
    if pp > 1:
        env[HANDSHAKE_TIMEOUT_ENV] = "300"
    return env


def confidences_of(extra_env: dict[str, str]) -> str:
    """What the adaptive configurations rank with, given the driver's ``--env``."""
    return extra_env.get(CONFIDENCES_ENV, "synthetic")


def check_args(adaptive: bool, cpu: bool, extra_env: dict[str, str]) -> None:
    """Fail before anything starts: adaptive verification cannot run on vLLM's CPU platform; the
    confidences must be one the hook knows."""
    if adaptive and cpu:
        raise SystemExit(
            "--cpu: adaptive verification needs full CUDA graphs (vLLM refuses it with "
            "--enforce-eager); leave the *_adaptive configurations out of --cpu runs"
        )
    if confidences_of(extra_env) not in CONFIDENCE_CHOICES:
        raise SystemExit(
            f"--env {CONFIDENCES_ENV}={confidences_of(extra_env)}: use one of "
            f"{', '.join(CONFIDENCE_CHOICES)}"
        )


# --------------------------------------------------------------------------- the table
def _last_rank_summary(point: dict) -> dict | None:
    """The step-timer summary of the last worker that has one (the sampling stage)."""
    per_rank = point.get("step_times")
    if not isinstance(per_rank, list):
        return None
    found = [s for s in per_rank if isinstance(s, dict) and s.get("verify")]
    return found[-1] if found else None


def _median(vals: list[float]) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def verify_figures(points: list[dict]) -> dict:
    """Medians over repeats of the drafts verified per verify step and per request."""
    sums = [s for s in map(_last_rank_summary, points) if s]
    return {
        "per_step": _median([s["verify"].get("drafts_per_verify_step") for s in sums]),
        "per_request": _median([s["verify"].get("drafts_per_request") for s in sums]),
    }


def adaptive_rows(rows: dict, merged: dict) -> list[dict]:
    """One row per (PP, AL, C) where the fixed (``ppN_dspark``) or the adaptive
    (``ppN_dspark_adaptive``) configuration was measured. ``rows``/``merged`` are
    plot_pp_one_gpu's ``table_rows`` / ``merge`` (keys (configuration, AL, C))."""
    out = []
    measured = {k[0] for k in rows}
    keys = set()
    for config, al, c in rows:
        for pp in (1, 2):
            fixed = f"pp{pp}_dspark"
            if fixed + SUFFIX in measured and config in (fixed, fixed + SUFFIX):
                keys.add((pp, al, c))
    for pp, al, c in sorted(keys, key=lambda t: (t[0], t[1] or 0, t[2])):
        fixed_key, adapt_key = (f"pp{pp}_dspark", al, c), (f"pp{pp}_dspark{SUFFIX}", al, c)
        fixed, adapt = rows.get(fixed_key), rows.get(adapt_key)
        out.append(
            {
                "pp": pp,
                "al": al,
                "c": c,
                "fixed": fixed,
                "adaptive": adapt,
                "fixed_verify": verify_figures(merged.get(fixed_key, [])),
                "adaptive_verify": verify_figures(merged.get(adapt_key, [])),
                "tps_ratio": _div(
                    _get(adapt, "output_throughput"), _get(fixed, "output_throughput")
                ),
                "tpot_ratio": _div(_get(adapt, "p50_tpot_ms"), _get(fixed, "p50_tpot_ms")),
            }
        )
    return out


def confidence_lines(merged: dict) -> list[str]:
    """Per adaptive configuration and AL, over all its points: what the draft's confidences
    were (mean per position weighted by rows, lowest, highest) and what was ranked with."""
    acc: dict[tuple, dict] = {}
    for (config, al, _c), points in merged.items():
        if not config.endswith(SUFFIX):
            continue
        for s in map(_last_rank_summary, points):
            conf = (s or {}).get("confidences")
            if not conf or not conf.get("rows"):
                continue
            a = acc.setdefault((config, al), {"rows": 0, "sum": None, "min": [], "max": []})
            weighted = [m * conf["rows"] for m in conf["mean_per_position"]]
            a["sum"] = (
                weighted
                if a["sum"] is None
                else [x + y for x, y in zip(a["sum"], weighted, strict=True)]
            )
            a["rows"] += conf["rows"]
            a["min"].append(conf["min"])
            a["max"].append(conf["max"])
            a["mode"] = s.get("confidence_mode", "?")
    out = []
    for (config, al), a in sorted(acc.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        mean = ", ".join(f"{x / a['rows']:.4f}" for x in a["sum"])
        out.append(
            f"* `{config}` AL {al:g}: the draft's confidences over {a['rows']} rows: mean per "
            f"position [{mean}], lowest {min(a['min']):.4f}, highest {max(a['max']):.4f}; "
            f"ranked with: {a['mode']}"
        )
    return out


def _get(r: dict | None, name: str) -> float | None:
    return None if r is None else r.get(name)


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _f(v, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


NOTE = (
    "fixed = every draft verified (`ppN_dspark`), adaptive = `enable_adaptive_verification` "
    "(`ppN_dspark_adaptive`, the same server arguments otherwise). Drafts verified: per step "
    "that verified any / per request of such a step (last PP stage's step timers, median over "
    "repeats). AL: measured from the server's spec-decode counters. PP=2 rows: both stages "
    "share one GPU, read them against the PP=2 fixed row only."
)


def adaptive_markdown(rows: dict, merged: dict) -> list[str]:
    table = adaptive_rows(rows, merged)
    if not table:
        return []
    lines = ["", "## Adaptive verification (with vs without, issue 30)", "", NOTE, ""]
    lines += confidence_lines(merged)
    lines += [
        "",
        "| PP | AL | C | drafts/step fixed | drafts/step adaptive | drafts/request fixed | "
        "drafts/request adaptive | tok/s fixed | tok/s adaptive | adaptive / fixed | "
        "TPOT p50 fixed | TPOT p50 adaptive | TPOT p99 fixed | TPOT p99 adaptive | AL fixed | "
        "AL adaptive |",
        "|---:|---:|---:|" + "---:|" * 13,
    ]
    for r in table:
        fx, ad, fv, av = r["fixed"], r["adaptive"], r["fixed_verify"], r["adaptive_verify"]
        cells = [
            str(r["pp"]), _f(r["al"], "{:g}"), str(r["c"]),
            _f(fv["per_step"], "{:.1f}"), _f(av["per_step"], "{:.1f}"),
            _f(fv["per_request"], "{:.2f}"), _f(av["per_request"], "{:.2f}"),
            _f(_get(fx, "output_throughput"), "{:.1f}"),
            _f(_get(ad, "output_throughput"), "{:.1f}"),
            _f(r["tps_ratio"], "{:.3f}"),
            _f(_get(fx, "p50_tpot_ms"), "{:.2f}"), _f(_get(ad, "p50_tpot_ms"), "{:.2f}"),
            _f(_get(fx, "p99_tpot_ms"), "{:.2f}"), _f(_get(ad, "p99_tpot_ms"), "{:.2f}"),
            _f(_get(fx, "measured_al"), "{:.2f}"), _f(_get(ad, "measured_al"), "{:.2f}"),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# --------------------------------------------------------------------------- the GPU test's record
# tests/gpu/test_pp_adaptive_one_gpu.py (group pp_adaptive): its pytest log and the launchers'
# logs (one per deployment and node, the ADAPTIVE_PROBE lines of tests/support/adaptive_probe).
PROBE = re.compile(r"ADAPTIVE_PROBE pid=(\d+) verify_steps=(\d+) verified_drafts=(\d+)")
HANDSHAKE = re.compile(r"PP handshake: (\d+) ranks agree \(([^)]*)\)")
DISAGREE = "stages disagree on the (adaptive verification) batch shape"
DISAGREE_LINE = re.compile(r"(vllm-dspark-pp: PP stage .*?batch shape)")
PARITY = re.compile(r"verify steps (\d+), drafts verified (\d+) of (\d+); (\{.*\})")
CONTROL = re.compile(r"control: (.+?) after ([\d.]+) s")
OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR) (\S+::\S+)", re.M)
SUMMARY = re.compile(r"^=+ (.*?) in ([\d.]+)s", re.M)
TEST_CONST = re.compile(r"^(NUM_PROMPTS|MAX_TOKENS|CONTROL_FAIL_S) = ([\d.]+)", re.M)


def probe_totals(text: str, k: int | None) -> dict[str, dict]:
    """Per process (pid): verify steps, drafts verified, and the steps where fewer than ``k``
    drafts were verified (1-based step, drafts verified in it). The probe prints a running total
    after every verify step; with one request in flight a step schedules ``k`` drafts."""
    seqs: dict[str, list[tuple[int, int]]] = {}
    for pid, steps, verified in PROBE.findall(text):
        seqs.setdefault(pid, []).append((int(steps), int(verified)))
    out = {}
    for pid, seq in seqs.items():
        trimmed, prev = [], 0
        for step, total in seq:
            if k is not None and total - prev < k:
                trimmed.append([step, total - prev])
            prev = total
        out[pid] = {"verify_steps": seq[-1][0], "verified_drafts": seq[-1][1], "trimmed": trimmed}
    return out


def _handshake(text: str) -> dict | None:
    m = HANDSHAKE.search(text)
    if not m:
        return None
    fields = {}
    for f in m.group(2).split(", "):  # "protocol 2", "k=7", "adaptive verification True"
        key, _, val = f.partition("=") if "=" in f else f.rpartition(" ")
        fields[key] = val
    return {"ranks": int(m.group(1)), "line": m.group(2), **fields}


def host_waits(text: str) -> dict[str, dict]:
    """Per PP stage: the counts' lag and how often its host waited for counts, from the last
    adaptive-verification summary line that stage logged."""
    out = {}
    for stage, lag, waits in SUMMARY_LINE.findall(text):
        out[stage] = {"lag": lag, "host_waits": int(waits)}
    return out


def gpu_record(
    pytest_log: Path, log_dir: Path, test_file: Path | None = None, meta: dict | None = None
) -> dict:
    """The figures of one ``pp_adaptive`` run, read from its logs only; ``meta`` (commit, date,
    GPU, command: where the run came from) is kept as given."""
    text = pytest_log.read_text(errors="replace")
    nodes = {}
    k = None
    for log in sorted(log_dir.glob("*.log")):
        body = log.read_text(errors="replace")
        hs = _handshake(body)
        if hs and hs.get("k"):
            k = int(hs["k"])
        dis = DISAGREE_LINE.search(body)
        nodes[log.stem] = {
            "handshake": hs,
            "disagree": dis.group(1) if dis else None,
            "waits": host_waits(body),
            "body": body,
        }
    for n in nodes.values():
        n["probes"] = probe_totals(n.pop("body"), k)
    parity = None
    if m := PARITY.search(text):
        parity = {
            "verify_steps": int(m.group(1)),
            "verified_drafts": int(m.group(2)),
            "scheduled_drafts": int(m.group(3)),
            "metrics": ast.literal_eval(m.group(4)),
        }
    control = None
    if m := CONTROL.search(text):
        control = {"outcome": m.group(1), "seconds": float(m.group(2))}
    summary = SUMMARY.findall(text)
    last = {"result": summary[-1][0], "seconds": float(summary[-1][1])} if summary else None
    consts = dict(TEST_CONST.findall(test_file.read_text())) if test_file else {}
    return {
        "meta": dict(meta or {}),
        "pytest_log": pytest_log.name,
        "summary": last,
        "tests": {name.split("::")[-1]: res for res, name in OUTCOME.findall(text)},
        "test_constants": {key: float(v) if "." in v else int(v) for key, v in consts.items()},
        "k": k,
        "parity": parity,
        "control": control,
        "nodes": nodes,
    }


def _one_probe(rec: dict, node: str) -> dict | None:
    probes = (rec["nodes"].get(node) or {}).get("probes") or {}
    return next(iter(probes.values())) if len(probes) == 1 else None


def gpu_record_markdown(rec: dict) -> list[str]:
    """The figures as markdown lines (every number from ``rec``)."""
    c = rec["test_constants"]
    tests = rec["tests"]
    lines = [
        f"* pytest: {rec['summary']['result']} in {rec['summary']['seconds']:.2f} s "
        f"({rec['pytest_log']}); " + ", ".join(f"`{t}` {r}" for t, r in tests.items()),
        "* Lossless: `test_pp2_adaptive_is_lossless` "
        f"{tests.get('test_pp2_adaptive_is_lossless')}: {c.get('NUM_PROMPTS')} held-out "
        f"prompts, greedy, at most {c.get('MAX_TOKENS')} tokens each, one request in flight: "
        "PP=2 adaptive token ids == PP=1 without "
        "speculation (eager) == PP=1 adaptive.",
    ]
    pp1 = _one_probe(rec, "pp1_adaptive")
    stages = [_one_probe(rec, f"pp2_adaptive_node{i}") for i in (0, 1)]
    if pp1 and all(stages):
        k = rec["k"]
        for name, p in [("PP=1 adaptive", pp1)] + [
            (f"PP=2 adaptive stage {i}", s) for i, s in enumerate(stages)
        ]:
            trims = ", ".join(f"step {st}: {n} of {k}" for st, n in p["trimmed"]) or "none"
            lines.append(
                f"* {name}: {p['verify_steps']} verify steps, {p['verified_drafts']} drafts "
                f"verified of {k * p['verify_steps']} scheduled (k = {k}); steps trimmed: {trims}"
            )
    if par := rec["parity"]:
        m = par["metrics"]
        lag = str((rec.get("meta") or {}).get("lag", "0")).split(" ", 1)[0]
        how = (
            "PP=2 == PP=1 asserted key by key"
            if lag in ("", "0")
            else f"PP=2's; compared with PP=1 only at lag 0, this run's lag is {lag}"
        )
        lines.append(
            f"* Counters (`/metrics`, {how}): num_drafts "
            f"{m['num_drafts']}, num_draft_tokens {m['num_draft_tokens']}, num_accepted_tokens "
            f"{m['num_accepted_tokens']}, accepted per position {m['accepted_per_pos']}"
        )
    hs = (rec["nodes"].get("pp2_adaptive_node1") or {}).get("handshake")
    if hs:
        lines.append(f"* Handshake (stage 1's log): {hs['ranks']} ranks agree ({hs['line']})")
    waits = [
        f"stage {st}: counts lag {w['lag']}, {w['host_waits']} host waits"
        for i in (0, 1)
        for st, w in ((rec["nodes"].get(f"pp2_adaptive_node{i}") or {}).get("waits") or {}).items()
    ]
    if waits:
        lines.append("* PP=2 adaptive, each stage's last summary line: " + "; ".join(waits))
    if ctl := rec["control"]:
        msg = next((n["disagree"] for n in rec["nodes"].values() if n["disagree"]), None)
        probes = [
            f"{node}: {p['verify_steps']} verify step(s)"
            for node, n in rec["nodes"].items()
            if node.startswith("pp2_corrupt")
            for p in n["probes"].values()
        ]
        lines.append(
            f"* Control (stage 0 reads every admitted count off by one): {ctl['outcome']} after "
            f"{ctl['seconds']} s (limit {c.get('CONTROL_FAIL_S')} s); "
            + "; ".join(probes)
            + (f"; the message: `{msg}`" if msg else "; no batch-shape message found")
        )
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="the pp_adaptive GPU group's figures from its logs")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gpu-record")
    g.add_argument("pytest_log", type=Path)
    g.add_argument("log_dir", type=Path, help="the launchers' logs (artifacts' pp_adaptive/)")
    g.add_argument("--test-file", type=Path, default=Path("tests/gpu/test_pp_adaptive_one_gpu.py"))
    g.add_argument("--json", type=Path, default=None)
    for key in ("commit", "date", "gpu", "command", "lag"):
        g.add_argument(f"--{key}", default=None, help=f"the run's {key}, kept in the record's meta")
    a = ap.parse_args(argv)
    meta = {k: getattr(a, k) for k in ("commit", "date", "gpu", "command", "lag") if getattr(a, k)}
    test_file = a.test_file if a.test_file.exists() else None
    rec = gpu_record(a.pytest_log, a.log_dir, test_file, meta)
    if a.json:
        a.json.write_text(json.dumps(rec, indent=1) + "\n")
    print("\n".join(gpu_record_markdown(rec)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
