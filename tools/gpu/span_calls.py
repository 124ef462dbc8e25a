#!/usr/bin/env python3
"""One long command across several device calls on the warm GPU machine.

A device call may run at most 10 minutes, and the interleaved served benchmark spends about
160 s of each call starting its servers (2026-12-06: 101-158 s for four deployments on one H100).
A process that starts its own session outlives the call that started it, until the machine goes
back (about 30 s after the last call returned; tools docs: /work/.library/device/README.md). So
one benchmark process, one start-up, can measure through several back-to-back calls:

    # call 1: start it (its own session, a hard limit), then wait like `wait`
    python3 tools/gpu/span_calls.py start goal_b --max-s 1500 --for-s 570 --copy-to $OUT -- \
        python3 -m benchmarks.serve_pp_one_gpu ... --budget-s 1440 --out {out}
    # calls 2, 3: wait for it, each up to --for-s seconds, and bring back what it wrote so far
    python3 tools/gpu/span_calls.py wait goal_b --for-s 570 --copy-to $OUT
    # if the chain must end early: stop it (its process group; nothing is left running)
    python3 tools/gpu/span_calls.py stop goal_b --copy-to $OUT

``{out}`` in the command becomes the run's own output folder (/tmp/dspark-span/NAME/out); every
``wait`` copies that folder and the command's log (``span.log``) to ``--copy-to``, so a broken
chain (the machine went back) still leaves the last call's copy. The command runs under
``timeout --kill-after=30 MAX_S``: it cannot outlive ``--max-s`` however the calls go. ``wait``
exits 0 while the command runs (it prints ``running``), else with the command's exit status
(``ended rc N``); ``stop`` sends SIGTERM to every process of the command's session, SIGKILL
30 s later (servers the command started in sessions of their own are its own to stop: the served
benchmark stops them on SIGTERM).
Nothing here reads or sets the GPU's settings. Standard library only (runs on the bare GPU
machine). Tested on the CPU: tests/unit/tools/test_span_calls.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path("/tmp/dspark-span")
KILL_AFTER_S = 30


def run_dir(name: str, root: Path) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise SystemExit(f"span_calls: bad name {name!r} (a plain folder name)")
    return root / name


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, session id) of ``pid`` from /proc, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[3])


def _alive(pid: int) -> bool:
    """Running (a zombie, finished but not yet reaped by its parent, is not)."""
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def session_members(sid: int) -> list[int]:
    """Every live process of session ``sid``: the command, ``timeout`` (which moves itself and the
    command to a process group of its own) and their children."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None and st[1] == sid and st[0] != "Z":
                out.append(int(entry.name))
    return out


def state(d: Path) -> dict:
    try:
        return json.loads((d / "state.json").read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"span_calls: no run at {d} ({e}); start it first") from e


def start(name: str, cmd: list[str], max_s: float, root: Path) -> dict:
    d = run_dir(name, root)
    if (d / "state.json").exists() and _alive(state(d)["pid"]):
        raise SystemExit(f"span_calls: {name} still runs (pid {state(d)['pid']}); stop it first")
    shutil.rmtree(d, ignore_errors=True)
    (d / "out").mkdir(parents=True)
    argv = [a.replace("{out}", str(d / "out")) for a in cmd]
    # the wrapper writes the command's exit status where `wait` finds it
    wrapper = (
        'timeout --kill-after="$1" "$2" "${@:4}"; rc=$?; echo "$rc" > "$3.tmp"; mv "$3.tmp" "$3"'
    )
    log = open(d / "span.log", "wb")  # noqa: SIM115 - the child holds it
    proc = subprocess.Popen(
        ["bash", "-c", wrapper, "span", str(KILL_AFTER_S), str(int(max_s)), str(d / "rc"), *argv],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # outlives this call; `stop` ends its session
    )
    log.close()
    st = {"pid": proc.pid, "argv": argv, "max_s": max_s, "started": time.time()}
    (d / "state.json").write_text(json.dumps(st, indent=1) + "\n")
    print(f"span_calls: started {name} (pid {proc.pid}, at most {max_s:.0f} s): {' '.join(argv)}")
    return st


def copy_back(d: Path, dest: Path | None) -> None:
    if dest is None:
        return
    dest.mkdir(parents=True, exist_ok=True)
    for f in (d / "out").rglob("*"):
        if f.is_file():
            target = dest / f.relative_to(d / "out")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)
    if (d / "span.log").exists():
        shutil.copy2(d / "span.log", dest / "span.log")


def exit_status(d: Path) -> int | None:
    try:
        return int((d / "rc").read_text().strip())
    except (OSError, ValueError):
        return None


def wait(name: str, for_s: float, dest: Path | None, root: Path) -> int:
    d = run_dir(name, root)
    st = state(d)
    end = time.monotonic() + for_s
    while exit_status(d) is None and _alive(st["pid"]) and time.monotonic() < end:
        time.sleep(1.0)
    copy_back(d, dest)
    rc = exit_status(d)
    so_far = time.time() - st["started"]
    if rc is None and _alive(st["pid"]):
        print(f"span_calls: {name} running (pid {st['pid']}, {so_far:.0f} s so far)")
        return 0
    if rc is None:
        print(f"span_calls: {name} ended without an exit status (killed?) after {so_far:.0f} s")
        return 1
    print(f"span_calls: {name} ended rc {rc} after {so_far:.0f} s")
    return rc


def stop(name: str, dest: Path | None, root: Path, grace_s: float = KILL_AFTER_S) -> int:
    d = run_dir(name, root)
    sid = state(d)["pid"]  # the wrapper started the session: its pid is the session id
    for sig, pause in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in session_members(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + pause
        while session_members(sid) and time.monotonic() < end:
            time.sleep(0.2)
        if not session_members(sid):
            break
    copy_back(d, dest)
    left = session_members(sid)
    print(f"span_calls: {name} stopped" + (f"; still running: {left}" if left else ""))
    return 1 if left else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(prog="span_calls.py", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("start", "wait", "stop"))
    ap.add_argument("name")
    ap.add_argument("--max-s", type=float, default=1500.0, help="start: hard limit (timeout)")
    ap.add_argument("--for-s", type=float, default=0.0, help="start/wait: wait this long")
    ap.add_argument("--copy-to", type=Path, default=None, help="bring the run's output here")
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.action == "start":
        if not cmd:
            raise SystemExit("span_calls start: give the command after --")
        start(a.name, cmd, a.max_s, a.root)
        return wait(a.name, a.for_s, a.copy_to, a.root)
    if cmd:
        raise SystemExit(f"span_calls {a.action}: no command expected")
    if a.action == "wait":
        return wait(a.name, a.for_s, a.copy_to, a.root)
    return stop(a.name, a.copy_to, a.root)


if __name__ == "__main__":
    sys.exit(main())
