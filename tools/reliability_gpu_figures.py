"""Print the GPU figures of docs/results/reliability.md from the recorded JSON results.

The files are the groups' own outputs, copied unchanged: ``load.json`` (group ``load``),
``pd_kill.json`` (group ``pd_kill``), ``pd_decoder_kill.json`` (group ``pd_decoder_kill``) and the
``result.json`` of ``lost_stage``, ``lost_stage_control`` and ``lost_stage_stock``, under
docs/results/reliability_gpu_*.json, and ``sampling.json`` (group ``sampling``, case 4) as
reliability_gpu_sampling.json (``pd_decoder_kill``, ``lost_stage_stock`` and ``sampling`` are
printed when their file is there). Usage:

    python3 tools/reliability_gpu_figures.py [docs/results]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(folder: Path, name: str) -> dict:
    return json.loads((folder / f"reliability_gpu_{name}.json").read_text())


def _mib(x: float) -> str:
    return f"{x:,.1f}" if x % 1 else f"{x:,.0f}"


def load_lines(d: dict) -> list[str]:
    s = d["settings"]
    out = [
        f"load: {d['date']}, {s['runs']} runs x {s['prompts']} prompts, C={s['concurrency']}, "
        f"{s['input_len']} in / {s['output_len']} out (range ratio {s['range_ratio']}), "
        f"{s['dtype']}, wall {d['wall_s']} s"
    ]
    for key in ("ours", "stock"):
        r = d[key]
        runs = r["runs"]
        out.append(
            f"  {key}: ready {r['ready_s']} s; completed "
            + " / ".join(str(x["completed"]) for x in runs)
            + "; failed "
            + " / ".join(str(x["failed"]) for x in runs)
            + "; bench duration "
            + " / ".join(f"{x['duration_s']}" for x in runs)
            + " s; output tok/s "
            + " / ".join(f"{x['output_tok_s']:,.1f}" for x in runs)
            + "; KV after "
            + " / ".join(f"{x['kv_usage_after']}" for x in runs)
            + "; running after "
            + " / ".join(f"{x['running_after']:.0f}" for x in runs)
        )
        out.append(
            f"  {key}: RSS MiB {_mib(r['rss_mib_ready'])} ready -> "
            + " / ".join(_mib(x["rss_mib_after"]) for x in runs)
            + f"; GPU MiB (its processes) {_mib(r['gpu_mib_ready'])} ready -> "
            + " / ".join(_mib(x["gpu_mib_after"]) for x in runs)
            + f"; error lines {r['error_lines']}; left running {r['left_running']}"
        )
        sp = r["spec"]
        if sp.get("num_drafts"):
            mal = 1 + sp["num_accepted_tokens"] / sp["num_drafts"]
            out.append(
                f"  {key}: drafts {sp['num_drafts']:,}, draft tokens {sp['num_draft_tokens']:,}, "
                f"accepted {sp['num_accepted_tokens']:,} (per position {sp['accepted_per_pos']}), "
                f"mean acceptance length {mal:.3f}"
            )
    rss, gpu = d["growth"]["rss"], d["growth"]["gpu"]
    out.append(
        f"  growth ours: RSS steps {rss['steps']} MiB (first run +{rss['first_run_warmup']}),"
        f" GPU steps {gpu['steps']} MiB (first run +{gpu['first_run_warmup']})"
    )
    out.append(f"  sample parity: {d['parity']['describe']} (ok={d['parity']['ok']})")
    return out


def lost_lines(name: str, d: dict) -> list[str]:
    errs = sum(1 for c in d["clients"] if c.get("error"))
    toks = [len(c.get("token_ids", [])) for c in d["clients"]]
    # the stock group's record also says whether the stage was named and which timeout ended it
    extra = (
        f"; stage named {d['named']}, timeout line {d.get('timeout_line')!r}"
        if d.get("stock")
        else ""
    )
    return [
        f"{name}: control={d['control']}, stock={d.get('stock', False)}, node 0 exit "
        f"{d['exit_s']} s after the kill, "
        f"rc {d['rc']}, all nodes gone {d['nodes_exit_s']} s, "
        f"head group left {d['head_group_left']}, "
        f"other nodes running {d['other_nodes_running']}; {errs} of {len(d['clients'])} streams "
        f"ended with an error event after {min(toks)}-{max(toks)} tokens{extra}"
    ]


def pd_lines(d: dict) -> list[str]:
    out = [f"pd_kill: {d['date']}, client bound {d['bound_s']} s, wall {d['wall_s']} s"]
    for key in ("ours", "stock"):
        r = d[key]

        def grp(g: str, r: dict = r) -> str:
            secs = sorted({x["seconds"] for x in r[g]})
            details = sorted({x.get("detail", "") for x in r[g]} - {""})
            return f"{r['tally'][g]} in {secs} s" + (f" ({'; '.join(details)})" if details else "")

        rs = r["restart"]
        out.append(
            f"  {key}: A streaming before the kill {r['a_streaming_before_kill']}, running at it "
            f"{r['a_running_at_kill']}; A {grp('A')}; B {grp('B')}; groups ended "
            f"{r['groups_ended_s']} s after the kill; plain request equal to before: "
            f"{r['plain_after'] == r['plain_ref']} in {r['plain_after_s']} s; decoder alive "
            f"{r['decoder_alive']}, /health {r['health_after']}; KV usage after "
            f"{r['kv_usage_after'] * 100:.2f} %, running {r['running_after']:.0f}; counters "
            f"{r['counters_delta']}; connector lines {len(r['decoder_connector_lines'])}, error "
            f"lines {len(r['decoder_error_lines'])}"
        )
        out.append(
            f"  {key}: restart ready {rs['ready_s']} s, new engine id {rs['engine_id_changed']}, "
            f"tokens equal to before the kill {rs['tokens_equal_before_kill']} in "
            f"{rs['seconds']} s, external prefix-cache hits {rs['external_hits']:.0f}"
        )
    return out


def pd_decoder_lines(d: dict) -> list[str]:
    out = [
        f"pd_decoder_kill: {d['date']}, producer timeout (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT) "
        f"{d['hold_s']} s, client bound {d['bound_s']} s, wall {d['wall_s']} s"
    ]
    for key in ("ours", "stock"):
        r = d[key]
        if "skipped" in r or "error" in r:
            # the error carries the server's log tail after its first line: the line says why
            why = (r.get("skipped") or r.get("error") or "").splitlines()[0]
            out.append(f"  {key}: not run: {why}")
            continue
        secs = sorted({x["seconds"] for x in r["A"]})
        details = sorted({x.get("detail", "") for x in r["A"]} - {""})
        rs = r["restart"]
        out.append(
            f"  {key}: A streaming before the kill {r['a_streaming_before_kill']}, running at it "
            f"{r['a_running_at_kill']}; A {r['tally']['A']} in {secs} s"
            + (f" ({'; '.join(details)})" if details else "")
            + f"; killed decoder rc {r['decoder0_rc']}, its group left {r['decoder0_group_left']}"
            f"; producer alive {r['producer_alive']}, /health failures "
            f"{r['producer_health_failures']}"
        )
        usage = r["producer_kv_at_kill"]
        out.append(
            f"  {key}: producer KV usage {usage * 100:.2f} % at the kill (B prefilled "
            f"{r['b_prefilled_s_before_kill']} s before it), back to 0 "
            f"{r['kv_freed_s_after_kill']} s after the kill = {r['kv_freed_s_after_b_prefill']} s"
            f" after B's prefills; expired lines {len(r['producer_expired_lines'])} "
            f"({sorted({s for _, s in r['producer_expired_lines']})} s), expired counter "
            f"+{r['producer_expired_counter_delta']}; producer error lines "
            f"{sum(len(x) for x in r['producer_error_lines'])}"
        )
        out.append(
            f"  {key}: restarted decoder ready {rs['ready_s_after_kill']} s after the kill, "
            f"reference tokens equal to before the kill {rs['tokens_equal_before_kill']} in "
            f"{rs['seconds']} s, external prefix-cache hits {rs['external_hits']:.0f}"
        )
    return out


def sampling_lines(d: dict) -> list[str]:
    """Case 4 on the GPU: the PIT chi-square of the first tokens and of the tokens right after
    an accepted draft token, at T = 1 (must not reject) and T = 0.8 / 0.5 (the controls)."""
    spec = d["metrics"][0]
    out = [
        f"sampling: {d['requests']} requests x {d['max_tokens']} tokens ({d['prefixes']} "
        f"prefixes), {d['bins']} bins, alpha {d['alpha']}, critical {d['critical']}; "
        f"PP={d['config']['pipeline_parallel_size']} {d['config']['spec_method']} "
        f"k={d['config']['num_speculative_tokens']}, {d['config']['dtype']}, eager "
        f"{d['config']['enforce_eager']}, async {d['config']['async_scheduling']}; start-up "
        f"{d['startup_s']} s, waves {' / '.join(str(x) for x in d['wave_s'])} s (T = 1 / 0.8 / "
        f"0.5), engines {d['engines_s']} s, analysis {d['analysis_s']} s",
        f"  T=1 wave: verification steps {d['verification_steps']:,} (num_drafts "
        f"{spec['num_drafts']:,}), accepted draft tokens {spec['num_accepted_tokens']:,} (per "
        f"position {spec['accepted_per_pos']}), {d['accepted_in_output']:,} of them in the output",
    ]
    for group in ("first", "after_accepted"):
        g = d[group]
        parts = []
        for t in ("1.0", "0.8", "0.5"):
            x = g[f"T={t}"]
            parts.append(
                f"T={t}: n {x['n']}, stat {x['stat']}, p {x['p']:.3g}, bins "
                + " ".join(str(b) for b in x["observed"])
            )
        nc, pw = g["noncentrality_per_sample"], g["power_at_n"]
        n1 = g["T=1.0"]["n"]
        out.append(f"  {group}: " + "; ".join(parts))
        out.append(
            f"  {group}: noncentrality at n={n1} vs 0.8 {nc['0.8'] * n1:.1f}, vs 0.5 "
            f"{nc['0.5'] * n1:.1f}; power at n vs 0.8 {pw['0.8']:.4f}, vs 0.5 {pw['0.5']:.4f}"
        )
    rd = d["reference_distance"]
    out.append(
        f"  reference vs vLLM's served target: {rd['contexts']:,} contexts, max TV "
        f"{rd['max_tv']:.2e}, mean TV {rd['mean_tv']:.2e}, bound on the added statistic "
        f"(100 n d^2) {rd['max_excess_at_n']:.4f}"
    )
    pp = d["pp2_vs_pp1"]
    out.append(
        f"  seeded PP=2 vs PP=1 DSpark: {pp['differing']}/{pp['requests']} differ, same step "
        f"lengths {pp['same_step_lengths']}, same counters "
        f"{pp['pp1_metrics'] == pp['pp2_metrics']}; PP=1 start-up {pp['pp1_startup_s']} s"
    )
    return out


def main(argv: list[str]) -> int:
    folder = Path(argv[1] if len(argv) > 1 else "docs/results")
    lines = load_lines(_load(folder, "load"))
    lines += lost_lines("lost_stage", _load(folder, "lost_stage"))
    lines += lost_lines("lost_stage_control", _load(folder, "lost_stage_control"))
    if (folder / "reliability_gpu_lost_stage_stock.json").exists():
        lines += lost_lines("lost_stage_stock", _load(folder, "lost_stage_stock"))
    lines += pd_lines(_load(folder, "pd_kill"))
    if (folder / "reliability_gpu_pd_decoder_kill.json").exists():
        lines += pd_decoder_lines(_load(folder, "pd_decoder_kill"))
    if (folder / "reliability_gpu_sampling.json").exists():
        lines += sampling_lines(_load(folder, "sampling"))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
