"""``vllm-dspark-pp`` command line: one subcommand per module under ``vllm_dspark_pp.cli``.

Each subcommand module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# module name under vllm_dspark_pp.cli, in the order shown by --help
SUBCOMMANDS = ("make_tiny_models", "plan", "patches")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-dspark-pp",
        description="DSpark speculative decoding on pipeline-parallel vLLM targets.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            mod = importlib.import_module(f"vllm_dspark_pp.cli.{name}")
        except ModuleNotFoundError as exc:  # a subcommand still being written
            if exc.name == f"vllm_dspark_pp.cli.{name}":
                continue
            raise
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
