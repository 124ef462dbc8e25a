"""tools/gpu/span_calls.py on CPU, as the GPU machine runs it (separate processes per call): a
command started in one call outlives it, later calls wait for it and bring back what it wrote so
far, its exit status comes back at the end, ``stop`` and the hard limit end it with nothing left
running, and a second start while it runs is refused."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]
SCRIPT = REPO / "tools" / "gpu" / "span_calls.py"

# writes tick files into {out}, one per 0.3 s, then exits with the status given
TICKER = (
    "import sys, time, pathlib\n"
    "out = pathlib.Path(sys.argv[1]); n = int(sys.argv[2])\n"
    "for i in range(n):\n"
    "    (out / f'tick{i}.txt').write_text(str(i)); print('tick', i, flush=True); time.sleep(0.3)\n"
    "sys.exit(int(sys.argv[3]))\n"
)


def call(root: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """One 'device call': a fresh process running the script, as the lent machine does."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _start_args(name: str, *cmd: str, for_s: float, copy: Path, max_s: float = 60) -> list[str]:
    return ["start", name, "--max-s", str(max_s), "--for-s", str(for_s), "--copy-to", str(copy),
            "--", *cmd]  # fmt: skip


def _alive(pid: int) -> bool:
    """Running: not gone and not a zombie waiting for its parent to reap it."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] != "Z"


def test_a_command_spans_calls_and_its_status_comes_back(tmp_path):
    root, c1, c2 = tmp_path / "span", tmp_path / "call1", tmp_path / "call2"
    t0 = time.monotonic()
    cmd = [sys.executable, "-c", TICKER, "{out}", "10", "3"]
    first = call(root, *_start_args("run", *cmd, for_s=1.0, copy=c1))
    assert first.returncode == 0 and "running" in first.stdout, first.stdout + first.stderr
    pid = json.loads((root / "run" / "state.json").read_text())["pid"]
    assert _alive(pid)  # the 'call' returned, the command goes on
    assert 1 <= len(list(c1.glob("tick*.txt"))) < 10  # what it had written by then came back
    second = call(root, "wait", "run", "--for-s", "20", "--copy-to", str(c2))
    assert second.returncode == 3 and "ended rc 3" in second.stdout  # the command's own status
    assert sorted(p.name for p in c2.glob("tick*.txt")) == [f"tick{i}.txt" for i in range(10)]
    assert "tick 9" in (c2 / "span.log").read_text()
    assert time.monotonic() - t0 < 30 and not _alive(pid)


def test_stop_ends_the_command_and_its_children(tmp_path):
    """Every process of the command's session: signalling the wrapper's process group alone (the
    first version) left ``timeout``'s group, and this sleep, running."""
    root = tmp_path / "span"
    # a child that would outlive its parent if only the parent were signalled
    cmd = ["bash", "-c", "sleep 300 & echo child $! ; wait"]
    first = call(root, *_start_args("long", *cmd, for_s=1.0, copy=tmp_path / "c1"))
    assert first.returncode == 0
    log = (root / "long" / "span.log").read_text()
    child = int(log.split("child ")[1].split()[0])
    assert _alive(child)
    t0 = time.monotonic()
    done = call(root, "stop", "long", "--copy-to", str(tmp_path / "c2"))
    assert done.returncode == 0 and "stopped" in done.stdout
    time.sleep(0.5)
    assert not _alive(child) and time.monotonic() - t0 < 45
    waited = call(root, "wait", "long")
    assert waited.returncode != 0 and "ended" in waited.stdout


def test_the_hard_limit_ends_a_command_nobody_waits_for(tmp_path):
    root = tmp_path / "span"
    first = call(root, *_start_args("stuck", "sleep", "300", for_s=0.0, copy=tmp_path / "c",
                                    max_s=2))  # fmt: skip
    assert first.returncode == 0
    end = call(root, "wait", "stuck", "--for-s", "20")
    assert end.returncode == 124 and "ended rc 124" in end.stdout  # timeout's status


def test_a_second_start_while_it_runs_is_refused_and_bad_use_says_why(tmp_path):
    root = tmp_path / "span"
    first = call(root, *_start_args("one", "sleep", "30", for_s=0.0, copy=tmp_path / "c"))
    assert first.returncode == 0
    again = call(root, *_start_args("one", "sleep", "1", for_s=0.0, copy=tmp_path / "c"))
    assert again.returncode != 0 and "still runs" in again.stderr
    assert call(root, "stop", "one", timeout=60).returncode == 0
    none = call(root, "wait", "never-started")
    assert none.returncode != 0 and "start it first" in none.stderr
    bad = call(root, "start", "../up", "--", "true")
    assert bad.returncode != 0 and "bad name" in bad.stderr
    assert call(root, "start", "x").returncode != 0  # no command


@pytest.fixture(autouse=True)
def _nothing_left(tmp_path):
    yield
    for st in (tmp_path / "span").glob("*/state.json"):
        call(tmp_path / "span", "stop", st.parent.name)
