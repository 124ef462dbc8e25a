"""The checkout commands (``demo``, ``eval``, ``train-tiny-pair``): their modules are in
``dspark_dev/commands`` (not in the wheel) and their front door is ``python -m dspark_dev`` from
the checkout root. ``vllm-dspark-pp`` imports no development code: typed there, those names exit 2
with a message naming the checkout spelling, from the wheel's packages alone and in a checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from support.wheel import wheel_packages

from dspark_dev import __main__ as dev_main
from vllm_dspark_pp.cli import main as cli_main

REPO = Path(__file__).resolve().parents[3]
# runs vllm-dspark-pp's main() on argv and fails if it imported development code
RUN_CLI = (
    "import sys, vllm_dspark_pp.cli.main as m; "
    "code = m.main(sys.argv[1:]); "
    "dev = sorted(k for k in sys.modules if k.split('.')[0] in ('dspark_dev', 'support')); "
    "assert not dev, dev; "
    "sys.exit(code)"
)


def _dev_command_names() -> list[str]:
    import importlib

    return sorted(importlib.import_module(m).NAME for m in dev_main.command_modules())


def test_the_checkout_command_list_names_every_dev_command():
    assert sorted(cli_main.CHECKOUT_COMMANDS) == _dev_command_names()


def test_the_dev_front_door_runs_the_command_modules():
    parser = dev_main.build_parser()
    args = parser.parse_args(["eval", "gsm8k", "--config", "x.yaml"])
    assert args._run.__module__ == "dspark_dev.commands.eval"
    args = parser.parse_args(["demo", "-pp", "3"])
    assert args._run.__module__ == "dspark_dev.commands.demo"
    assert args.pipeline_parallel_size == 3


def test_python_m_dspark_dev_works_from_the_checkout_root_without_pythonpath():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run(
        [sys.executable, "-m", "dspark_dev", "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "train-tiny-pair" in p.stdout and "python -m dspark_dev" in p.stdout


def _run_cli(argv: list[str], *, cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run(
        [sys.executable, "-c", RUN_CLI, *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _check_moved(tmp: Path, pythonpath: Path) -> None:
    for argv in (["demo", "--pair", "x"], ["eval", "gsm8k", "--config", "c.yaml"]):
        p = _run_cli(argv, cwd=tmp, pythonpath=pythonpath)
        assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
        assert f"vllm-dspark-pp {argv[0]}: this command runs development tooling" in p.stderr
        assert f"`python -m dspark_dev {argv[0]}`" in p.stderr


def test_in_a_checkout_the_runtime_cli_names_the_dev_front_door(tmp_path):
    """``dspark_dev`` importable (this checkout on PYTHONPATH): still not imported."""
    _check_moved(tmp_path, REPO)


def test_without_the_checkout_dev_commands_exit_2_naming_the_fix(tmp_path):
    """Only the wheel's packages, copied to a directory (as site-packages would hold them)."""
    for pkg in wheel_packages():
        if "." not in pkg:
            shutil.copytree(
                REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__")
            )
    assert not (tmp_path / "dspark_dev").exists()
    where = subprocess.run(
        [sys.executable, "-c", "import vllm_dspark_pp.cli.main as m; print(m.__file__)"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert where.stdout.startswith(str(tmp_path)), (where.stdout, where.stderr)
    _check_moved(tmp_path, tmp_path)
    p = _run_cli(["--help"], cwd=tmp_path, pythonpath=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "train-tiny-pair" in p.stdout and "make-tiny-models" in p.stdout
