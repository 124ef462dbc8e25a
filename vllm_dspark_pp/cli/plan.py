"""``vllm-dspark-pp plan``: print the deployment plan of a ``vllm serve`` configuration.

Exit codes: 0 accepted; 1 rejected (vLLM's or this plugin's message is printed); 2 bad arguments.
"""

from __future__ import annotations

import json
import os
import re
import sys

NAME = "plan"
HELP = (
    "Build vLLM's configs for a target + --speculative-config + -pp/-tp (+ --kv-transfer-config) "
    "from config.json files only and print the TP x PP deployment plan (each stage's layers and "
    "global ranks, per-TP-rank target weight and drafter bytes) and whether it is accepted; at "
    "PP > 1 with a DSpark draft, the estimated stage costs and a recommended "
    "VLLM_PP_LAYER_PARTITION."
)


def _draft_cost_layers(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r}: a number of target layers >= 0")
    return value


def add_arguments(p) -> None:
    p.add_argument("model", help="target model directory (config.json is enough)")
    p.add_argument(
        "--speculative-config", type=json.loads, default=None, help="JSON, as for vllm serve"
    )
    p.add_argument(
        "--kv-transfer-config", type=json.loads, default=None, help="JSON, as for vllm serve"
    )
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--no-async-scheduling", dest="async_scheduling", action="store_false", default=None
    )
    p.add_argument(
        "--draft-cost-layers",
        type=_draft_cost_layers,
        default=None,
        metavar="X",
        help="the drafter's measured cost in target layers (e.g. the draft step's time over one "
        "target layer's time at PP=1); replaces the cost model's drafter in the stage balance",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _select_platform() -> None:
    """Use vLLM's CPU platform when this machine has no CUDA device (vLLM's supported override)."""
    if os.environ.get("VLLM_TARGET_DEVICE"):
        return
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    if not has_gpu:
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
        # vLLM's CPU platform needs a Triton driver; the interpreter is the one a CPU-only
        # machine has. These affect this CLI process only.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def _readable(exc: Exception) -> str:
    """vLLM's message without pydantic's input dump and help link."""
    text = str(exc).strip() or type(exc).__name__
    kept = []
    for line in text.splitlines():
        line = re.sub(r"\s*\[type=.*$", "", line).strip()
        if line and not line.startswith("For further information"):
            kept.append(line)
    return " ".join(kept)


def run(args) -> int:
    _select_platform()
    from vllm_dspark_pp import register

    register()  # the plan judges vLLM *with* this plugin, as a deployment would run it
    from vllm_dspark_pp.deployment_plan import format_plan, make_plan

    extra = {"dtype": args.dtype}
    if args.max_model_len:
        extra["max_model_len"] = args.max_model_len
    if args.async_scheduling is not None:
        extra["async_scheduling"] = args.async_scheduling
    try:
        plan = make_plan(
            args.model,
            speculative_config=args.speculative_config,
            pipeline_parallel_size=args.pipeline_parallel_size,
            tensor_parallel_size=args.tensor_parallel_size,
            kv_transfer_config=args.kv_transfer_config,
            extra_engine_args=extra,
            draft_cost_layers=args.draft_cost_layers,
        )
    except Exception as exc:  # vLLM's own rejection: show its message, not a traceback
        msg = _readable(exc)
        if args.json:
            print(json.dumps({"accepted": False, "messages": [f"{type(exc).__name__}: {msg}"]}))
        else:
            print(
                f"verdict     REJECTED by vLLM 0.34.0 + vllm-dspark-pp\n  - {type(exc).__name__}: "
                f"{msg}"
            )
        return 1
    print(plan.to_json() if args.json else format_plan(plan))
    sys.stdout.flush()
    return 0 if plan.accepted else 1
