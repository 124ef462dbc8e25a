"""CUDA MPS around a one-GPU PP benchmark (issue 44 item 2). **Not yet run on a GPU.**

Two PP stages on one GPU (benchmarks/serve_pp_one_gpu.py's ``shared`` layout) are two CUDA
contexts that the GPU time-slices. Under MPS (NVIDIA's Multi-Process Service) their kernels can
run side by side, each launcher's process limited to its share of the SMs by
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``. :class:`MpsDaemon` runs the control daemon for one command:

* start: ``nvidia-cuda-mps-control -d`` with ``CUDA_MPS_PIPE_DIRECTORY`` and
  ``CUDA_MPS_LOG_DIRECTORY`` under a fresh folder in /tmp (never the default /tmp/nvidia-mps, so
  no process without those two variables attaches to it), then a probe: one small CUDA client
  (``torch.zeros(1, device="cuda")``) with the same variables must attach within
  ``timeout_s``;
* stop: ``quit`` written to ``nvidia-cuda-mps-control``'s standard input, same variables;
  the caller runs it in a ``finally`` (the driver also turns SIGTERM into an exit so the
  ``finally`` runs);
* never: the GPU's compute mode (``nvidia-smi -c``), a reset, or any other device setting. MPS
  works in the default compute mode; processes outside MPS keep time-slicing with it.

When MPS cannot start (the binary is not on PATH, it exits non-zero, e.g. for want of
permission, or the probe cannot attach) :meth:`MpsDaemon.start` returns False with the reason in
``problem`` and leaves nothing running; the caller then runs without MPS and records why.

Each launcher that should run under MPS gets :func:`stage_env`'s variables (the two folders and
its thread percentage); vLLM's engine processes inherit them from their launcher.

    python -m benchmarks.mps 50,50     # start, probe, print the per-stage env, stop
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
SHARE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PROBE = [
    sys.executable,
    "-c",
    "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize(); print('mps probe ok')",
]


def parse_percentages(text: str) -> list[int]:
    """``--mps 50,50``: one thread percentage per PP stage, each 1..100."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or not all(1 <= v <= 100 for v in vals):
        raise SystemExit(f"--mps {text!r}: one percentage (1-100) per PP stage, e.g. 50,50")
    return vals


def client_env(pipe_dir: str | Path, log_dir: str | Path) -> dict:
    """What a process needs to reach this daemon (and no other)."""
    return {PIPE_ENV: str(pipe_dir), LOG_ENV: str(log_dir)}


def stage_env(percentages: list[int], pipe_dir: str | Path, log_dir: str | Path) -> dict:
    """``env_per_rank`` of dspark_dev/pp_launch.deployment: launcher R gets the daemon's folders
    and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` = ``percentages[R]``."""
    base = client_env(pipe_dir, log_dir)
    return {r: {**base, SHARE_ENV: str(p)} for r, p in enumerate(percentages)}


def _tail(path: Path, n: int = 15) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


@dataclass
class MpsDaemon:
    """One MPS control daemon, its folders under ``root`` (default: a new /tmp folder)."""

    root: Path | None = None
    binary: str = CONTROL
    probe: list[str] | None = field(default_factory=lambda: list(PROBE))
    timeout_s: float = 60.0
    started: bool = False
    used: bool = False  # started and probed: the launchers ran under it
    problem: str | None = None
    stop_outcome: str | None = None

    def __post_init__(self) -> None:
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="dspark-mps-", dir="/tmp"))
        self.root = Path(self.root)

    @property
    def pipe_dir(self) -> Path:
        assert self.root is not None
        return self.root / "pipe"

    @property
    def log_dir(self) -> Path:
        assert self.root is not None
        return self.root / "log"

    def env(self) -> dict:
        return client_env(self.pipe_dir, self.log_dir)

    def commands(self) -> list[str]:
        """The shell spelling of what :meth:`start` and :meth:`stop` run (for --dry-run)."""
        pre = f"{PIPE_ENV}={self.pipe_dir} {LOG_ENV}={self.log_dir}"
        return [
            f"{pre} {self.binary} -d",
            "probe: " + (" ".join(self.probe) if self.probe else "(none)"),
            f"echo quit | {pre} {self.binary}",
        ]

    def _run(self, argv: list[str], stdin: str | None, out_name: str) -> tuple[int | None, str]:
        """Run ``argv`` with the daemon's variables, output to a file (``-d`` forks a daemon
        that may keep inherited pipes open: never capture through a pipe). Returns (exit code or
        None on timeout, the output's last lines)."""
        out = self.log_dir / out_name
        with open(out, "w") as f:
            try:
                rc: int | None = subprocess.run(
                    argv, input=stdin, text=True, stdout=f, stderr=subprocess.STDOUT,
                    env={**os.environ, **self.env()}, timeout=self.timeout_s,
                    start_new_session=True,
                ).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                rc = None
            except OSError as e:
                f.write(f"{type(e).__name__}: {e}\n")
                rc = 126
        return rc, " | ".join(_tail(out, 6))

    def start(self) -> bool:
        """Start the daemon and probe it; False (and ``problem``) when MPS is not usable here."""
        path = shutil.which(self.binary)
        if path is None:
            self.problem = f"{self.binary} not found on PATH: running without MPS"
            return False
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        rc, said = self._run([path, "-d"], None, "start.out")
        if rc != 0:
            why = "timed out" if rc is None else f"exit {rc}"
            self.problem = (
                f"{self.binary} -d failed ({why}; permission to run MPS here?): {said or '-'}; "
                f"control.log: {' | '.join(_tail(self.log_dir / 'control.log', 4)) or '-'}; "
                "running without MPS"
            )
            return False
        self.started = True
        if self.probe:
            rc, said = self._run(list(self.probe), None, "probe.out")
            if rc != 0:
                why = "timed out" if rc is None else f"exit {rc}"
                self.problem = (
                    f"the MPS daemon started but a CUDA client could not attach ({why}): "
                    f"{said or '-'}; control.log: "
                    f"{' | '.join(_tail(self.log_dir / 'control.log', 4)) or '-'}; "
                    "daemon stopped, running without MPS"
                )
                self.stop()
                return False
        self.used = True
        return True

    def stop(self) -> str | None:
        """``quit`` to the daemon (only if :meth:`start` started it); returns what happened."""
        if not self.started:
            return None
        path = shutil.which(self.binary) or self.binary
        rc, said = self._run([path], "quit\n", "stop.out")
        self.started = False
        time.sleep(0.5)  # the daemon ends its servers after the command returns
        self.stop_outcome = "quit sent" if rc == 0 else f"quit failed (exit {rc}): {said or '-'}"
        return self.stop_outcome

    def record(self, percentages: list[int] | None = None) -> dict:
        """What the result JSON says about MPS."""
        return {
            "requested": percentages,
            "used": self.used,
            "problem": self.problem,
            "pipe_dir": str(self.pipe_dir),
            "stop": self.stop_outcome,
            "control_log_tail": _tail(self.log_dir / "control.log"),
            "tested_on_gpu": False,
        }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    shares = parse_percentages(args[0] if args else "50,50")
    daemon = MpsDaemon()
    try:
        ok = daemon.start()
        print(f"MPS {'started' if ok else 'not used'}: {daemon.problem or 'probe attached'}")
        if ok:
            for rank, env in stage_env(shares, daemon.pipe_dir, daemon.log_dir).items():
                print(f"stage {rank}: " + " ".join(f"{k}={v}" for k, v in sorted(env.items())))
    finally:
        print(f"stop: {daemon.stop()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
