"""``python -m dspark_dev eval gsm8k``: GSM8K-style accuracy + acceptance gate for one
configuration."""

from __future__ import annotations

NAME = "eval"
HELP = "Evaluation gates: `eval gsm8k --config tests/evals/gsm8k/configs/<name>.yaml`."


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="eval_name", required=True)
    g = sub.add_parser(
        "gsm8k", help="GSM8K accuracy, invalid rate and DSpark acceptance for one YAML config"
    )
    g.add_argument("--config", required=True, help="YAML under tests/evals/gsm8k/configs/")
    g.add_argument(
        "--server-url",
        default=None,
        help="OpenAI-compatible server (e.g. http://localhost:8000) instead of an offline LLM",
    )
    g.add_argument(
        "--launchers",
        action="store_true",
        help="serve the config's PP=N target with N `vllm serve` launchers (--nnodes N, one stage "
        "each) and evaluate over HTTP: PP on one GPU (every stage on GPU 0, each launcher its own "
        "NCCL_HOSTID); DSPARK_GPU_PP_LAYOUT=per-stage puts stage R on GPU R",
    )
    g.add_argument(
        "--launcher-logs",
        default=None,
        help="directory for the launchers' logs (default: a new temporary directory)",
    )
    g.add_argument("--limit", type=int, default=None, help="evaluate only the first N questions")
    g.add_argument(
        "--accuracy-min", type=float, default=None, help="override the config's threshold"
    )
    g.add_argument(
        "--acceptance-length-min", type=float, default=None, help="override the config's threshold"
    )
    g.add_argument("--out-json", default=None, help="write the full report (with completions) here")
    g.add_argument(
        "--results-md", default=None, help="append the result row to this markdown table"
    )


def run(args) -> int:
    import json
    import os

    from dspark_dev import gsm8k

    cfg = gsm8k.load_config(args.config)
    if args.accuracy_min is not None:
        cfg.accuracy_min = args.accuracy_min
    if args.acceptance_length_min is not None:
        cfg.acceptance_length_min = args.acceptance_length_min
    logs = None
    if args.launchers:
        import tempfile

        if args.server_url:
            print("eval gsm8k: --launchers starts its own servers; drop --server-url", flush=True)
            return 2
        logs = args.launcher_logs or tempfile.mkdtemp(prefix=f"gsm8k-{cfg.name}-")
    try:
        report = gsm8k.evaluate(
            cfg, server_url=args.server_url, limit=args.limit, launchers_log_dir=logs
        )
    except (RuntimeError, ValueError) as e:
        print(f"GSM8K [{cfg.name}]: ERROR {e}", flush=True)
        return 2
    print(gsm8k.format_report(report), flush=True)
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(report, f, indent=2)
    if args.results_md:
        new = not os.path.exists(args.results_md)
        with open(args.results_md, "a") as f:
            if new:
                f.write(gsm8k.RESULTS_HEADER)
            f.write(gsm8k.results_row(report))
    return 0 if report["passed"] else 1
