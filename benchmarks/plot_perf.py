#!/usr/bin/env python3
"""Markdown tables and PNG plots from benchmarks/perf_real_shapes.py results.

    python3 -m benchmarks.plot_perf OUT/perf_qwen3-8b.json OUT/perf_qwen3-4b.json \\
        --out-dir docs/results --md docs/results/performance_tables.md

Per shape: a throughput / latency table (no speculation and DSpark at each acceptance length,
plugin on), the plugin on/off ratio table, the draft/target step-time table and the drafter
memory table (allocator-measured vs ``vllm-dspark-pp plan``); PNGs ``perf_<shape>.png``
(output tok/s and TPOT against concurrency). Prints the markdown last.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MIB = 2**20


def load(paths: list[str | Path]) -> list[dict]:
    """Result JSONs, one per shape: several JSONs of one shape (calls with different
    ``--phases``) are merged (``perf_real_shapes.merge_results``)."""
    from benchmarks.perf_real_shapes import merge_results

    by_shape: dict[str, list[dict]] = {}
    for p in paths:
        r = json.loads(Path(p).read_text())
        by_shape.setdefault(r.get("shape", ""), []).append(r)
    return [merge_results(rs) for _, rs in sorted(by_shape.items())]


def plan_bytes(res: dict) -> dict | None:
    """What ``vllm-dspark-pp plan`` predicts (bytes) for this result's shape, computed from its
    ``shape_config`` with the plan's own function (config-only draft: embedding and LM head
    shared with the target); None when the shape config is not a real shape's."""
    cfg = res.get("shape_config")
    if not isinstance(cfg, dict) or "intermediate_size" not in cfg:
        return None
    try:
        from benchmarks.real_shapes import SHAPES, draft_config
        from vllm_dspark_pp.producer.memory import draft_load_bytes
    except ImportError:
        return None
    shape = SHAPES.get(cfg.get("name"))
    if shape is None:
        return None
    return draft_load_bytes(draft_config(shape), 2, own_embed=False, own_head=False)


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _label(row: dict) -> str:
    if row["engine"] == "nospec":
        return "no speculation"
    return f"DSpark k=7, AL {row['acceptance_length']:g}"


def throughput_table(res: dict) -> str:
    rows = [r for r in res["rows"] if r["engine"] == "nospec" or r["plugin"] == "on"]
    sp = {(s["acceptance_length"], s["concurrency"]): s["speedup"] for s in res.get("speedup", [])}
    lines = [
        "| config | C | output tok/s | vs no spec | TPOT ms | TTFT ms | measured AL | repeats |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s = sp.get((r["acceptance_length"], r["concurrency"])) if r["engine"] == "dspark" else None
        lines.append(
            f"| {_label(r)} | {r['concurrency']} | {_f(r['output_tok_s'], '.1f')} | "
            f"{_f(s, '.2f') + 'x' if s is not None else '-'} | {_f(r['tpot_ms'], '.2f')} | "
            f"{_f(r['ttft_ms'], '.1f')} | {_f(r['measured_acceptance_length'], '.2f')} | "
            f"{r['repeats']} |"
        )
    return "\n".join(lines)


def ratio_table(res: dict) -> str:
    lines = [
        "| AL | C | plugin on tok/s | plugin off tok/s | on/off |",
        "|---:|---:|---:|---:|---:|",
    ]
    for p in sorted(
        res.get("plugin_ratio", []), key=lambda p: (p["acceptance_length"], p["concurrency"])
    ):
        lines.append(
            f"| {p['acceptance_length']:g} | {p['concurrency']} | {p['on_tok_s']:.1f} | "
            f"{p['off_tok_s']:.1f} | {p['ratio']:.3f} |"
        )
    return "\n".join(lines)


def step_table(res: dict) -> str:
    lines = [
        "| config | C | target ms/step | draft ms/step | step ms | draft share |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        if r["engine"] == "dspark" and r["plugin"] != "on":
            continue
        share = (r["draft_ms"] / r["step_ms"]) if r.get("draft_ms") and r.get("step_ms") else None
        lines.append(
            f"| {_label(r)} | {r['concurrency']} | {_f(r['target_ms'], '.3f')} | "
            f"{_f(r['draft_ms'], '.3f')} | {_f(r['step_ms'], '.3f')} | "
            f"{_f(share * 100 if share is not None else None, '.1f')}{'%' if share else ''} |"
        )
    return "\n".join(lines)


def memory_table(res: dict) -> str:
    mem = res.get("memory") or {}
    plan = res.get("plan") or {}
    pb = plan_bytes(res)
    lines = [
        "| drafter | allocator delta at load | gc before reading | peak during load | "
        "own parameters | plan predicts | allocator / plan |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]

    def mib(x):
        return "-" if x is None else f"{x / MIB:.1f} MiB"

    for key, label, pkey in (
        ("dspark/on", "full DSpark drafter", "full"),
        ("producer/on", "context-KV-only drafter (producer)", "context_only"),
    ):
        d = (mem.get(key) or {}).get("draft_load") or {}
        pred = pb[pkey] if pb else None
        got = d.get("allocated_delta_bytes")
        gc_note = "-" if not d else ("yes" if d.get("gc_collected") else "no (first run)")
        lines.append(
            f"| {label} | {mib(got)} | {gc_note} | {mib(d.get('peak_delta_bytes'))} | "
            f"{mib(d.get('param_bytes_own'))} | {mib(pred)} | "
            f"{_f(got / pred if got and pred else None, '.3f')} |"
        )
    for role in ("kv_both", "kv_producer"):
        text = (plan.get(role) or {}).get("draft bytes")
        if text:
            lines.append(f"\n`vllm-dspark-pp plan` on the GPU machine ({role}): {text}")
    return "\n".join(lines)


def shape_markdown(res: dict) -> str:
    parts = [
        f"### {res.get('shape')} ({res.get('gpu') or 'GPU ?'}; vLLM {res.get('vllm_version')}, "
        f"torch {res.get('torch_version')}; {res.get('date_utc')} UTC)",
        "",
        f"Command: `{res.get('command')}`; {res.get('input_len')}-token random prompts, "
        f"{res.get('output_len')} output tokens (ignore_eos), median of up to "
        f"{res.get('repeats')} repeats.",
        "",
        throughput_table(res),
        "",
        "Plugin cost (DSpark, output tok/s with the plugin loaded / with `VLLM_PLUGINS` "
        "excluding it):",
        "",
        ratio_table(res),
        "",
        "Per-step GPU time (median over the decode steps of the most frequent batch size):",
        "",
        step_table(res),
        "",
        "Drafter memory on the GPU (allocator, around the speculator's load):",
        "",
        memory_table(res),
    ]
    engines = res.get("engines") or []
    if engines:
        parts += [
            "",
            "Engine start-up: "
            + ", ".join(f"{e['engine']}/{e['plugin']} {e['start_s']} s" for e in engines),
        ]
    notes = [f"skipped: {s.get('what')} ({s.get('why')})" for s in res.get("skipped", [])]
    notes += [f"error: {e.get('what')}: {str(e.get('error'))[:300]}" for e in res.get("errors", [])]
    if notes:
        parts += ["", "Not measured in this run:", ""] + [f"- {n}" for n in notes]
    return "\n".join(parts)


def fill_between(path: Path, marker: str, text: str) -> None:
    """Replace what lies between ``<!-- BEGIN marker -->`` and ``<!-- END marker -->`` in
    ``path`` (both lines kept); raises if the markers are missing."""
    begin, end = f"<!-- BEGIN {marker} -->", f"<!-- END {marker} -->"
    doc = path.read_text()
    if begin not in doc or end not in doc:
        raise ValueError(f"{path} has no {begin} ... {end} block")
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{text.rstrip()}\n{end}{tail}")


def plot(res: dict, png: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: matplotlib not importable ({e})"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    series: dict[str, list[dict]] = {}
    for r in res["rows"]:
        if r["engine"] == "dspark" and r["plugin"] == "off":
            name = f"{_label(r)} (plugin off)"
        else:
            name = _label(r)
        series.setdefault(name, []).append(r)
    for name, rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rs]
        style = "--" if "plugin off" in name else "-"
        ax1.plot(xs, [r["output_tok_s"] for r in rs], style, marker="o", label=name)
        ax2.plot(xs, [r["tpot_ms"] for r in rs], style, marker="o", label=name)
    for ax, title in ((ax1, "output tokens/s"), (ax2, "mean TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_title(f"{res.get('shape')}: {title}")
        ax.grid(True, alpha=0.3)
    ax1.legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return f"plot: {png}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out-dir", type=Path, default=None, help="PNG directory")
    ap.add_argument("--md", type=Path, default=None)
    ap.add_argument(
        "--fill",
        type=Path,
        default=None,
        help="write the tables (and PNG links) into this file's GENERATED block",
    )
    a = ap.parse_args(argv)
    results = load(a.results)
    parts = []
    for r in results:
        part = shape_markdown(r)
        if a.out_dir:
            png = a.out_dir / f"perf_{r.get('shape')}.png"
            print(plot(r, png))
            part += f"\n\n![{r.get('shape')}: throughput and TPOT]({png.name})"
        parts.append(part)
    md = "\n\n".join(parts)
    if a.md:
        a.md.parent.mkdir(parents=True, exist_ok=True)
        a.md.write_text(md + "\n")
    if a.fill:
        fill_between(a.fill, "GENERATED", md)
    print(md)
    return 0 if results else 1


if __name__ == "__main__":
    raise SystemExit(main())
