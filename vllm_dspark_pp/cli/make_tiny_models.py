"""``vllm-dspark-pp make-tiny-models DIR``: write the tiny Qwen3 target + Qwen3 DSpark draft."""

from __future__ import annotations

NAME = "make-tiny-models"
HELP = (
    "Write a tiny random Qwen3 target and a matching Qwen3 DSpark draft (safetensors, tokenizer) "
    "under DIR; the same seed gives byte-identical files."
)


def add_arguments(parser) -> None:
    parser.add_argument("dir", metavar="DIR", help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="weight dtype: float32 for CPU parity runs (default), bfloat16 for GPUs",
    )
    parser.add_argument(
        "--num-layers", type=int, default=6, help="target decoder layers (default 6)"
    )


def run(args) -> int:
    from vllm_dspark_pp.tiny_models import make_tiny_models

    paths = make_tiny_models(args.dir, seed=args.seed, dtype=args.dtype, num_layers=args.num_layers)
    print(f"target: {paths.target}")
    print(f"draft:  {paths.draft}")
    print(
        "try:    vllm-dspark-pp plan "
        f"{paths.target} --speculative-config "
        f'\'{{"method": "dspark", "model": "{paths.draft}"}}\' -pp 2'
    )
    return 0
