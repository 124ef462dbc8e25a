#!/usr/bin/env python3
"""PP=2 projection for DSpark from one-GPU measurements (docs/performance-bound.md's numbers).

    python3 -m benchmarks.pp_projection OUT/perf_qwen3-8b.json \\
        [--gloo docs/results/exchange_gloo.json] [--md docs/results/pp_projection.md]

Inputs, all measured by benchmarks/perf_real_shapes.py at PP=1 (plugin on) and
benchmarks/exchange_gloo.py:

* ``t_target(C)``: GPU time per decode step from ``execute_model`` entry to ``sample_tokens``
  entry (input preparation + the target's forward over C(1+k) tokens); per layer:
  ``t_target / L``.
* ``t_draft(C)``: the speculator's ``propose`` (context KV + query pass + Markov sampling).
* ``t_rest(C)``: the rest of the step (sampling / rejection, bookkeeping) = step - target - draft.
* ``tau``: tokens per request per step = the measured mean acceptance length.

Model (one decode batch in flight, i.e. vLLM's PP schedule for a single request wave; layers
split evenly, stage s holds L/2 layers, draft and sampling on the last stage):

    T_pp1(C)  = t_target + t_rest + t_draft                                      (measured step)
    T_pp2(C)  = t_target/2 + t_x + t_target/2 + t_rest + t_draft + t_tok
    bubble    = stage 0 idles while the last stage samples and drafts: t_rest + t_draft + t_tok
    tok/s     = C * tau / T

``t_x`` is the stage-0 -> stage-1 activation send (hidden + residual + the aux taps stage 0
produces, bf16, at NVLink ``--link-gbps``), ``t_tok`` the token broadcast (bytes from
vllm_dspark_pp.protocol.schedule, latency ``--bcast-us`` per broadcast). PP=2 on 2x the memory also
holds ~2x the KV cache, so it can run the doubled batch: with two waves in flight (two batches of
C each, vLLM's ``max_num_seqs`` x pipeline depth) the per-wave step is
``max(t_target/2 + t_x, t_target/2 + t_rest + t_draft + t_tok)`` and the aggregate throughput is
``2 C tau / (2 max(...))`` = ``C tau / max(...)`` per wave pair. The overtaking concurrency is
the smallest C where PP=2 (two waves of C) beats PP=1 serving 2C (measured, or interpolated in
log2 C between measured points; never extrapolated past the largest measured C).
This is a projection, labelled as such in the docs; the several-GPU run checks it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BF16 = 2
GOAL_B = 0.9  # issue 29 goal (b): PP=2's DSpark/no-spec ratio >= 0.9x PP=1's


#: NCCL point-to-point on one GPU through two launchers (socket transport over loopback), measured
#: 2026-12-03 (issue 25): (bytes, ms) per message.
NCCL_P2P_ONE_GPU = ((4 * 1024, 0.04), (512 * 1024, 0.26), (4 * 1024 * 1024, 1.5))
GOAL_E_SHARE = 0.03  # issue 29 goal (e): the exchange under 3% of a decode step at C >= 8
GOAL_E_MIN_C = 8


def nccl_p2p_ms(nbytes: float, points=NCCL_P2P_ONE_GPU) -> float:
    """Estimated time of one message of ``nbytes``: linear in the bytes between the two
    measured neighbours (latency + bytes / bandwidth of that segment), the smallest point's
    time below it, the last segment's line above the largest (bandwidth-bound there)."""
    if nbytes <= points[0][0]:
        return points[0][1]
    for (b0, t0), (b1, t1) in zip(points, points[1:], strict=False):
        if nbytes <= b1:
            return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = points[-2], points[-1]
    return t1 + (t1 - t0) * (nbytes - b1) / (b1 - b0)


def exchange_estimate(c: int, k: int, hidden: int, taps0: int, micro: int = 1) -> dict:
    """Bytes and estimated NCCL time of the exchange per request step at PP=2 (all C requests
    advanced once): ``micro`` engine steps of C / micro requests each; per engine step the
    stage-0 send of hidden + residual + the relayed taps (one message per key, C / micro
    (1 + k) rows, bf16) and the three token broadcasts (this plugin's payloads)."""
    per = max(1, round(c / micro))
    act_msg = per * (1 + k) * hidden * BF16
    tok = token_exchange_bytes(per, k)["ours"]
    from vllm_dspark_pp.protocol.schedule import counts_row_len

    tok_msgs = (per * (k + 1) * 8, 2 * counts_row_len(per) * 4, per * k * 8)
    ms = micro * ((2 + taps0) * nccl_p2p_ms(act_msg) + sum(nccl_p2p_ms(b) for b in tok_msgs))
    return {
        "micro": micro,
        "act_bytes": micro * (2 + taps0) * act_msg,
        "tok_bytes": micro * tok,
        "est_ms": ms,
    }


def pp2_stage0_taps(target_layer_ids: list[int], num_layers: int) -> int:
    """Aux taps stage 0 produces and relays (tap id L+1 is made after layer L; stage 0 holds
    layers [0, ceil(L/2)) in vLLM's even split)."""
    half = -(-num_layers // 2)
    return sum(1 for t in target_layer_ids if t < half)


def token_exchange_bytes(n: int, k: int) -> dict:
    """Bytes of the last stage's token broadcasts per step, stock vs ours (k drafts)."""
    from vllm_dspark_pp.protocol.schedule import counts_row_len

    stock = n * (k + 1) * 8 + 2 * n * 4 + n * k * 8
    ours = n * (k + 1) * 8 + 2 * counts_row_len(n) * 4 + n * k * 8
    return {"stock": stock, "ours": ours}


def pp1_at(rows_by_c: dict, c: int) -> float | None:
    """PP=1 (model) tok/s at concurrency ``c``: measured, or interpolated in log2(C) between
    the two measured neighbours; None outside the measured range (no extrapolation)."""
    import math

    if c in rows_by_c:
        return rows_by_c[c]["pp1_tok_s_model"]
    lo = max((x for x in rows_by_c if x < c), default=None)
    hi = min((x for x in rows_by_c if x > c), default=None)
    if lo is None or hi is None:
        return None
    w = (math.log2(c) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return (1 - w) * rows_by_c[lo]["pp1_tok_s_model"] + w * rows_by_c[hi]["pp1_tok_s_model"]


def project(res: dict, link_gbps: float = 300.0, bcast_us: float = 20.0) -> dict:
    shape = res.get("shape_config")
    shape = shape if isinstance(shape, dict) else {}
    k = int(res.get("k", 7))
    num_layers = int(shape.get("num_layers", 36))
    hidden = int(shape.get("hidden_size", 4096))
    taps = list(shape.get("target_layer_ids", (1, 9, 17, 25, 33)))
    n_taps0 = pp2_stage0_taps(taps, num_layers)
    rows_pp1 = {
        (r["acceptance_length"], r["concurrency"]): r
        for r in res["rows"]
        if r["engine"] == "dspark" and r["plugin"] == "on"
    }
    out_rows = []
    for (al, c), r in sorted(rows_pp1.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1])):
        if r.get("target_ms") is None or r.get("step_ms") is None:
            continue
        t_target = r["target_ms"]
        t_draft = r.get("draft_ms") or 0.0
        t_rest = max(r["step_ms"] - t_target - t_draft, 0.0)
        tau = r.get("measured_acceptance_length") or al
        tokens = c * (1 + k)
        act_bytes = tokens * hidden * BF16 * (2 + n_taps0)  # hidden + residual + taps
        t_x = act_bytes / (link_gbps * 1e9) * 1e3 + bcast_us / 1e3
        tb = token_exchange_bytes(c, k)
        t_tok = 3 * bcast_us / 1e3 + tb["ours"] / (link_gbps * 1e9) * 1e3
        t_pp1 = t_target + t_rest + t_draft
        t_pp2 = t_target + t_x + t_rest + t_draft + t_tok
        bubble = t_rest + t_draft + t_tok
        two_wave = max(t_target / 2 + t_x, t_target / 2 + t_rest + t_draft + t_tok)
        out_rows.append(
            {
                "acceptance_length": al,
                "concurrency": c,
                "tau": tau,
                "target_ms": t_target,
                "target_ms_per_layer": t_target / num_layers,
                "draft_ms": t_draft,
                "rest_ms": t_rest,
                "t_x_ms": t_x,
                "t_tok_ms": t_tok,
                "activation_bytes": act_bytes,
                "token_bytes_stock": tb["stock"],
                "token_bytes_ours": tb["ours"],
                "pp1_tok_s_model": c * tau / t_pp1 * 1e3,
                "pp1_tok_s_measured": r.get("output_tok_s"),
                "pp2_one_wave_tok_s": c * tau / t_pp2 * 1e3,
                "pp2_two_waves_tok_s": 2 * c * tau / (2 * two_wave) * 1e3,
                "bubble_ms": bubble,
                "bubble_share_one_wave": bubble / t_pp2,
            }
        )
    # where PP=2 (two waves of C on 2x memory) overtakes PP=1 serving the same 2C requests
    overtake = {}
    for al in sorted({r["acceptance_length"] for r in out_rows}, key=lambda x: x or 0):
        rs = {r["concurrency"]: r for r in out_rows if r["acceptance_length"] == al}
        found = None
        for c in sorted(rs):
            ref = pp1_at(rs, 2 * c)
            if ref is not None and rs[c]["pp2_two_waves_tok_s"] > ref:
                found = c
                break
        overtake[str(al)] = found
    # no speculation: the same model with k=0, tau=1, no draft, no aux taps relayed, one token
    # per request broadcast; only from measured no-spec rows (never derived from DSpark rows)
    nospec_rows = []
    for r in sorted(
        (r for r in res["rows"] if r["engine"] == "nospec"), key=lambda r: r["concurrency"]
    ):
        if r.get("target_ms") is None or r.get("step_ms") is None:
            continue
        c, t_target = r["concurrency"], r["target_ms"]
        t_rest = max(r["step_ms"] - t_target, 0.0)
        t_x = c * hidden * BF16 * 2 / (link_gbps * 1e9) * 1e3 + bcast_us / 1e3
        t_tok = bcast_us / 1e3 + c * 8 / (link_gbps * 1e9) * 1e3
        two_wave = max(t_target / 2 + t_x, t_target / 2 + t_rest + t_tok)
        nospec_rows.append(
            {
                "concurrency": c,
                "target_ms": t_target,
                "rest_ms": t_rest,
                "pp1_tok_s_model": c / (t_target + t_rest) * 1e3,
                "pp1_tok_s_measured": r.get("output_tok_s"),
                "pp2_one_wave_tok_s": c / (t_target + t_x + t_rest + t_tok) * 1e3,
                "pp2_two_waves_tok_s": c / two_wave * 1e3,
            }
        )
    return {
        "shape": res.get("shape"),
        "k": k,
        "num_layers": num_layers,
        "hidden_size": hidden,
        "stage0_taps": n_taps0,
        "link_gbps": link_gbps,
        "bcast_us": bcast_us,
        "rows": out_rows,
        "overtake_concurrency": overtake,
        "nospec_rows": nospec_rows,
    }


def markdown(p: dict, gloo: dict | None = None) -> str:
    lines = [
        f"Projection for {p['shape']} (k={p['k']}, {p['num_layers']} layers, stage 0 relays "
        f"{p['stage0_taps']} aux taps; link {p['link_gbps']:g} GB/s, {p['bcast_us']:g} us per "
        "broadcast):",
        "",
        "| AL | C | target ms (per layer) | draft ms | rest ms | exchange ms (act + tok) | "
        "PP=1 tok/s (model / measured) | PP=2 1 wave tok/s | PP=2 2 waves tok/s | "
        "last-stage bubble ms (share) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in p["rows"]:
        meas = r["pp1_tok_s_measured"]
        lines.append(
            f"| {r['acceptance_length']:g} | {r['concurrency']} | {r['target_ms']:.2f} "
            f"({r['target_ms_per_layer'] * 1e3:.0f} us) | {r['draft_ms']:.2f} | "
            f"{r['rest_ms']:.2f} | {r['t_x_ms']:.3f} + {r['t_tok_ms']:.3f} | "
            f"{r['pp1_tok_s_model']:.0f} / {meas if meas is None else round(meas)} | "
            f"{r['pp2_one_wave_tok_s']:.0f} | {r['pp2_two_waves_tok_s']:.0f} | "
            f"{r['bubble_ms']:.2f} ({100 * r['bubble_share_one_wave']:.0f}%) |"
        )
    lines += [
        "",
        "PP=2 (two waves on 2x memory) overtakes PP=1 at: "
        + ", ".join(
            f"AL {al}: C={c if c is not None else 'not within the measured range'}"
            for al, c in p["overtake_concurrency"].items()
        ),
    ]
    ns = {r["concurrency"]: r for r in p.get("nospec_rows") or []}
    if not ns:
        lines += [
            "",
            "No speculation at PP=2, and DSpark's speedup over it at PP=2: cannot be "
            "computed yet: this result has no measured no-speculation rows (run "
            "`perf_real_shapes.py --phases nospec`); nothing here is derived from them.",
        ]
    else:
        lines += [
            "",
            "No speculation (measured PP=1 rows, same model with k=0) and DSpark's "
            "PP=2 two-wave speedup over it:",
            "",
            "| C | PP=1 tok/s (model / measured) | PP=2 1 wave | PP=2 2 waves | "
            "DSpark/no-spec PP=2 2 waves (per AL) |",
            "|---:|---:|---:|---:|---|",
        ]
        for c, n in sorted(ns.items()):
            sp = ", ".join(
                f"AL {r['acceptance_length']:g}: "
                f"{r['pp2_two_waves_tok_s'] / n['pp2_two_waves_tok_s']:.2f}x"
                for r in p["rows"]
                if r["concurrency"] == c
            )
            meas = n["pp1_tok_s_measured"]
            lines.append(
                f"| {c} | {n['pp1_tok_s_model']:.0f} / "
                f"{meas if meas is None else round(meas)} | "
                f"{n['pp2_one_wave_tok_s']:.0f} | {n['pp2_two_waves_tok_s']:.0f} | "
                f"{sp or '-'} |"
            )
    lines += [
        "",
        "Token exchange bytes per step (k=7): "
        + ", ".join(
            f"N={n}: stock {token_exchange_bytes(n, p['k'])['stock']} B, ours "
            f"{token_exchange_bytes(n, p['k'])['ours']} B"
            for n in (1, 4, 16, 32, 64)
        ),
    ]
    if gloo:
        from benchmarks.exchange_gloo import markdown as gloo_md

        lines += [
            "",
            f"Exchange over gloo (CPU, {gloo.get('date_utc')} UTC, "
            f"{gloo.get('iters')} steps each):",
            "",
            gloo_md(gloo["rows"]),
        ]
    return "\n".join(lines)


def _served_plot():
    """benchmarks/plot_pp_one_gpu.py (the served tables' reader), imported when first needed."""
    from benchmarks import plot_pp_one_gpu

    return plot_pp_one_gpu


def served_comparison(p: dict, served_paths: list) -> dict:
    """The projection ``p`` beside the MEASURED served PP=1 / PP=2 runs of
    benchmarks/serve_pp_one_gpu.py (one GPU, both stages on it, NCCL over loopback sockets).

    Per (AL, C): DSpark / no-spec at PP=1 and at PP=2 and their quotient (goal b), projected
    (one batch in flight and two) and measured; PP=2 / PP=1 at equal work, projected (one wave)
    and measured; the time a PP=2 step adds per request over PP=1 (measured TPOT x tokens per
    step, PP=2 minus PP=1) beside the projected exchange (activation send + token broadcasts);
    the last stage's draft time and its share of that stage's step at PP=1 and at PP=2
    (``--step-times``), beside the projected bubble share."""
    plot = _served_plot()
    runs = plot.load(served_paths)
    merged = plot.merge(runs)
    rows = plot.table_rows(merged)
    measured = {(r["al"], r["c"]): r for r in plot.speedup_ratios(rows)}
    steps = {(r["what"], r["c"], r["rank"]): r for r in plot.step_rows(merged)}
    nospec = {r["concurrency"]: r for r in p.get("nospec_rows") or []}
    out = []
    for r in p["rows"]:
        al, c = r["acceptance_length"], r["concurrency"]
        n = nospec.get(c)
        m = measured.get((al, c))
        if n is None or m is None:
            continue

        def q(a, b):
            return None if a is None or b is None or b == 0 else a / b

        proj_pp1 = q(r["pp1_tok_s_model"], n["pp1_tok_s_model"])
        proj_1w = q(r["pp2_one_wave_tok_s"], n["pp2_one_wave_tok_s"])
        proj_2w = q(r["pp2_two_waves_tok_s"], n["pp2_two_waves_tok_s"])
        d1, d2 = rows.get(("pp1_dspark", al, c)), rows.get(("pp2_dspark", al, c))
        n1, n2 = rows.get(("pp1_nospec", None, c)), rows.get(("pp2_nospec", None, c))
        tau = (d2 or {}).get("measured_al") or al

        def added_ms(two, one, per_step):
            if not two or not one or two.get("p50_tpot_ms") is None:
                return None
            return (two["p50_tpot_ms"] - one["p50_tpot_ms"]) * per_step

        s1 = steps.get((f"pp1_dspark AL {al:g}", c, 0)) or {}
        s2 = steps.get((f"pp2_dspark AL {al:g}", c, 1)) or {}
        added_d, added_n = added_ms(d2, d1, tau), added_ms(n2, n1, 1.0)
        # PP=2 runs the C requests as micro-batches of s2["batch"]: the last stage drafts once
        # per micro-batch, so once per request step at PP=1 becomes `micro` times at PP=2
        micro = max(1, round(c / s2["batch"])) if s2.get("batch") else None
        extra_draft = (
            micro * s2["draft_ms"] - s1["draft_ms"]
            if micro and s1.get("draft_ms") is not None and s2.get("draft_ms") is not None
            else None
        )
        dspark_only = None if added_d is None or added_n is None else added_d - added_n
        rest = None if dspark_only is None or extra_draft is None else dspark_only - extra_draft
        # what DSpark sends stage 0 -> 1 beyond no-spec: C (1 + k) tokens with the relayed taps
        # instead of C tokens, hidden + residual each
        hidden = p.get("hidden_size", 4096)
        more_bytes = r["activation_bytes"] - c * hidden * BF16 * 2
        out.append(
            {
                "al": al,
                "c": c,
                "proj_pp1": proj_pp1,
                "proj_pp2_one_wave": proj_1w,
                "proj_pp2_two_waves": proj_2w,
                "proj_quot_one_wave": q(proj_1w, proj_pp1),
                "proj_quot_two_waves": q(proj_2w, proj_pp1),
                "meas_pp1": m["pp1"],
                "meas_pp2": m["pp2"],
                "meas_quot": m["pp2_over_pp1"],
                "proj_equal_work_dspark": q(r["pp2_one_wave_tok_s"], r["pp1_tok_s_model"]),
                "meas_equal_work_dspark": q(
                    (d2 or {}).get("output_throughput"), (d1 or {}).get("output_throughput")
                ),
                "meas_equal_work_nospec": q(
                    (n2 or {}).get("output_throughput"), (n1 or {}).get("output_throughput")
                ),
                "proj_exchange_ms": r["t_x_ms"] + r["t_tok_ms"],
                "meas_added_ms_dspark": added_d,
                "meas_added_ms_nospec": added_n,
                "dspark_only_added_ms": dspark_only,
                "micro_batches": micro,
                "extra_draft_ms": extra_draft,
                "rest_ms": rest,
                "more_bytes": more_bytes,
                "implied_gbps": more_bytes / (rest * 1e6) if rest and rest > 0 else None,
                "draft_ms_pp1": s1.get("draft_ms"),
                "draft_ms_pp2_last": s2.get("draft_ms"),
                "draft_share_pp1": s1.get("draft_share"),
                "draft_share_pp2_last": s2.get("draft_share"),
                "pp2_batch_per_step": s2.get("batch"),
                "proj_bubble_share": r["bubble_share_one_wave"],
                **_goal_e_fields(p, r, c, micro, d2, tau, added_d),
            }
        )
    return {
        "rows": out,
        "files": [run["_file"] for run in runs],
        "transport": plot.transport_lines(runs),
    }


def _goal_e_fields(p: dict, r: dict, c: int, micro, d2, tau, added_d) -> dict:
    """Goal (e) from what exists: the exchange's bytes per request step (exact, from the
    shape), their estimated NCCL time (nccl_p2p_ms) and, as an upper bound, the measured time a
    PP=2 request step adds over PP=1; each as a share of the measured PP=2 request step (p50
    TPOT x tokens per request per step)."""
    est = exchange_estimate(c, p.get("k", 7), p.get("hidden_size", 4096), p.get("stage0_taps", 0),
                            micro or 1)  # fmt: skip
    tpot = (d2 or {}).get("p50_tpot_ms")
    step = tpot * tau if tpot is not None else None
    return {
        "x_act_bytes": est["act_bytes"],
        "x_tok_bytes": est["tok_bytes"],
        "x_est_ms": est["est_ms"],
        "pp2_request_step_ms": step,
        "x_est_share": est["est_ms"] / step if step else None,
        "x_upper_share": added_d / step if step and added_d is not None else None,
    }


def goal_e_markdown(rows: list[dict]) -> list[str]:
    """Goal (e) stated from the recorded JSON: estimated (bytes x the one-GPU NCCL costs) and
    the measured upper bound; never a measurement of the exchange itself."""
    rows = [r for r in rows if r.get("x_est_share") is not None]
    if not rows:
        return []

    def f(v, fmt):
        return "-" if v is None else fmt.format(v)

    p2p = ", ".join(f"{b // 1024} KiB {t:g} ms" for b, t in NCCL_P2P_ONE_GPU)
    lines = [
        "",
        "**Goal (e) from what exists (ESTIMATED, not measured).** The exchange per request step "
        "at PP=2 (every request advanced once: micro-batches x (stage 0's send of hidden, "
        "residual and the relayed taps, one NCCL message per key, bf16 rows of C / micro x "
        "(1 + k) tokens, plus the three token broadcasts)): bytes exact from the shape; time "
        f"*estimated* by pricing each message at the one-GPU NCCL point-to-point costs measured "
        f"on 2026-12-03 ({p2p}; linear in the bytes between neighbouring points, the smallest "
        "point's time below it, the last segment's line above it). *upper bound* = the "
        "measured time a PP=2 request step adds over PP=1 (DSpark's *added* above: it also "
        "holds the second draft and the shared GPU's scheduling). Shares are of the measured "
        "PP=2 request step (p50 TPOT x tokens per request per step). The rows are padded to "
        "the CUDA-graph size in vLLM; not counted here.",
        "",
        "| AL | C | act MB | tok KB | est. exchange ms | PP=2 request step ms | est. share | "
        "upper-bound share |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['al']:g} | {r['c']} | {r['x_act_bytes'] / 1e6:.2f} | "
            f"{r['x_tok_bytes'] / 1e3:.2f} | {r['x_est_ms']:.2f} | "
            f"{f(r['pp2_request_step_ms'], '{:.1f}')} | {r['x_est_share']:.1%} | "
            f"{f(r['x_upper_share'], '{:.0%}')} |"
        )
    big = [r for r in rows if r["c"] >= GOAL_E_MIN_C]
    est_miss = [r for r in big if r["x_est_share"] >= GOAL_E_SHARE]
    up_ok = [r for r in big if (r["x_upper_share"] or 1.0) < GOAL_E_SHARE]
    verdict = "met" if big and not est_miss else ("missed" if big else "no point at C >= 8")
    lines += [
        "",
        f"Goal (e) (exchange under {GOAL_E_SHARE:.0%} of a decode step at C >= {GOAL_E_MIN_C}) "
        f"on this tier, ESTIMATED: **{verdict}**"
        + (
            " at "
            + ", ".join(
                f"AL {r['al']:g} C={r['c']} ({r['x_est_share']:.1%})" for r in est_miss
            )  # fmt: skip
            if est_miss
            else ""
        )
        + f"; the measured upper bound shows it at {len(up_ok)} of {len(big)} points "
        "(the exchange itself is measured by the `--step-times` exchange records: "
        'docs/results/perf_pp_one_gpu.md, "The exchange per step").',
    ]
    return lines


def served_markdown(cmp: dict) -> str:
    """The comparison as markdown; every number computed from the JSON."""
    rows = cmp["rows"]
    if not rows:
        return "No (AL, C) is both projected and measured at PP=1 and PP=2 in these files."

    def f(v, fmt):
        return "-" if v is None else fmt.format(v)

    lines = [
        f"Measured: {', '.join(cmp['files'])} (benchmarks/serve_pp_one_gpu.py, `vllm bench "
        "serve`, both PP stages on one H200). Projected: the block above.",
        "",
        *cmp["transport"],
        "",
        "| AL | C | DSpark/no-spec PP=1 proj / meas | PP=2 proj 1 wave / 2 waves / meas | "
        "PP=2 / PP=1 proj 1 wave / 2 waves / **meas** |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['al']:g} | {r['c']} | {f(r['proj_pp1'], '{:.2f}x')} / "
            f"{f(r['meas_pp1'], '{:.2f}x')} | {f(r['proj_pp2_one_wave'], '{:.2f}x')} / "
            f"{f(r['proj_pp2_two_waves'], '{:.2f}x')} / {f(r['meas_pp2'], '{:.2f}x')} | "
            f"{f(r['proj_quot_one_wave'], '{:.3f}')} / {f(r['proj_quot_two_waves'], '{:.3f}')} "
            f"/ **{f(r['meas_quot'], '{:.3f}')}** |"
        )
    lines += [
        "",
        "Where the model and the measurement part. *added* = (TPOT at PP=2 - TPOT at PP=1) "
        "x tokens per request per step: what a PP=2 step costs a request beyond the PP=1 step "
        "(projected: the exchange alone). *DSpark - no-spec* splits DSpark's extra over "
        "no-spec's into *drafting* (the last stage drafts once per micro-batch: micro-batches "
        "x its PP=2 draft ms - the PP=1 draft ms, GPU-stream times from `--step-times`) and "
        "the *rest*; *more MB* = what DSpark sends stage 0 -> 1 per step beyond no-spec "
        "(C (1 + k) tokens with the relayed taps instead of C tokens), *GB/s* = more MB / "
        "rest, the bandwidth that would explain the rest.",
        "",
        "| AL | C | PP=2/PP=1 tok/s DSpark proj / meas, no-spec meas | added ms DSpark meas "
        "(proj) / no-spec meas | DSpark - no-spec ms | micro-batches x draft ms PP=2 (PP=1) | "
        "drafting ms | rest ms | more MB | GB/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['al']:g} | {r['c']} | {f(r['proj_equal_work_dspark'], '{:.3f}')} / "
            f"{f(r['meas_equal_work_dspark'], '{:.3f}')}, "
            f"{f(r['meas_equal_work_nospec'], '{:.3f}')} | "
            f"{f(r['meas_added_ms_dspark'], '{:.1f}')} ({r['proj_exchange_ms']:.2f}) / "
            f"{f(r['meas_added_ms_nospec'], '{:.1f}')} | "
            f"{f(r['dspark_only_added_ms'], '{:.1f}')} | {f(r['micro_batches'], '{}')} x "
            f"{f(r['draft_ms_pp2_last'], '{:.2f}')} ({f(r['draft_ms_pp1'], '{:.2f}')}) | "
            f"{f(r['extra_draft_ms'], '{:.1f}')} | {f(r['rest_ms'], '{:.1f}')} | "
            f"{r['more_bytes'] / 1e6:.1f} | {f(r['implied_gbps'], '{:.2f}')} |"
        )
    meas = [r for r in rows if r["meas_quot"] is not None]
    low = min(meas, key=lambda r: r["meas_quot"]) if meas else None
    proj = [r["proj_quot_one_wave"] for r in rows if r["proj_quot_one_wave"] is not None]

    def rng(key):
        vals = [r[key] for r in rows if r[key] is not None]
        return "-" if not vals else f"{min(vals):.3g} to {max(vals):.3g}"

    lines += [""]
    if low is not None and proj:
        lines.append(
            f"Summary (computed): the projection put PP=2's DSpark/no-spec ratio at "
            f"{min(proj):.3f}-{max(proj):.3f}x PP=1's with one batch in flight; measured on one "
            f"GPU it is {min(r['meas_quot'] for r in meas):.3f}-"
            f"{max(r['meas_quot'] for r in meas):.3f}x, lowest at AL {low['al']:g} C={low['c']}. "
            f"PP=2 / PP=1 at equal work: projected {rng('proj_equal_work_dspark')} (DSpark), "
            f"measured {rng('meas_equal_work_dspark')} (DSpark) and "
            f"{rng('meas_equal_work_nospec')} (no-spec). Added per step: projected exchange "
            f"{rng('proj_exchange_ms')} ms, measured {rng('meas_added_ms_dspark')} ms (DSpark) "
            f"and {rng('meas_added_ms_nospec')} ms (no-spec). Last-stage draft per step: "
            f"{rng('draft_ms_pp1')} ms at PP=1, {rng('draft_ms_pp2_last')} ms at PP=2. "
            f"Bandwidth that would explain DSpark's remaining extra: {rng('implied_gbps')} GB/s."
        )
        below = [r for r in meas if r["meas_quot"] < GOAL_B]
        lines.append(
            ""
            if not below
            else "\nGoal (b) (PP=2 / PP=1 at least "
            f"{GOAL_B}) missed at: "
            + ", ".join(f"AL {r['al']:g} C={r['c']} ({r['meas_quot']:.3f})" for r in below)
            + "."
        )
    lines += goal_e_markdown(rows)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", nargs="+", help="result JSON(s) of ONE shape (merged)")
    ap.add_argument("--gloo", type=Path, default=None)
    ap.add_argument("--link-gbps", type=float, default=300.0)
    ap.add_argument("--bcast-us", type=float, default=20.0)
    ap.add_argument("--md", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--fill",
        type=Path,
        default=None,
        help="write into this file's PROJECTION block (docs/performance-bound.md)",
    )
    ap.add_argument(
        "--served", nargs="+", default=None,
        help="benchmarks/serve_pp_one_gpu.py result JSONs (PP=1 and PP=2 groups) to set "
        "beside the projection",
    )  # fmt: skip
    ap.add_argument(
        "--fill-served", type=Path, default=None,
        help="write the comparison into this file's SERVED_VS_PROJECTION block",
    )  # fmt: skip
    a = ap.parse_args(argv)
    from benchmarks.perf_real_shapes import merge_results

    res = merge_results([json.loads(Path(x).read_text()) for x in a.result])
    p = project(res, a.link_gbps, a.bcast_us)
    gloo = json.loads(a.gloo.read_text()) if a.gloo and a.gloo.exists() else None
    md = markdown(p, gloo)
    if a.md:
        a.md.write_text(md + "\n")
    if a.json:
        a.json.write_text(json.dumps(p, indent=1) + "\n")
    if a.fill:
        from benchmarks.plot_perf import fill_between

        fill_between(a.fill, "PROJECTION", md)
    print(md)
    if a.served:
        smd = served_markdown(served_comparison(p, a.served))
        if a.fill_served:
            from benchmarks.plot_perf import fill_between

            fill_between(a.fill_served, "SERVED_VS_PROJECTION", smd)
        print(smd)
    return 0 if p["rows"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
