#!/usr/bin/env python3
"""PP=2 projection for DSpark from one-GPU measurements (docs/performance-bound.md's numbers).

    python3 benchmarks/pp_projection.py OUT/perf_qwen3-8b.json \\
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
        from exchange_gloo import markdown as gloo_md

        lines += [
            "",
            f"Exchange over gloo (CPU, {gloo.get('date_utc')} UTC, "
            f"{gloo.get('iters')} steps each):",
            "",
            gloo_md(gloo["rows"]),
        ]
    return "\n".join(lines)


def main(argv=None) -> int:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
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
    a = ap.parse_args(argv)
    from perf_real_shapes import merge_results

    res = merge_results([json.loads(Path(x).read_text()) for x in a.result])
    p = project(res, a.link_gbps, a.bcast_us)
    gloo = json.loads(a.gloo.read_text()) if a.gloo and a.gloo.exists() else None
    md = markdown(p, gloo)
    if a.md:
        a.md.write_text(md + "\n")
    if a.json:
        a.json.write_text(json.dumps(p, indent=1) + "\n")
    if a.fill:
        from plot_perf import fill_between

        fill_between(a.fill, "PROJECTION", md)
    print(md)
    return 0 if p["rows"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
