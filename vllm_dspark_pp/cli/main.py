"""``vllm-dspark-pp`` command line: one subcommand per module under ``vllm_dspark_pp.cli`` (found
automatically).

Each subcommand module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) ->
int``.

The checkout commands (``demo``, ``eval``, ``train-tiny-pair``) run development tooling that is not
in the wheel and have their own front door in a source checkout: ``python -m dspark_dev <name>``
from the checkout root (``dspark_dev/__main__.py``). This command imports none of it; typed here,
each of those names exits with status 2 and a message naming that spelling.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

# the checkout commands (NAME of each module in dspark_dev/commands) -> their help line here
# (tests/unit/cli/test_cli_checkout.py checks the names)
CHECKOUT_COMMANDS = {
    "demo": "Serve the bundled trained pair with DSpark on a PP target (CPU), ask one question.",
    "eval": "Evaluation gates: `eval gsm8k --config tests/evals/gsm8k/configs/<name>.yaml`.",
    "train-tiny-pair": "Retrain the bundled tiny Qwen3 target and its DSpark drafter.",
}
MOVED_TO_CHECKOUT = (
    "vllm-dspark-pp {name}: this command runs development tooling (the `dspark_dev` package) "
    "that lives in a source checkout, not in the installed wheel. In a checkout (`bash "
    "tools/quickstart.sh` sets one up), run it from the checkout root as "
    "`python -m dspark_dev {name}`."
)


def subcommand_modules() -> list[str]:
    """Every module of this package except ``main`` and private ones, sorted."""
    pkg = importlib.import_module("vllm_dspark_pp.cli")
    return sorted(
        m.name
        for m in pkgutil.iter_modules(pkg.__path__)
        if m.name != "main" and not m.name.startswith("_")
    )


def _moved_to_checkout(args) -> int:
    print(MOVED_TO_CHECKOUT.format(name=args.command), file=sys.stderr)
    return 2


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
    for name, help_text in CHECKOUT_COMMANDS.items():
        p = sub.add_parser(name, help=f"{help_text} (checkout: python -m dspark_dev {name})")
        p.set_defaults(_run=_moved_to_checkout)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args._run is not _moved_to_checkout:  # its arguments are for the checkout
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
