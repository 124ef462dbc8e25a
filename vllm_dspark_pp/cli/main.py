"""``vllm-dspark-pp`` command line: one subcommand per module under ``vllm_dspark_pp.cli`` (found
automatically), plus the checkout commands.

Each subcommand module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) ->
int``.

The checkout commands (``demo``, ``eval``, ``train-tiny-pair``) run development tooling that is not
in the wheel: their modules are ``dspark_dev/commands/*.py`` of a source checkout (the top-level
``dspark_dev`` package next to ``vllm_dspark_pp/``). The command finds that package on
``sys.path`` or next to this package (an editable install of a checkout); without it each of them
exits with status 2 and a message naming the fix.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path

DEV_PACKAGE = "dspark_dev"
# NAME of each module in dspark_dev/commands -> its help line where the checkout is missing
# (tests/unit/test_cli_checkout.py checks the names)
CHECKOUT_COMMANDS = {
    "demo": "Serve the bundled trained pair with DSpark on a PP target (CPU), ask one question.",
    "eval": "Evaluation gates: `eval gsm8k --config tests/evals/gsm8k/configs/<name>.yaml`.",
    "train-tiny-pair": "Retrain the bundled tiny Qwen3 target and its DSpark drafter.",
}
MISSING_CHECKOUT = (
    "vllm-dspark-pp {name}: this command runs development tooling (the `dspark_dev` package) "
    "that lives in a source checkout, not in the installed wheel. Clone the repository and "
    "install it editable there (`pip install -e .[dev]` in the checkout, or `bash "
    "tools/quickstart.sh`), then run `vllm-dspark-pp {name}` again."
)


def subcommand_modules() -> list[str]:
    """Every module of this package except ``main`` and private ones, sorted."""
    pkg = importlib.import_module("vllm_dspark_pp.cli")
    return sorted(
        m.name
        for m in pkgutil.iter_modules(pkg.__path__)
        if m.name != "main" and not m.name.startswith("_")
    )


def checkout_root() -> Path | None:
    """The source checkout this package was imported from, if it holds ``dspark_dev/``."""
    root = Path(__file__).resolve().parents[2]
    if (root / DEV_PACKAGE / "__init__.py").is_file() and (root / "pyproject.toml").is_file():
        return root
    return None


def dev_commands_package() -> str | None:
    """``dspark_dev.commands`` made importable (put the checkout on ``sys.path`` if needed), or
    ``None`` when neither ``sys.path`` nor this package's checkout has it (an installed wheel)."""
    if importlib.util.find_spec(DEV_PACKAGE) is None:
        root = checkout_root()
        if root is None:
            return None
        sys.path.insert(0, str(root))
    return f"{DEV_PACKAGE}.commands"


def _missing_checkout(args) -> int:
    print(MISSING_CHECKOUT.format(name=args.command), file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-dspark-pp",
        description="DSpark speculative decoding on pipeline-parallel vLLM targets.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    modules = [f"vllm_dspark_pp.cli.{name}" for name in subcommand_modules()]
    dev = dev_commands_package()
    if dev is not None:
        modules += [f"{dev}.{name.replace('-', '_')}" for name in CHECKOUT_COMMANDS]
    for module in sorted(modules, key=lambda m: m.rpartition(".")[2]):
        mod = importlib.import_module(module)
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    if dev is None:
        for name, help_text in CHECKOUT_COMMANDS.items():
            sub.add_parser(name, help=f"{help_text} (source checkout only)").set_defaults(
                _run=_missing_checkout
            )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args._run is not _missing_checkout:  # its arguments are for the checkout
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
