"""The checkout commands (``demo``, ``eval``, ``train-tiny-pair``): their modules are in
``dspark_dev/commands`` (not in the wheel); ``vllm-dspark-pp`` runs them from a checkout and, from
the wheel's packages alone, exits 2 with a message naming the fix."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from support.wheel import wheel_packages

from vllm_dspark_pp.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]


def _dev_command_names() -> list[str]:
    import importlib
    import pkgutil

    import dspark_dev.commands as pkg

    return sorted(
        importlib.import_module(f"dspark_dev.commands.{m.name}").NAME
        for m in pkgutil.iter_modules(pkg.__path__)
    )


def test_the_checkout_command_list_names_every_dev_command():
    assert sorted(cli_main.CHECKOUT_COMMANDS) == _dev_command_names()


def test_a_checkout_runs_the_dev_command_modules():
    parser = cli_main.build_parser()
    args = parser.parse_args(["eval", "gsm8k", "--config", "x.yaml"])
    assert args._run.__module__ == "dspark_dev.commands.eval"
    args = parser.parse_args(["demo", "-pp", "3"])
    assert args._run.__module__ == "dspark_dev.commands.demo"
    assert args.pipeline_parallel_size == 3
    assert cli_main.checkout_root() == REPO


def test_without_the_checkout_dev_commands_exit_2_naming_the_fix(tmp_path):
    """Only the wheel's packages, copied to a directory (as site-packages would hold them)."""
    for pkg in wheel_packages():
        if "." not in pkg:
            shutil.copytree(
                REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__")
            )
    assert not (tmp_path / "dspark_dev").exists()
    code = (
        "import sys, vllm_dspark_pp.cli.main as m; "
        f"assert m.__file__.startswith({str(tmp_path)!r}), m.__file__; "
        "sys.exit(m.main(sys.argv[1:]))"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for argv in (["demo", "--pair", "x"], ["eval", "gsm8k", "--config", "c.yaml"]):
        p = subprocess.run(
            [sys.executable, "-c", code, *argv],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
        assert f"vllm-dspark-pp {argv[0]}: this command runs development tooling" in p.stderr
        assert "pip install -e .[dev]" in p.stderr
    p = subprocess.run(
        [sys.executable, "-c", code, "--help"], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "train-tiny-pair" in p.stdout and "make-tiny-models" in p.stdout
