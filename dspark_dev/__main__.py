"""``python -m dspark_dev``: the checkout commands, one subcommand per module of
``dspark_dev/commands/`` (found automatically): ``demo``, ``eval``, ``train-tiny-pair``.

Run it from the checkout root (``.venv/bin/python -m dspark_dev demo``): Python puts the working
directory first on the import path for ``-m``, which is how ``dspark_dev`` is found; nothing here
or in the runtime package edits ``sys.path``. Each command module defines ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``, as ``vllm_dspark_pp/cli/*.py`` do.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

PROG = "python -m dspark_dev"


def command_modules() -> list[str]:
    """The dotted name of every module of ``dspark_dev.commands``, sorted."""
    pkg = importlib.import_module("dspark_dev.commands")
    return sorted(f"{pkg.__name__}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Development commands of a vllm-dspark-pp checkout (run from its root).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module in command_modules():
        mod = importlib.import_module(module)
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
