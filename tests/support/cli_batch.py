"""Several ``vllm-dspark-pp`` command lines in one Python process (vLLM imported once).

A unit test file whose commands cannot affect each other (each builds fresh configs; nothing the
first call leaves in the process changes a later call's result) runs them all through
:func:`run_cli_batch`, once per module, instead of paying vLLM's import (5-8 s on the 2-core CI
machine) per command. Each result is a ``subprocess.CompletedProcess`` with what that call alone
wrote to file descriptors 1 and 2 (vLLM's logger included: it writes to the process's stdout), so
the tests assert on it exactly as on a process of their own. What needs a pristine process
(plugin loading, patch application, the version gate, environment read at import) stays a
subprocess of its own, and each batched command keeps at least one test through the real
``python -m vllm_dspark_pp.cli.main`` entry point.

Run as a module from the checkout root with ``tests`` on ``PYTHONPATH``: ``python -m
support.cli_batch CALLS.json RESULTS.json`` (so this checkout comes first, as in pytest's
``pythonpath``, and tests/support's module names never shadow packages); CALLS is a list of argv
lists for ``vllm_dspark_pp.cli.main.main``; RESULTS gets one object per call (argv, returncode,
stdout, stderr) plus the file of the ``vllm_dspark_pp`` package that ran them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _exit_status(code) -> int:
    """The status a process ends with after ``raise SystemExit(code)`` (as Python reports it)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # Python prints a non-integer code and exits 1
    return 1


def _run_one(main, argv: list[str]) -> dict:
    """``main(argv)`` with fds 1 and 2 redirected to files of their own for the call."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            try:
                status = int(main(argv) or 0)
            except SystemExit as exc:
                status = _exit_status(exc.code)
            except BaseException:  # an uncaught exception: traceback on stderr, exit 1
                traceback.print_exc()
                status = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
    return {"argv": argv, "returncode": status, "stdout": texts[0], "stderr": texts[1]}


def run_cli_batch(calls: list[list[str]], *, timeout: float, tmp_dir: Path):
    """Run every argv of ``calls`` through ``vllm_dspark_pp.cli.main.main`` in one child process
    (in its own process group, killed at ``timeout``); one ``CompletedProcess`` per call, in
    order. Raises when the child itself fails (it should never: each call's failure is its
    result) or ran another ``vllm_dspark_pp`` than this process imports."""
    import vllm_dspark_pp
    from dspark_dev.proc import run_with_timeout

    calls_file = tmp_dir / "cli_calls.json"
    results_file = tmp_dir / "cli_results.json"
    calls_file.write_text(json.dumps(calls))
    cmd = [sys.executable, "-m", "support.cli_batch", str(calls_file), str(results_file)]
    paths = [str(REPO / "tests"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    code, out, err = run_with_timeout(cmd, timeout=timeout, env=env, cwd=str(REPO), capture=True)
    if code != 0 or not results_file.exists():
        raise RuntimeError(f"cli_batch driver exited {code}:\n{(out + err)[-3000:]}")
    results = json.loads(results_file.read_text())
    assert results["package"] == vllm_dspark_pp.__file__, (results["package"], vllm_dspark_pp)
    assert [r["argv"] for r in results["calls"]] == calls
    return [
        subprocess.CompletedProcess(r["argv"], r["returncode"], r["stdout"], r["stderr"])
        for r in results["calls"]
    ]


def _main(calls_path: str, results_path: str) -> int:
    import vllm_dspark_pp
    from vllm_dspark_pp.cli.main import main

    calls = json.loads(Path(calls_path).read_text())
    results = [_run_one(main, argv) for argv in calls]
    Path(results_path).write_text(
        json.dumps({"package": vllm_dspark_pp.__file__, "calls": results})
    )
    return 0


if __name__ == "__main__":
    sys.exit(_main(*sys.argv[1:]))
