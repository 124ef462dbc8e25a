#!/usr/bin/env python3
"""Table (markdown) and plot (PNG, if matplotlib is importable) of benchmarks/serve_pp.py results.

    python3 -m benchmarks.plot_serve OUT/serve_*.json [--png FILE] [--md FILE]

The markdown table has one row per (config, model size, concurrency): output tokens/s, mean and
median TPOT, mean TTFT, acceptance. The PNG has two panels against concurrency: output tokens/s
and mean TPOT, one line per config. Prints the table last.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(paths: list[str]) -> list[dict]:
    rows = []
    for p in paths:
        rows += json.loads(Path(p).read_text())
    return sorted(rows, key=lambda r: (r["model_size"], r["config"], r["concurrency"]))


def markdown(rows: list[dict]) -> str:
    lines = [
        "| config | model | concurrency | output tok/s | mean TPOT (ms) | median TPOT (ms) | mean "
        "TTFT (ms) | acceptance % |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        acc = "-" if r.get("acceptance_pct") is None else f"{r['acceptance_pct']:.1f}"
        lines.append(
            f"| {r['config']} | {r['model_size']} | {r['concurrency']} | "
            f"{r['output_throughput']:.1f} | "
            f"{r['mean_tpot_ms']:.2f} | {r['median_tpot_ms']:.2f} | {r['mean_ttft_ms']:.1f} | "
            f"{acc} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], png: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: matplotlib not importable ({e})"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    keys = sorted({(r["config"], r["model_size"]) for r in rows})
    for cfg, size in keys:
        rs = [r for r in rows if r["config"] == cfg and r["model_size"] == size]
        xs = [r["concurrency"] for r in rs]
        ax1.plot(xs, [r["output_throughput"] for r in rs], marker="o", label=f"{cfg} ({size})")
        ax2.plot(xs, [r["mean_tpot_ms"] for r in rs], marker="o", label=f"{cfg} ({size})")
    for ax, title in ((ax1, "output tokens/s"), (ax2, "mean TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    return f"plot: {png}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--md", type=Path, default=None)
    a = ap.parse_args(argv)
    rows = load(a.results)
    if not rows:
        print("no rows in", a.results)
        return 1
    md = markdown(rows)
    if a.md:
        a.md.parent.mkdir(parents=True, exist_ok=True)
        a.md.write_text(md + "\n")
    if a.png:
        print(plot(rows, a.png))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
