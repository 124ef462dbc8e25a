"""``python -m dspark_dev demo``: serve the bundled trained pair with DSpark on a PP=2 target on the
CPU platform, ask one held-out question through the OpenAI API, print the answer and the
acceptance, stop the server (see dspark_dev/serve_demo.py; tools/quickstart.sh runs it).

Exit codes: 0 answered, acceptance read and server stopped with nothing left running; 1 otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

NAME = "demo"
HELP = (
    "Start `vllm serve` on models/tiny-pair with -pp 2 and DSpark (CPU, float32), ask one "
    "held-out question, print the answer and the mean acceptance length, stop the server."
)


def add_arguments(p) -> None:
    from dspark_dev.serve_demo import DEFAULT_PAIR

    p.add_argument(
        "--pair", default=str(DEFAULT_PAIR), help="directory with target/ and dspark-draft/"
    )
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=2)
    p.add_argument("--question-index", type=int, default=0, help="held-out problem to ask")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ready-timeout", type=float, default=240.0, help="seconds to wait for /health")
    p.add_argument("--log", default=None, help="server log file (default .demo/vllm-serve.log)")
    p.add_argument("--json", default=None, help="also write the result as JSON here")


def run(args) -> int:
    from dspark_dev import serve_demo

    try:
        r = serve_demo.run_demo(
            Path(args.pair),
            pp=args.pipeline_parallel_size,
            question_index=args.question_index,
            max_tokens=args.max_tokens,
            ready_timeout_s=args.ready_timeout,
            log_path=Path(args.log) if args.log else None,
        )
    except Exception:  # run_demo printed the reason and the log tail, and stopped the server
        return 1
    print()
    print(serve_demo.format_result(r))
    print()
    ok = r["mean_acceptance_length"] is not None and not r["leftover_pids"]
    serve_demo.say(
        "server stopped ("
        + ("on SIGTERM" if r["stopped_cleanly"] else "SIGKILL after the grace period")
        + f"; {len(r['leftover_pids'])} processes left); {r['wall_s']} s from start to stop"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    print()
    print("The same deployment on two GPUs with a real model:")
    print(f"  {serve_demo.GPU_COMMAND}")
    return 0 if ok else 1
