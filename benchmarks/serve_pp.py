#!/usr/bin/env python3
"""Serving benchmark for several GPUs: ``vllm bench serve`` against one server configuration.

One configuration per command (each < 10 minutes), after the kit is booted on a >= 2-GPU machine:

    source /tmp/site/env.sh && PYTHONPATH=.:$PYTHONPATH \\
        python3 -m benchmarks.serve_pp --config pp2_dspark --out $OUT
    ... --config pp2_plain      (PP=2, no speculation)
    ... --config tp2_dspark     (TP=2 + DSpark)
    python3 -m benchmarks.plot_serve $OUT/serve_*.json --png docs/results/multi_gpu_serve.png \\
        --md docs/results/multi_gpu_serve.md

Models (``--model-size``): ``tiny`` = the random tiny pair (6 layers x 128, vocab 512), ``wide`` = a
random-weight Qwen3 of realistic width (28 layers x hidden 2048, 16 heads, 8 KV heads, head_dim
128, intermediate 6144; vocab 512 from the tiny tokenizer) with a random one-layer DSpark draft;
both generated here, nothing downloaded. Random weights: the acceptance is what such drafts give,
the step times are what the shapes cost. Random dataset, 1024 tokens in / 256 out, ``ignore_eos``;
concurrency 1, 4, 16, 32, 64 (``--concurrency``), ``4 x concurrency`` prompts (at least 16).

Per concurrency: output tokens/s, mean/median TPOT, mean TTFT (from bench serve's result JSON) and
the server's spec-decode acceptance over that level (/metrics deltas). Writes
OUT/serve_<config>_<size>.json (rows) and OUT/serve_<config>_<size>.log, prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dspark_dev.metrics import counter_delta, parse_prometheus
from dspark_dev.metrics import spec_metrics_from_prometheus as spec_counters
from dspark_dev.multi_gpu import Report, gpu_count, guarded_env
from dspark_dev.serve import CaseFailure as GPUCaseFailure
from dspark_dev.serve import Server, http_text

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = {
    "pp2_dspark": {"pp": 2, "tp": 1, "spec": True},
    "pp2_plain": {"pp": 2, "tp": 1, "spec": False},
    "tp2_dspark": {"pp": 1, "tp": 2, "spec": True},
}
WIDE = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
)


def make_models(size: str, root: Path):
    from vllm_dspark_pp.tiny_models import make_tiny_models

    if size == "tiny":
        return make_tiny_models(
            root, seed=0, dtype="bfloat16", hidden_size=128, intermediate_size=256, head_dim=64
        )
    return make_tiny_models(
        root,
        seed=0,
        dtype="bfloat16",
        target_layer_ids=(1, 13, 26),
        max_position_embeddings=4096,
        **WIDE,
    )


def bench_rows_table(rows: list[dict]) -> str:
    head = (
        f"{'config':<11} {'conc':>4} {'out tok/s':>10} {'TPOT ms':>8} {'p50 TPOT':>8} "
        f"{'TTFT ms':>8} {'accept %':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        acc = "-" if r.get("acceptance_pct") is None else f"{r['acceptance_pct']:.1f}"
        lines.append(
            f"{r['config']:<11} {r['concurrency']:>4} {r['output_throughput']:>10.1f} "
            f"{r['mean_tpot_ms']:>8.2f} "
            f"{r['median_tpot_ms']:>8.2f} {r['mean_ttft_ms']:>8.1f} {acc:>8}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), required=True)
    ap.add_argument("--model-size", choices=("tiny", "wide"), default="tiny")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/dspark-bench-out"))
    ap.add_argument("--concurrency", default="1,4,16,32,64")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument(
        "--budget-s", type=float, default=540, help="stop starting new levels after this"
    )
    a = ap.parse_args(argv)
    out = Path(a.out)
    tag = f"{a.config}_{a.model_size}"
    rep = Report(f"serving benchmark {tag}", out / f"serve_{tag}.log")
    cfg = CONFIGS[a.config]
    n_gpu = gpu_count()
    if n_gpu < cfg["pp"] * cfg["tp"]:
        rep.add("GPUs", "FAIL", f"needs {cfg['pp'] * cfg['tp']}, found {n_gpu}")
        return rep.finish()
    guard, env = guarded_env()
    pair = make_models(a.model_size, Path(tempfile.mkdtemp(prefix="dspark-bench-models-")))
    args = [
        "--dtype", "bfloat16", "--max-model-len", str(a.input_len + a.output_len + 64),
        "--max-num-seqs", "64",
        "--seed", "0", "--gpu-memory-utilization", "0.85",
        "--pipeline-parallel-size", str(cfg["pp"]), "--tensor-parallel-size", str(cfg["tp"]),
        "--distributed-executor-backend", "mp",
    ]  # fmt: skip
    if cfg["spec"]:
        args += ["--speculative-config", json.dumps({"method": "dspark", "model": pair.draft})]
    rows: list[dict] = []
    srv = Server.vllm(a.config, pair.target, args, env=env)
    try:
        srv.start()
        srv.wait_ready(300)
        rep.log(f"server {a.config} ready")
        for c in [int(x) for x in a.concurrency.split(",")]:
            if time.monotonic() - rep.t0 > a.budget_s:
                rep.add(f"concurrency {c}", "SKIP", f"budget {a.budget_s:.0f} s spent")
                continue
            before = spec_counters(parse_prometheus(http_text(srv.url + "/metrics")))
            res_dir = Path(tempfile.mkdtemp(prefix="dspark-bench-res-"))
            cmd = [
                sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
                "--backend", "vllm", "--base-url", srv.url, "--model", pair.target,
                "--dataset-name", "random", "--random-input-len", str(a.input_len),
                "--random-output-len", str(a.output_len), "--num-prompts", str(max(16, 4 * c)),
                "--max-concurrency", str(c), "--ignore-eos", "--seed", "0",
                "--percentile-metrics", "ttft,tpot,itl",
                "--save-result", "--result-dir", str(res_dir), "--result-filename", "r.json",
            ]  # fmt: skip
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=240, env={**os.environ, **env}
            )
            rep.log(
                f"bench c={c} rc={proc.returncode}\n{proc.stdout[-1500:]}\n{proc.stderr[-800:]}"
            )
            if proc.returncode != 0 or not (res_dir / "r.json").exists():
                rep.add(f"concurrency {c}", "FAIL", f"bench serve rc={proc.returncode}")
                continue
            r = json.loads((res_dir / "r.json").read_text())
            d = counter_delta(
                before, spec_counters(parse_prometheus(http_text(srv.url + "/metrics")))
            )
            acc = (
                100.0 * d["num_accepted_tokens"] / d["num_draft_tokens"]
                if d["num_draft_tokens"]
                else None
            )
            row = {
                "config": a.config,
                "model_size": a.model_size,
                "concurrency": c,
                "completed": r.get("completed"),
                "output_throughput": float(r.get("output_throughput", 0.0)),
                "mean_tpot_ms": float(r.get("mean_tpot_ms", 0.0)),
                "median_tpot_ms": float(r.get("median_tpot_ms", 0.0)),
                "mean_ttft_ms": float(r.get("mean_ttft_ms", 0.0)),
                "acceptance_pct": acc,
                "spec_counters": d,
            }
            rows.append(row)
            rep.add(
                f"concurrency {c}",
                "PASS",
                f"{row['output_throughput']:.0f} tok/s, TPOT {row['mean_tpot_ms']:.2f} ms, acc "
                f"{acc}",
            )
    except (GPUCaseFailure, subprocess.TimeoutExpired, OSError) as e:
        rep.add("server / benchmark", "FAIL", str(e).splitlines()[0][:200])
        srv.save_log("bench")
    finally:
        logs = [srv.log_text()]
        srv.stop()
    (out / f"serve_{tag}.json").write_text(json.dumps(rows, indent=1))
    guard.check(rep, logs)
    if rows:
        rep.log("\n" + bench_rows_table(rows))
    return rep.finish()


if __name__ == "__main__":
    raise SystemExit(main())
