"""Adaptive verification in the served-curve benchmark (issue 30, item 4).

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

import statistics

from dspark_bench_hooks import CONFIDENCES_ENV

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
