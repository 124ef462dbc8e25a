#!/usr/bin/env python3
"""Tables, ratios and a figure from benchmarks/serve_pp_one_gpu.py's recorded JSON (issue 29).

    python3 -m benchmarks.plot_pp_one_gpu RUN1/serve_pp_one_gpu_pp1.json RUN2/...pp2.json \\
        --md docs/results/perf_pp_one_gpu.md --png docs/results/perf_pp_one_gpu.png \\
        --copy-to docs/results

Every number in the markdown is computed here from the JSON files given (several files of the
same configuration are repeats: the tables give the median, the repeat count and the spread).
What it writes:

* per configuration, acceptance length and concurrency: output tok/s, TTFT p50/p99, TPOT p50/p99
  (vLLM's ``vllm bench serve`` result fields) and the acceptance length measured from the
  server's spec-decode counters;
* the ratios: DSpark / no-spec at PP=2 beside the same at PP=1, and their quotient, which is
  goal (b) of issue 29 (PP=2's ratio at least 0.9x PP=1's at every concurrency), stated as met,
  missed or not measured from the data; PP=2 / PP=1 at equal work; plugin on / off at PP=2;
* the transport the PP=2 launchers' logs name (NCCL ranks and nodes, the socket transport,
  the exchange's backend);
* adaptive verification with vs without (``ppN_dspark_adaptive`` against ``ppN_dspark``, PP=1
  and PP=2, per AL and C; benchmarks/adaptive_bench.py): drafts verified per step and per
  request, output tok/s and its quotient, TPOT p50/p99, measured acceptance length, and what the
  draft's confidences were;
* a PNG (matplotlib): output tok/s, TTFT p50/p99, TPOT p50/p99 against concurrency and the
  DSpark / no-spec ratio at PP=1 and PP=2;
* PD vs aggregated (the ``pd`` group: ``pd_dspark``, the prefill-only producer + decoder behind
  dspark_dev/pd_proxy.py, against ``agg_dspark_kv``, one aggregated engine with the same total KV
  cache): per AL and C both sides' TTFT and TPOT p50/p99, output tok/s and their quotient, the
  acceptance length each side's counters give, and the PD evidence of each point (the share of
  prompt tokens the decoder took from the connector, the producer's draft tokens, the proxy's
  errors); with ``--png`` a figure of the same (``<png>_pd.png`` beside the PP figure, or the
  PNG itself when the files hold PD runs only).

``--copy-to DIR`` copies the JSON files into DIR (the markdown names the copies).
``--only FILE=CONFIG[@AL],...`` keeps, of the file named FILE (its base name), only the points
of those configurations (and acceptance lengths): e.g. a baseline measured in another call,
``--only serve_pp_one_gpu_pp2.json=pp2_dspark@3.99``. Files not named keep every point.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from benchmarks.adaptive_bench import adaptive_markdown
from benchmarks.dspark_bench_hooks import STALLS

GOAL_B = 0.9
GOAL_E_SHARE = 0.03  # issue 29 goal (e): the exchange under 3% of a decode step at C >= 8
GOAL_E_MIN_C = 8
PD, AGG, PD_PP2 = "pd_dspark", "agg_dspark_kv", "pd_pp2_dspark"
PD_NIXL = "pd_nixl_dspark"
PD_CONFIGS = (PD, AGG, PD_PP2, PD_NIXL)
NIXL_NOTE = (
    "Producer, decoder and the aggregated engine all run on the one GPU, measured in turn; the "
    "KV goes over NixlConnector with UCX `cuda_ipc` (device to device within the GPU, no host "
    "copy), so this PD pays the transfer without the TCP transport's host round trip, and still "
    "shares the GPU's compute between the producer's prefills and the decoder's steps."
)
PD_NOTE = (
    "Producer, decoder and the aggregated engine all run on the one GPU; when the PD side is "
    "measured the aggregated engine sits idle and the other way round, but the producer's "
    "prefills and the decoder's steps share the GPU's compute, and the KV goes over "
    "MooncakeConnector's TCP transport on loopback (GPU to host to socket and back), so PD "
    "here pays its transfer without getting a second GPU: read it as the cost side of PD, not "
    "as what PD gains on two devices."
)
METRICS = (
    ("output_throughput", "output tok/s", "{:.1f}"),
    ("p50_ttft_ms", "TTFT p50 ms", "{:.1f}"),
    ("p99_ttft_ms", "TTFT p99 ms", "{:.1f}"),
    ("p50_tpot_ms", "TPOT p50 ms", "{:.2f}"),
    ("p99_tpot_ms", "TPOT p99 ms", "{:.2f}"),
)
CAVEAT = (
    "Both PP stages share one GPU's compute and NCCL runs over loopback sockets, so the absolute "
    "numbers of the PP=2 rows say nothing about PP=2 on two GPUs: only the ratios mean anything."
)


def load(paths: list[str | Path]) -> list[dict]:
    runs = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        data["_file"] = Path(p).name
        runs.append(data)
    return runs


def parse_only(specs: list[str]) -> dict[str, list[tuple[str, float | None]]]:
    """``FILE=CONFIG[@AL],...`` (repeatable) -> file name -> [(configuration, AL or None)]."""
    out: dict[str, list[tuple[str, float | None]]] = {}
    for spec in specs:
        name, sep, sel = spec.partition("=")
        if not sep or not sel:
            raise SystemExit(f"--only {spec}: use FILE=CONFIG[@AL],...")
        for item in sel.split(","):
            config, at, al = item.partition("@")
            out.setdefault(Path(name).name, []).append((config, float(al) if at else None))
    return out


def keep_only(runs: list[dict], only: dict[str, list[tuple[str, float | None]]]) -> list[dict]:
    """Each run named in ``only`` with only its selected points (``skipped`` kept as is); a name
    that matches no run, or a selection that keeps nothing, is an error."""
    missing = set(only) - {r["_file"] for r in runs}
    if missing:
        raise SystemExit(f"--only names {', '.join(sorted(missing))}: not among the results")
    out = []
    for run in runs:
        sel = only.get(run["_file"])
        if sel is None:
            out.append(run)
            continue
        pts = [
            p
            for p in run.get("points", [])
            if any(
                p["config"] == c and (al is None or p.get("acceptance_length") == al)
                for c, al in sel
            )
        ]
        if not pts:
            raise SystemExit(f"--only {run['_file']}: no point of {sel}")
        kept = ", ".join(c + (f"@{al:g}" if al is not None else "") for c, al in sel)
        out.append({**run, "points": pts, "_only": kept})
    return out


def point_key(p: dict) -> tuple[str, float | None, int]:
    return (p["config"], p.get("acceptance_length"), int(p["concurrency"]))


def merge(runs: list[dict]) -> dict[tuple, list[dict]]:
    """Every measured point of every run, grouped by (configuration, AL, C): the repeats (each
    point tagged with its run's file name, ``_file``)."""
    out: dict[tuple, list[dict]] = {}
    for run in runs:
        for p in run.get("points", []):
            out.setdefault(point_key(p), []).append({**p, "_file": run.get("_file")})
    return out


def metric(p: dict, name: str) -> float | None:
    v = (p.get("bench") or {}).get(name)
    if v is None and name.startswith("p50_"):
        v = (p.get("bench") or {}).get("median_" + name[4:])
    return None if v is None else float(v)


def summarize(points: list[dict]) -> dict:
    """Medians over repeats, the repeat count and the spread of output tok/s."""
    out: dict = {"n": len(points)}
    for name, _, _ in METRICS:
        vals = [v for v in (metric(p, name) for p in points) if v is not None]
        out[name] = statistics.median(vals) if vals else None
    tps = [v for v in (metric(p, "output_throughput") for p in points) if v is not None]
    out["spread_pct"] = (
        100.0 * (max(tps) - min(tps)) / statistics.median(tps) if len(tps) > 1 else None
    )
    als = [p["measured_acceptance_length"] for p in points if p.get("measured_acceptance_length")]
    out["measured_al"] = statistics.median(als) if als else None
    out["prompts"] = sorted({int(p["num_prompts"]) for p in points})
    return out


def table_rows(merged: dict) -> dict[tuple, dict]:
    return {k: summarize(v) for k, v in merged.items()}


def ordered(rows: dict) -> list[tuple[tuple, dict]]:
    """Rows by configuration, AL (no-spec first), concurrency."""
    return sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0, kv[0][2]))


def label(config: str, al: float | None) -> str:
    return config if al is None else f"{config} AL {al:g}"


def tps(rows: dict, config: str, al: float | None, c: int) -> float | None:
    r = rows.get((config, al, c))
    return None if r is None else r.get("output_throughput")


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def speedup_ratios(rows: dict) -> list[dict]:
    """DSpark / no-spec at PP=1 and PP=2 for each (AL, C), and PP=2's over PP=1's (goal b)."""
    als = sorted({k[1] for k in rows if k[1] is not None})
    cs = sorted({k[2] for k in rows})
    out = []
    for al in als:
        for c in cs:
            r1 = _div(tps(rows, "pp1_dspark", al, c), tps(rows, "pp1_nospec", None, c))
            r2 = _div(tps(rows, "pp2_dspark", al, c), tps(rows, "pp2_nospec", None, c))
            if r1 is None and r2 is None:
                continue
            out.append({"al": al, "c": c, "pp1": r1, "pp2": r2, "pp2_over_pp1": _div(r2, r1)})
    return out


def goal_b(ratios: list[dict], expected_cs: list[int], expected_als: list[float]) -> dict:
    """Goal (b): PP=2's DSpark/no-spec ratio >= 0.9x PP=1's at every concurrency (and AL)."""
    have = {(r["al"], r["c"]): r["pp2_over_pp1"] for r in ratios}
    missing = [(al, c) for al in expected_als for c in expected_cs if have.get((al, c)) is None]
    below = sorted((al, c, v) for (al, c), v in have.items() if v is not None and v < GOAL_B)
    vals = [v for v in have.values() if v is not None]
    if below:
        verdict = "missed"
    elif not vals:
        verdict = "not measured"
    elif missing:
        verdict = "met where measured (incomplete)"
    else:
        verdict = "met"
    return {
        "verdict": verdict,
        "min": min(vals) if vals else None,
        "below": below,
        "missing": missing,
        "measured": len(vals),
    }


def equal_work_ratios(rows: dict) -> list[dict]:
    """PP=2 / PP=1 of the same work (no-spec; DSpark at each AL): output tok/s and TPOT p50."""
    out = []
    for (config, al, c), r2 in sorted(
        rows.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0, kv[0][2])
    ):
        if not config.startswith("pp2_") or config.endswith("_stock"):
            continue
        r1 = rows.get(("pp1_" + config[4:], al, c))
        if r1 is None:
            continue
        out.append(
            {
                "what": label(config[4:], al),
                "c": c,
                "tps": _div(r2["output_throughput"], r1["output_throughput"]),
                "tpot": _div(r2["p50_tpot_ms"], r1["p50_tpot_ms"]),
            }
        )
    return out


def paired_ratio(merged: dict, on_key: tuple, off_key: tuple) -> float | None:
    """Median over the runs that measured both points of on / off output tok/s (the same run:
    same servers' start, same GPU state), or None when no run holds both."""
    vals = []
    for off in merged.get(off_key, []):
        for on in merged.get(on_key, []):
            if on.get("_file") is not None and on.get("_file") == off.get("_file"):
                r = _div(metric(on, "output_throughput"), metric(off, "output_throughput"))
                if r is not None:
                    vals.append(r)
    return statistics.median(vals) if vals else None


def plugin_ratios(rows: dict, merged: dict | None = None) -> list[dict]:
    """Plugin on / off (stock vLLM) at PP=2, same work: over the medians of every repeat
    (``tps``) and, with ``merged``, within the runs that measured both (``same_run``)."""
    out = []
    for (config, al, c), off in sorted(
        rows.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0, kv[0][2])
    ):
        if not config.endswith("_stock"):
            continue
        on_key = (config.removesuffix("_stock"), al, c)
        on = rows.get(on_key)
        if on is None:
            continue
        out.append(
            {
                "what": label(config.removesuffix("_stock"), al),
                "c": c,
                "tps": _div(on["output_throughput"], off["output_throughput"]),
                "same_run": (
                    paired_ratio(merged, on_key, (config, al, c)) if merged is not None else None
                ),
                "repeats": (on.get("n", 0), off.get("n", 0)),
            }
        )
    return out


def step_rows(merged: dict) -> list[dict]:
    """Per point (first repeat with step times) and PP rank: the main batch's target / draft /
    step ms."""
    out = []
    for (config, al, c), points in ordered(merged):
        timed = [p["step_times"] for p in points if isinstance(p.get("step_times"), list)]
        per_rank = timed[0] if timed else None
        if per_rank is None:
            continue
        for rank, summ in enumerate(per_rank):
            main = (summ or {}).get("main") if isinstance(summ, dict) else None
            if not main:
                continue
            out.append(
                {
                    "what": label(config, al),
                    "c": c,
                    "rank": rank,
                    "batch": summ.get("main_num_reqs"),
                    "target_ms": main.get("target_ms"),
                    "draft_ms": main.get("draft_ms"),
                    "step_ms": main.get("step_ms"),
                    "draft_share": _div(main.get("draft_ms"), main.get("step_ms")),
                }
            )
    return out


def exchange_rows(merged: dict) -> list[dict]:
    """Per PP=2 point (first repeat with exchange records) and rank: bytes per step sent /
    received stage to stage and by the token broadcasts, the stalls and the side-stream spans
    (medians over the main batch size's steps; dspark_bench_hooks.summarize_exchange)."""
    out = []
    for (config, al, c), points in ordered(merged):
        timed = [p["step_times"] for p in points if isinstance(p.get("step_times"), list)]
        per_rank = next((t for t in timed if any(_xsum(s) for s in t)), None)
        if per_rank is None:
            continue
        for rank, summ in enumerate(per_rank):
            x = _xsum(summ)
            if not x:
                continue
            med = x.get("median") or {}
            step = ((summ.get("main") or {}).get("step_ms")) if isinstance(summ, dict) else None

            def total(prefix: str, med=med) -> int:
                return int(sum(v for k, v in med.items() if k.startswith(prefix)))

            stall = sum(med.get(k, 0.0) for k in STALLS)
            out.append(
                {
                    "what": label(config, al),
                    "c": c,
                    "rank": rank,
                    "batch": summ.get("main_num_reqs"),
                    "steps": x.get("steps"),
                    "pp_send_bytes": total("pp_send_bytes:"),
                    "pp_recv_bytes": total("pp_recv_bytes:"),
                    "pp_keys": sorted(
                        k.split(":", 1)[1]
                        for k in med
                        if k.startswith(("pp_send_bytes:", "pp_recv_bytes:"))
                    ),
                    "pp_recv_rows": med.get("pp_recv_rows"),
                    "x_bytes": total("x_bytes:"),
                    "pp_recv_wait_ms": med.get("pp_recv_wait_ms"),
                    "pp_recv_ready_ms": med.get("pp_recv_ready_ms"),
                    "pp_recv_host_ms": med.get("pp_recv_host_ms"),
                    "x_bcast_ms": med.get("x_bcast_ms"),
                    "x_wait_ms": med.get("x_wait_ms"),
                    # the DSpark tap side channel (VLLM_DSPARK_PP_TAP_PARTIALS=side): bytes a stage
                    # sends straight to the last one, what the last one receives, its stall
                    "side_send_bytes": total("side_send_bytes:"),
                    "side_recv_bytes": total("side_recv_bytes:"),
                    "side_wait_ms": med.get("side_wait_ms"),
                    "stall_ms": stall,
                    "step_ms": step,
                    "draft_ms": ((summ.get("main") or {}).get("draft_ms")),
                    "stall_share": x.get("stall_share"),
                }
            )
    return out


def _xsum(summ) -> dict | None:
    return summ.get("exchange") if isinstance(summ, dict) else None


def goal_e(xrows: list[dict]) -> dict:
    """Goal (e) per measured C >= 8: the largest stall share over the ranks and configurations
    at that C (an upper bound of the exchange's share: the stalls also hold the peer's compute
    before it sends); met when below GOAL_E_SHARE."""
    by_c: dict[int, float] = {}
    for r in xrows:
        if r["c"] >= GOAL_E_MIN_C and r["stall_share"] is not None:
            by_c[r["c"]] = max(by_c.get(r["c"], 0.0), r["stall_share"])
    per_c = {c: ("met" if v < GOAL_E_SHARE else "missed", v) for c, v in sorted(by_c.items())}
    if not per_c:
        verdict = "not measured"
    elif all(v[0] == "met" for v in per_c.values()):
        verdict = "met"
    else:
        verdict = "missed"
    return {"per_c": per_c, "verdict": verdict}


def goal_e_by_stage(xrows: list[dict]) -> dict[int, dict[int, dict]]:
    """Per C >= 8 and PP rank, the largest stall share over the configurations and the largest
    draft ms of that rank's main batch: the first stage's share is its stall on the last
    stage's tokens (it holds the last stage's forward and draft, the bubble), the last stage's
    is its stall on the activations (the wire, plus what the first stage had not finished)."""
    out: dict[int, dict[int, dict]] = {}
    for r in xrows:
        if r["c"] < GOAL_E_MIN_C or r["stall_share"] is None:
            continue
        cur = out.setdefault(r["c"], {}).setdefault(r["rank"], {"share": 0.0, "draft_ms": None})
        cur["share"] = max(cur["share"], r["stall_share"])
        if r.get("draft_ms") is not None:
            cur["draft_ms"] = max(cur["draft_ms"] or 0.0, r["draft_ms"])
    return {c: dict(sorted(v.items())) for c, v in sorted(out.items())}


def exchange_section(merged: dict) -> list[str]:
    xr = exchange_rows(merged)
    if not xr:
        return []
    lines = ["", "## The exchange per step (goal e)", "", CAVEAT, ""]
    lines += [
        "Medians over the decode steps of the most frequent batch size, first repeat with "
        "exchange records (benchmarks/dspark_bench_hooks.py). *sent / recv* = bytes stage to "
        "stage (vLLM's intermediate tensors, every key); *tok B* = the last stage's token "
        "broadcasts (sampled, counts, drafts); *act wait* = how long the receiving stage's "
        "stream stalled on the activations, *ready* = from posting the receive to the data "
        "being usable, *host* = host time of posting it (blocks on the sender's metadata); "
        "*bcast* = broadcast side-stream time, *tok wait* = main-stream stall on the received "
        "tokens; *side B* / *side wait ms* = the DSpark tap side channel's bytes (sent by a "
        "stage that makes taps, received by the last stage) and the last stage's stall on them "
        "right before its drafter (VLLM_DSPARK_PP_TAP_PARTIALS=side; 0 and - otherwise); "
        "*share* = (act wait + tok wait + side wait) / step: an upper bound of the exchange's "
        "share, since with both stages on one GPU a stall also holds the peer's compute (the "
        "*host* wait comes before the step's window and is not in the share).",
        "",
        "| configuration | C | rank | batch | sent B | recv B (rows) | tok B | act wait ms | "
        "ready ms | host ms | bcast ms | tok wait ms | side B | side wait ms | draft ms | "
        "step ms | share |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in xr:
        rows = _f(r["pp_recv_rows"], " ({:.0f})")
        lines.append(
            f"| {r['what']} | {r['c']} | {r['rank']} | {r['batch']} | {r['pp_send_bytes']} | "
            f"{r['pp_recv_bytes']}{'' if rows == '-' else rows} | {r['x_bytes']} | "
            f"{_f(r['pp_recv_wait_ms'], '{:.3f}')} | {_f(r['pp_recv_ready_ms'], '{:.3f}')} | "
            f"{_f(r['pp_recv_host_ms'], '{:.3f}')} | {_f(r['x_bcast_ms'], '{:.3f}')} | "
            f"{_f(r['x_wait_ms'], '{:.3f}')} | "
            f"{r.get('side_send_bytes', 0) + r.get('side_recv_bytes', 0)} | "
            f"{_f(r.get('side_wait_ms'), '{:.3f}')} | {_f(r.get('draft_ms'), '{:.3f}')} | "
            f"{_f(r['step_ms'], '{:.3f}')} | "
            f"{_f(r['stall_share'], '{:.1%}')} |"
        )
    g = goal_e(xr)
    per = ", ".join(f"C={c}: {v} ({s:.1%})" for c, (v, s) in g["per_c"].items())
    lines += [
        "",
        f"**Goal (e)** (the exchange under {GOAL_E_SHARE:.0%} of a decode step at C >= "
        f"{GOAL_E_MIN_C}, judged on the upper bound, largest share over ranks and "
        f"configurations): **{g['verdict']}**" + (f"; {per}" if per else "") + ".",
    ]
    by_stage = goal_e_by_stage(xr)
    if by_stage:
        parts = []
        for c, ranks in by_stage.items():
            last = max(ranks)
            each = ", ".join(
                f"rank {rk} {v['share']:.1%}"
                + (f" (draft {v['draft_ms']:.2f} ms)" if v["draft_ms"] is not None else "")
                for rk, v in ranks.items()
            )
            parts.append(
                f"C={c}: {each}; last stage (rank {last}) "
                f"{'met' if ranks[last]['share'] < GOAL_E_SHARE else 'missed'}"
            )
        lines += [
            "",
            "By stage (largest share over the configurations at each C >= "
            f"{GOAL_E_MIN_C}; *draft* = the rank's draft ms per step, the last stage's is the "
            "bubble the first stage waits on): " + "; ".join(parts) + ". The first stage's "
            "share is its stall on the last stage's tokens, which holds the last stage's "
            "forward and draft; the last stage's is its stall on the activations, which holds "
            "the wire and whatever of the first stage's forward had not finished.",
        ]
    return lines


def pd_evidence(points: list[dict]) -> dict:
    """What the recorded PD counters say over every repeat of a point: the share of the
    decoder's prompt tokens that came from the connector (``external_prefix_cache_hits`` /
    ``prompt_tokens``), the producer's draft tokens (0 for a prefill-only producer), the proxy's
    requests and errors."""
    hits = prompt = drafts = requests = 0.0
    errors = 0
    seen = False
    for p in points:
        pd = p.get("pd") or {}
        kv, prod, proxy = (
            pd.get("decoder_kv") or {},
            pd.get("producer_spec") or {},
            pd.get("proxy") or {},
        )
        if "error" in kv or not kv:
            continue
        seen = True
        hits += kv.get("vllm:external_prefix_cache_hits_total", 0.0)
        prompt += kv.get("vllm:prompt_tokens_total", 0.0)
        drafts += prod.get("num_draft_tokens", 0.0)
        requests += proxy.get("requests", 0.0)
        errors += len(proxy.get("errors") or [])
    if not seen:
        return {"kv_pulled": None, "producer_drafts": None, "requests": None, "errors": None}
    return {
        "kv_pulled": _div(hits, prompt),
        "producer_drafts": drafts,
        "requests": requests,
        "errors": errors,
    }


def pd_rows(rows: dict, merged: dict, pd_name: str = PD) -> list[dict]:
    """PD (``pd_name``) vs aggregated per (AL, C) measured on either side."""
    keys = sorted({(k[1] or 0.0, k[2]) for k in rows if k[0] in (pd_name, AGG)})
    out = []
    for al, c in keys:
        pd, agg = rows.get((pd_name, al, c)), rows.get((AGG, al, c))
        out.append(
            {
                "al": al,
                "c": c,
                "pd": pd,
                "agg": agg,
                "tps_ratio": _div(
                    (pd or {}).get("output_throughput"), (agg or {}).get("output_throughput")
                ),  # fmt: skip
                "evidence": pd_evidence(merged.get((pd_name, al, c), [])),
            }
        )
    return out


def pd_markdown(rows: dict, merged: dict) -> list[str]:
    lines = _pd_table(rows, merged, PD)
    for other in (PD_PP2, PD_NIXL):
        if any(k[0] == other for k in rows):
            lines += _pd_table(rows, merged, other)
    return lines + pd_hops_markdown(merged)


def pd_hop_row(points: list[dict]) -> dict | None:
    """Where a PD point's requests spent their time, medians over the repeats that recorded it:
    each span's p50 ms and mean requests inside it (the proxy's hop timer,
    serve_pp_one_gpu.hop_summary), and the connector's transfers (time and bytes per
    batch, bytes per request, the rate while a transfer ran)."""
    summaries = [
        s for p in points if (s := ((p.get("pd") or {}).get("hops") or {}).get("summary"))
        if s.get("completed")
    ]  # fmt: skip
    if not summaries:
        return None

    def med(vals: list) -> float | None:
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    out: dict = {"n": len(summaries)}
    for span in ("prefill", "handoff", "decode_first", "stream", "total"):
        for key in ("p50_ms", "p99_ms", "in_flight"):
            out[f"{span}_{key}"] = med([s.get(span, {}).get(key) for s in summaries])
    per_rep: list[tuple[float, float, float, float]] = []
    for p in points:
        x = (p.get("pd") or {}).get("kv_xfer") or {}
        done = (((p.get("pd") or {}).get("hops") or {}).get("summary") or {}).get("completed")
        t, n = x.get("xfer_time_seconds_sum"), x.get("xfer_time_seconds_count")
        b = x.get("bytes_transferred_sum")
        if t and n and b and done:
            per_rep.append((t / n * 1e3, b / n / 2**20, b / done / 2**20, b / t / 2**30))
    for i, key in enumerate(("xfer_ms", "xfer_mib", "mib_per_request", "gib_per_s")):
        out[key] = med([r[i] for r in per_rep])
    return out


def pd_hops_markdown(merged: dict) -> list[str]:
    """The per-hop table of every PD configuration whose points carry the proxy's hop timer."""
    rows = [
        (k, r) for k in sorted(merged, key=lambda k: (k[0], k[1] or 0, k[2]))
        if k[0] in (PD, PD_PP2, PD_NIXL) and (r := pd_hop_row(merged[k]))
    ]  # fmt: skip
    if not rows:
        return []
    lines = [
        "",
        "## Where a PD request's time goes (proxy hop timer, the connector's counters)",
        "",
        "Per request at dspark_dev/pd_proxy.py: `prefill` = the producer's queue and prefill "
        "(prefill sent to answered), `handoff` = answered to decode sent, `decode_first` = "
        "decode sent to the decoder's first event (its KV pull, its queue, its first step), "
        "`stream` = first to last event; p50 / p99 ms, and in brackets the mean number of "
        "requests inside that span over the point (Little's law: where they queue). Transfers: "
        "the connector's `vllm:<connector>_xfer_time_seconds` / `_bytes_transferred` histograms "
        "(Mooncake's producer, NIXL's decoder), per "
        "transfer batch, per completed request, and bytes over the summed transfer time. "
        "Medians over repeats.",
        "",
        "| configuration | C | prefill ms | handoff ms | decode_first ms | stream ms | "
        "xfer ms / batch | MiB / batch | MiB / request | GiB/s in transfer | repeats |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def span(r: dict, name: str) -> str:
        return (
            f"{_f(r[f'{name}_p50_ms'], '{:.1f}')} / {_f(r[f'{name}_p99_ms'], '{:.1f}')} "
            f"({_f(r[f'{name}_in_flight'], '{:.1f}')})"
        )

    for (config, al, c), r in rows:
        lines.append(
            f"| {label(config, al)} | {c} | {span(r, 'prefill')} | {span(r, 'handoff')} | "
            f"{span(r, 'decode_first')} | {span(r, 'stream')} | {_f(r['xfer_ms'], '{:.1f}')} | "
            f"{_f(r['xfer_mib'], '{:.1f}')} | {_f(r['mib_per_request'], '{:.1f}')} | "
            f"{_f(r['gib_per_s'], '{:.2f}')} | {r['n']} |"
        )
    return lines


def _pd_table(rows: dict, merged: dict, pd_name: str) -> list[str]:
    if not any(k[0] in (pd_name, AGG) for k in rows):
        return []
    table = pd_rows(rows, merged, pd_name)

    def g(side, name, fmt):
        return _f((side or {}).get(name), fmt)

    title = {
        PD: "PD vs aggregated",
        PD_PP2: "PD with a PP=2 producer vs aggregated",
        PD_NIXL: "PD over NixlConnector vs aggregated",
    }[pd_name]
    nixl = pd_name == PD_NIXL
    note = NIXL_NOTE if nixl else PD_NOTE
    lines = ["", f"## {title}, served (issue 29 item 3)", "", note, ""]
    lines += [
        f"`{pd_name}`: the DSpark prefill-only producer (`kv_producer`, context-KV-only drafter"
        + ("; two launchers, one PP stage each" if pd_name == PD_PP2 else "")
        + ") and the DSpark decoder (`kv_consumer`) over "
        + ("NixlConnector (UCX `cuda_ipc`)" if nixl else "MooncakeConnector (TCP)")
        + ", behind "
        "dspark_dev/pd_proxy.py (its own process; it streams the decoder's answer, so TTFT "
        "includes the prefill, the KV pull and the decoder's first step). `agg_dspark_kv`: one "
        "aggregated DSpark engine with the producer's plus the decoder's KV-cache bytes. "
        "Medians over repeats; AL = the decoder's / the aggregated engine's spec-decode counters.",
        "",
        "| AL | C | TTFT p50 PD / agg ms | TTFT p99 PD / agg ms | TPOT p50 PD / agg ms | "
        "TPOT p99 PD / agg ms | tok/s PD / agg | PD / agg tok/s | AL PD / agg | KV pulled | "
        "producer drafts | proxy errors | repeats PD / agg |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        pd, agg, ev = r["pd"], r["agg"], r["evidence"]
        lines.append(
            f"| {r['al']:g} | {r['c']} | {g(pd, 'p50_ttft_ms', '{:.1f}')} / "
            f"{g(agg, 'p50_ttft_ms', '{:.1f}')} | {g(pd, 'p99_ttft_ms', '{:.1f}')} / "
            f"{g(agg, 'p99_ttft_ms', '{:.1f}')} | {g(pd, 'p50_tpot_ms', '{:.2f}')} / "
            f"{g(agg, 'p50_tpot_ms', '{:.2f}')} | {g(pd, 'p99_tpot_ms', '{:.2f}')} / "
            f"{g(agg, 'p99_tpot_ms', '{:.2f}')} | {g(pd, 'output_throughput', '{:.0f}')} / "
            f"{g(agg, 'output_throughput', '{:.0f}')} | {_f(r['tps_ratio'], '{:.3f}')} | "
            f"{g(pd, 'measured_al', '{:.2f}')} / {g(agg, 'measured_al', '{:.2f}')} | "
            f"{_f(ev['kv_pulled'], '{:.1%}')} | {_f(ev['producer_drafts'], '{:.0f}')} | "
            f"{_f(ev['errors'], '{}')} | {(pd or {}).get('n', 0)} / {(agg or {}).get('n', 0)} |"
        )
    return lines


def plot_pd(runs: list[dict], png: Path) -> str | None:
    """TTFT p50/p99, TPOT p50/p99 and output tok/s of PD and aggregated against concurrency."""
    merged = merge(runs)
    table = pd_rows(table_rows(merged), merged)
    if not table:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no PD plot: matplotlib not importable ({e})"
    fig, axes = plt.subplots(1, 5, figsize=(20, 4))
    for ax, (name, title, _) in zip(axes.flat, METRICS[1:] + METRICS[:1], strict=True):
        for side, style in (("pd", "-"), ("agg", "--")):
            for al in sorted({r["al"] for r in table}):
                pts = [(r["c"], (r[side] or {}).get(name)) for r in table if r["al"] == al]
                pts = [(c, y) for c, y in pts if y is not None]
                if pts:
                    who = "PD (producer + decoder)" if side == "pd" else "aggregated, same KV"
                    ax.plot([c for c, _ in pts], [y for _, y in pts], style, marker="o",
                            label=f"{who}, AL {al:g}")  # fmt: skip
        ax.set_title(title)
    cs = sorted({r["c"] for r in table})
    return _finish(
        fig, axes, cs, png, "DSpark PD vs aggregated, vllm bench serve, all engines on one GPU"
    )


def _finish(fig, axes, cs: list[int], png: Path, title: str) -> str:
    """Concurrency on a log-2 axis in every panel, the title, the PNG written and closed."""
    import matplotlib.pyplot as plt

    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("max concurrency")
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return f"plot: {png}"


def pd_png_path(png: Path) -> Path:
    return png.with_name(png.stem + "_pd" + png.suffix)


def _f(v, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def transport_lines(runs: list[dict]) -> list[str]:
    out = []
    for run in runs:
        for name, srv in sorted((run.get("servers") or {}).items()):
            t = srv.get("transport")
            if not t:
                continue
            comms = ", ".join(f"{a} ranks on {b} nodes" for a, b in t.get("nccl_comms", []))
            out.append(
                f"* `{name}` ({run['_file']}): NCCL communicators: {comms or 'none logged'}; "
                f"socket transport (`NET/Socket`): {'yes' if t.get('nccl_socket') else 'no'}; "
                f"DSpark exchange over: {', '.join(t.get('exchange_backends') or []) or '-'}"
            )
    return out


def markdown(runs: list[dict], files: list[str]) -> str:
    merged = merge(runs)
    rows = table_rows(merged)
    metas = [r.get("meta", {}) for r in runs]
    cs = sorted({c for m in metas for c in m.get("concurrency", [])} or {k[2] for k in rows})
    als = sorted({a for m in metas for a in m.get("acceptance_lengths", [])})
    pp_runs = any(k[0] not in PD_CONFIGS for k in rows)  # the PP sections only when PP rows exist
    lines = [
        "<!-- generated by benchmarks/plot_pp_one_gpu.py from the JSON files below; "
        "do not edit by hand -->",
        "# Served curves at PP=1 and PP=2 on one GPU (issue 29)"
        if pp_runs
        else "# PD vs aggregated, served, on one GPU (issue 29)",
        "",
        f"Source: {', '.join(f'[{f}]({f})' for f in files)}.",
        "",
        "Runs:",
        "",
    ]
    for run, m in zip(runs, metas, strict=True):
        v = m.get("versions", {})
        lines.append(
            f"* {run['_file']}: {m.get('date', '?')}, {v.get('gpu', m.get('platform', '?'))}, "
            f"vLLM {v.get('vllm', '?')}, torch {v.get('torch', '?')}; `{m.get('command', '?')}`; "
            f"shape {m.get('shape', '?')}, {m.get('input_len')} in / {m.get('output_len')} out, "
            f"servers started {m.get('start', '?')}, layout {m.get('gpu_layout', '?')}"
            + (f"; only its points of {run['_only']} are used here" if run.get("_only") else "")
        )
    skipped = [s for run in runs for s in run.get("skipped", [])]
    if skipped:
        lines += ["", f"Points not measured ({len(skipped)}):", ""]
        lines += [
            f"* {label(s['config'], s.get('acceptance_length'))} C={s['concurrency']}: {s['why']}"
            for s in skipped
        ]
    tl = transport_lines(runs)
    if tl:
        lines += ["", "Transport of the PP=2 deployments (from the launchers' logs):", ""] + tl
    lines += ["", "## Served results", "", CAVEAT if pp_runs else PD_NOTE, ""]
    head = [t for _, t, _ in METRICS]
    lines.append("| configuration | C | " + " | ".join(head) + " | measured AL | prompts | "
                 "repeats | tok/s spread |")  # fmt: skip
    lines.append("|---|---:|" + "---:|" * (len(head) + 4))
    for (config, al, c), r in sorted(
        rows.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0, kv[0][2])
    ):
        vals = " | ".join(_f(r[name], fmt) for name, _, fmt in METRICS)
        lines.append(
            f"| {label(config, al)} | {c} | {vals} | {_f(r['measured_al'], '{:.2f}')} | "
            f"{'/'.join(map(str, r['prompts']))} | {r['n']} | {_f(r['spread_pct'], '{:.1f}%')} |"
        )
    if pp_runs:
        lines += goal_b_section(rows, cs, als)
    lines += pd_markdown(rows, merged)
    lines += adaptive_markdown(rows, merged)
    return "\n".join(lines + pp_tail(rows, merged, pp_runs)) + "\n"


def goal_b_section(rows: dict, cs: list[int], als: list[float]) -> list[str]:
    lines: list[str] = []
    ratios = speedup_ratios(rows)
    g = goal_b(ratios, cs, als)
    lines += ["", "## DSpark / no-spec at PP=2 vs at PP=1 (goal b)", "", CAVEAT, ""]
    lines += ["| AL | C | PP=1 DSpark/no-spec | PP=2 DSpark/no-spec | PP=2 / PP=1 |",
              "|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in ratios:
        lines.append(
            f"| {r['al']:g} | {r['c']} | {_f(r['pp1'], '{:.2f}x')} | {_f(r['pp2'], '{:.2f}x')} | "
            f"{_f(r['pp2_over_pp1'], '{:.3f}')} |"
        )
    verdict = (
        f"**Goal (b)** (PP=2's DSpark/no-spec ratio at least {GOAL_B}x PP=1's at every "
        f"concurrency): **{g['verdict']}**"
    )
    if g["min"] is not None:
        verdict += f"; lowest PP=2 / PP=1 {g['min']:.3f} over {g['measured']} points"
    if g["below"]:
        verdict += "; below: " + ", ".join(f"AL {a:g} C={c} ({v:.3f})" for a, c, v in g["below"])
    if g["missing"]:
        verdict += "; not measured: " + ", ".join(f"AL {a:g} C={c}" for a, c in g["missing"])
    lines += ["", verdict + "."]
    return lines


def pp_tail(rows: dict, merged: dict, pp_runs: bool = True) -> list[str]:
    """Equal work, per-step times, plugin on / off (each only where its rows exist)."""
    lines: list[str] = []
    ew = equal_work_ratios(rows)
    if ew:
        lines += ["", "## PP=2 / PP=1 at equal work", "", CAVEAT, ""]
        lines += ["| work | C | output tok/s PP=2 / PP=1 | TPOT p50 PP=2 / PP=1 |",
                  "|---|---:|---:|---:|"]  # fmt: skip
        lines += [
            f"| {r['what']} | {r['c']} | {_f(r['tps'], '{:.3f}')} | {_f(r['tpot'], '{:.3f}')} |"
            for r in ew
        ]
    st = step_rows(merged)
    if st:
        lines += ["", "## Per-step GPU time per PP rank (`--step-times`)", ""]
        lines += [CAVEAT, ""] if pp_runs else []
        lines += [
            "Medians over the decode steps of the most frequent batch size, first timed repeat "
            "(benchmarks/dspark_bench_hooks.py: target = `execute_model` entry to "
            "`sample_tokens` entry, draft = the speculator's `propose`, step = `execute_model` "
            "entry to `sample_tokens` exit, GPU-stream time). The last rank's draft share is the "
            "bubble the other stage waits on.",
            "",
            "| configuration | C | rank | batch | target ms | draft ms | step ms | draft share |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in st:
            lines.append(
                f"| {r['what']} | {r['c']} | {r['rank']} | {r['batch']} | "
                f"{_f(r['target_ms'], '{:.3f}')} | {_f(r['draft_ms'], '{:.3f}')} | "
                f"{_f(r['step_ms'], '{:.3f}')} | {_f(r['draft_share'], '{:.1%}')} |"
            )
    lines += exchange_section(merged)
    pr = plugin_ratios(rows, merged)
    if pr:
        lines += ["", "## Plugin on / off at PP=2 (off: stock vLLM 0.34.0, plugin left out)", ""]
        lines += [
            "On / off of the medians over every repeat, and within the run that measured both "
            "(same start, same GPU state; `-` where no run holds both points).",
            "",
            "| work | C | output tok/s on / off (medians) | on / off, same run | "
            "repeats on / off |",
            "|---|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['what']} | {r['c']} | {_f(r['tps'], '{:.3f}')} | "
            f"{_f(r['same_run'], '{:.3f}')} | {r['repeats'][0]} / {r['repeats'][1]} |"
            for r in pr
        ]
    return lines


def plot(runs: list[dict], png: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: matplotlib not importable ({e})"
    rows = table_rows(merge(runs))
    series: dict[str, list[tuple[int, dict]]] = {}
    for (config, al, c), r in sorted(rows.items(), key=lambda kv: kv[0][2]):
        if config in PD_CONFIGS:  # their own figure (plot_pd)
            continue
        series.setdefault(label(config, al), []).append((c, r))
    # one colour per work (no-spec, DSpark at each AL), one line style per deployment
    works = sorted({lab.split("_", 1)[1] for lab in series})
    colour = {w: f"C{i % 10}" for i, w in enumerate(works)}
    dash = {"pp1": "-", "pp2": "--"}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (name, title, _) in zip(axes.flat, METRICS, strict=False):
        for lab, pts in sorted(series.items()):
            ys = [(c, r[name]) for c, r in pts if r[name] is not None]
            if ys:
                pp, work = lab.split("_", 1)
                ax.plot([c for c, _ in ys], [y for _, y in ys], dash.get(pp, ":"), marker="o",
                        color=colour[work], label=lab)  # fmt: skip
        ax.set_title(title)
    ax = axes.flat[5]
    for r_pp in ("pp1", "pp2"):
        ratios = speedup_ratios(rows)
        for al in sorted({r["al"] for r in ratios}):
            ys = [(r["c"], r[r_pp]) for r in ratios if r["al"] == al and r[r_pp] is not None]
            if ys:
                ax.plot([c for c, _ in ys], [y for _, y in ys], "--" if r_pp == "pp2" else "-",
                        marker="o", label=f"{r_pp.upper()} AL {al:g}")  # fmt: skip
    ax.set_title("DSpark / no-spec output tok/s")
    cs = sorted({c for pts in series.values() for c, _ in pts})
    title = "vllm bench serve, one GPU (PP=2: both stages share it; read ratios only)"
    return _finish(fig, axes, cs, png, title)


def copy_results(paths: list[str], dest: Path) -> list[str]:
    """Copy the JSON files into ``dest`` (same names); returns the names."""
    dest.mkdir(parents=True, exist_ok=True)
    names = []
    for p in paths:
        src = Path(p)
        if src.resolve() != (dest / src.name).resolve():
            shutil.copyfile(src, dest / src.name)
        names.append(src.name)
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--md", type=Path, default=None)
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--copy-to", type=Path, default=None)
    ap.add_argument("--only", action="append", default=[], metavar="FILE=CONFIG[@AL],...")
    a = ap.parse_args(argv)
    runs = keep_only(load(a.results), parse_only(a.only))
    if not any(r.get("points") for r in runs):
        print("no measured points in", ", ".join(a.results))
        return 1
    files = copy_results(a.results, a.copy_to) if a.copy_to else [r["_file"] for r in runs]
    md = markdown(runs, files)
    if a.png:
        pd_png = a.png  # a PD-only run: its figure is the PNG asked for
        if any(k[0] not in PD_CONFIGS for k in merge(runs)):
            print(plot(runs, a.png))
            md += f"\n![served curves]({a.png.name})\n"
            pd_png = pd_png_path(a.png)
        done = plot_pd(runs, pd_png)
        if done and pd_png.exists():
            print(done)
            md += f"\n![PD vs aggregated]({pd_png.name})\n"
    if a.md:
        a.md.parent.mkdir(parents=True, exist_ok=True)
        a.md.write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
