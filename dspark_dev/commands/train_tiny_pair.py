"""``python -m dspark_dev train-tiny-pair``: rebuild the tiny Qwen3 target + DSpark drafter pair
(issue 7)."""

from __future__ import annotations

NAME = "train-tiny-pair"
HELP = (
    "Train the tiny Qwen3 target and its DSpark drafter on the seeded synthetic GSM8K-style corpus "
    "and write both as vLLM-loadable model directories (see docs/tiny-pair.md)."
)


def add_arguments(parser) -> None:
    from dspark_dev.training.train_tiny_pair import add_arguments as add

    add(parser)


def run(args) -> int:
    from dspark_dev.training.train_tiny_pair import main

    return main(args)
