#!/usr/bin/env python3
"""Sustained load against PP=2 DSpark (issue 28, case 1): ``vllm bench serve`` (vLLM's own
client), several runs against one server, and what must hold after each run.

CPU (the default): ``vllm serve models/tiny-pair/target -pp 2`` with DSpark (k=7), float32, the
shared runs' scheduler settings; random dataset (``--random-range-ratio`` spreads the lengths),
streaming (bench serve always streams), ``--max-concurrency C``. After each run: completed and
failed counts from bench serve's result JSON, the server's KV-cache usage and running requests
once idle (must return to 0), the summed RSS of the server's process group (must not grow run
over run), and ERROR lines in the server log (must be none). Writes OUT/reliability_load.json.

    PYTHONPATH=.:tests .venv/bin/python tools/reliability_load.py --runs 3 --num-prompts 100 \\
        --concurrency 8 --input-len 64 --output-len 64 --out /tmp/rel-load

``--plugins none`` runs the stock vLLM control (``VLLM_PLUGINS`` leaves the plugin out, no
speculation: stock PP + DSpark does not run). The GPU command for the full scale is in
docs/results/reliability.md.
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

# dspark_dev and the test helpers (tests/support) of a checkout: on PYTHONPATH (the usage above)
from support import engines, tiny_pair
from support.served_load import group_rss_mib, wait_idle

from dspark_dev.proc import live_group_members
from dspark_dev.serve import Server, free_port
from dspark_dev.serve_demo import serve_argv


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--plugins", choices=("ours", "none"), default="ours")
    ap.add_argument("--run-timeout-s", type=float, default=540)
    ap.add_argument("--out", default="/tmp/rel-load")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stock = a.plugins == "none"
    port = free_port()
    argv_ = serve_argv(
        tiny_pair.TARGET,
        pp=2,
        spec=None if stock else tiny_pair.spec_config(),
        port=port,
        extra=engines.pair_serve_args(),
    )
    env = {"VLLM_PLUGINS": "no-such-plugin"} if stock else {}
    srv = Server(argv_, out / "serve.log", env=env, port=port, name="load server")
    rows = []
    t_start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        srv.start()
        srv.wait_ready(600)
        rss0 = group_rss_mib([srv.proc.pid])
        for i in range(a.runs):
            res_dir = Path(tempfile.mkdtemp(prefix="rel-load-"))
            cmd = [
                sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
                "--backend", "vllm", "--base-url", srv.url, "--model", tiny_pair.TARGET,
                "--dataset-name", "random", "--random-input-len", str(a.input_len),
                "--random-output-len", str(a.output_len),
                "--random-range-ratio", str(a.range_ratio),
                "--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.concurrency),
                "--temperature", str(a.temperature), "--ignore-eos",
                "--seed", str(i), "--save-result", "--result-dir", str(res_dir),
                "--result-filename", "r.json",
            ]  # fmt: skip
            t0 = time.monotonic()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.run_timeout_s)
            took = time.monotonic() - t0
            (out / f"bench_{i}.log").write_text(proc.stdout + "\n" + proc.stderr)
            r = json.loads((res_dir / "r.json").read_text()) if proc.returncode == 0 else {}
            usage, running = wait_idle(port)
            row = {
                "run": i,
                "rc": proc.returncode,
                "seconds": round(took, 1),
                "completed": r.get("completed"),
                "failed": r.get("failed", a.num_prompts - (r.get("completed") or 0)),
                "output_tok_s": round(float(r.get("output_throughput", 0.0)), 1),
                "kv_usage_after": usage,
                "running_after": running,
                "rss_mib_after": group_rss_mib([srv.proc.pid]),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        log = srv.log_tail(10**8)
        errors = [ln for ln in log.splitlines() if " ERROR " in ln]
    finally:
        srv.stop(grace_s=10.0)
    summary = {
        "date": t_start,
        "command": " ".join(sys.argv),
        "stock": stock,
        "rss_mib_ready": round(rss0, 1),
        "runs": rows,
        "server_error_lines": len(errors),
        "first_errors": errors[:5],
        "left_running": live_group_members(srv.proc.pid),
    }
    (out / "reliability_load.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    ok = (
        all(r["rc"] == 0 and r["completed"] == a.num_prompts for r in rows)
        and all((r["kv_usage_after"], r["running_after"]) == (0.0, 0.0) for r in rows)
        and not errors
    )
    return 0 if ok else 1


if __name__ == "__main__":
    if "VLLM_TARGET_DEVICE" not in os.environ:
        from dspark_dev.serve import CPU_ENV

        os.environ.update(CPU_ENV)
    raise SystemExit(main())
