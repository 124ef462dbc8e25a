"""``vllm-dspark-pp`` command line: one subcommand per module under ``vllm_dspark_pp.cli`` (found
automatically).

Each subcommand module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) ->
int``.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys


def subcommand_modules() -> list[str]:
    """Every module of this package except ``main`` and private ones, sorted."""
    pkg = importlib.import_module("vllm_dspark_pp.cli")
    return sorted(
        m.name
        for m in pkgutil.iter_modules(pkg.__path__)
        if m.name != "main" and not m.name.startswith("_")
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-dspark-pp",
        description="DSpark speculative decoding on pipeline-parallel vLLM targets.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in subcommand_modules():
        mod = importlib.import_module(f"vllm_dspark_pp.cli.{name}")
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
