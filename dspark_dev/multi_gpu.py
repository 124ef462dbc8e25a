"""Shared pieces of the several-GPU scripts (tools/gpu/run_pp2_aggregated.py, run_pd_pp2.py,
benchmarks/serve_pp.py; once tests/multi_gpu/mg_common.py).

* the one-GPU helpers (tests/support: run_llm, run_pd, parity; dspark_dev: Server) are
  reused as they are;
* :class:`Report` collects result rows, tees a log file and prints the short table LAST;
* :class:`NcclStubGuard`: the GPU kit stubs the NCCL symbols the machine's NCCL lacks (boot.sh:
  each returns ncclInvalidUsage). The guard builds a *loud* copy of that stub (same symbols, each
  also appends its name to a file) and preloads it in every child instead of the silent one, so
  any call of a stubbed function is recorded, then greps the logs for NCCL errors as well;
* :func:`guarded_env`: that guard, built, and the children's environment (NVLink multicast off
  plus the guard's preload), the one copy the several-GPU scripts use.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NCCL_ERROR = re.compile(
    r"ncclInvalidUsage|NCCL error|invalid usage \(run with NCCL_DEBUG=WARN|ncclSystemError", re.I
)


def gpu_count() -> int:
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30
        ).stdout
        return sum(1 for line in out.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.TimeoutExpired):
        return 0


@dataclass
class Row:
    check: str
    outcome: str  # PASS / FAIL / SKIP / INFO
    detail: str = ""


@dataclass
class Report:
    title: str
    log_path: Path
    rows: list[Row] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    def __post_init__(self):
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "a")

    def log(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - self.t0:5.0f}s] {msg}"
        print(line, flush=True)
        self._log.write(line + "\n")
        self._log.flush()

    def add(self, check: str, outcome: str, detail: str = "") -> None:
        self.rows.append(Row(check, outcome, detail))
        self.log(f"{outcome}: {check}: {detail}")

    def table(self) -> str:
        w = min(max([len(r.check) for r in self.rows] + [5]), 60)
        lines = [f"== {self.title} ==", f"{'result':<6}  {'check':<{w}}  detail", "-" * (w + 24)]
        for r in self.rows:
            lines.append(f"{r.outcome:<6}  {r.check[:w]:<{w}}  {r.detail[:160]}")
        n = {k: sum(r.outcome == k for r in self.rows) for k in ("PASS", "FAIL", "SKIP")}
        lines.append(
            f"TOTAL pass {n['PASS']} fail {n['FAIL']} skip {n['SKIP']}, "
            f"wall {time.monotonic() - self.t0:.0f} s, "
            f"log {self.log_path}"
        )
        return "\n".join(lines)

    def finish(self) -> int:
        text = self.table()
        self._log.write(text + "\n")
        self._log.close()
        print("\n" + text, flush=True)
        failed = any(r.outcome == "FAIL" for r in self.rows)
        passed = any(r.outcome == "PASS" for r in self.rows)
        return 0 if passed and not failed else 1


LOUD_STUB_C = r"""
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static void dspark_note(const char *name) {
  const char *path = getenv("DSPARK_NCCL_STUB_LOG");
  int fd = path ? open(path, O_WRONLY | O_CREAT | O_APPEND, 0644) : 2;
  if (fd < 0) fd = 2;
  write(fd, "DSPARK_NCCL_STUB_CALLED ", 24);
  write(fd, name, strlen(name));
  write(fd, "\n", 1);
  if (fd != 2) close(fd);
}
"""


class NcclStubGuard:
    """Preload a recording copy of the kit's NCCL stub; report which stubbed symbols were called."""

    def __init__(self, work_dir: Path, site: str = os.environ.get("DSPARK_SITE", "/tmp/site")):
        self.work_dir = Path(work_dir)
        self.site = Path(site)
        self.log = self.work_dir / "nccl_stub_calls.txt"
        self.symbols: list[str] = []
        self.so: Path | None = None
        self.problem: str | None = None

    def _symbols(self) -> list[str]:
        c = Path("/tmp/nccl_stub.c")  # written by boot.sh
        if c.exists():
            return re.findall(r"int (\w+)\(void\)", c.read_text())
        need = subprocess.run(
            f"nm -D --undefined-only {self.site}/torch/lib/libtorch_cuda.so | awk '{{print $2}}' "
            f"| grep '^nccl' | sort -u",
            shell=True, capture_output=True, text=True,
        ).stdout.split()  # fmt: skip
        sp = subprocess.run(
            [sys.executable, "-c", "import site;print(site.getsitepackages()[0])"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        have = subprocess.run(
            f"nm -D --defined-only {sp}/nvidia/nccl/lib/libnccl.so.2 | awk '{{print $3}}' | sort "
            f"-u",
            shell=True, capture_output=True, text=True,
        ).stdout.split()  # fmt: skip
        return sorted(set(need) - set(have))

    def build(self) -> NcclStubGuard:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.symbols = self._symbols()
        except Exception as e:  # noqa: BLE001
            self.problem = f"could not list the stubbed NCCL symbols: {e}"
            return self
        if not self.symbols:
            self.problem = "no stubbed NCCL symbols found (not the GPU kit?): nothing to guard"
            return self
        src = self.work_dir / "nccl_stub_loud.c"
        body = "".join(f'int {s}(void){{dspark_note("{s}"); return 5;}}\n' for s in self.symbols)
        src.write_text(LOUD_STUB_C + body)
        so = self.work_dir / "libnccl_stub_loud.so"
        proc = subprocess.run(
            ["gcc", "-shared", "-fPIC", "-O2", "-o", str(so), str(src)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            self.problem = f"gcc failed: {proc.stderr[-500:]}"
            return self
        self.so = so
        self.log.write_text("")
        return self

    def env(self) -> dict:
        """Environment for a child: the loud stub replaces the kit's silent one in LD_PRELOAD."""
        if self.so is None:
            return {}
        pre = [
            p for p in os.environ.get("LD_PRELOAD", "").split(":") if p and "libnccl_stub" not in p
        ]
        return {"LD_PRELOAD": ":".join([str(self.so), *pre]), "DSPARK_NCCL_STUB_LOG": str(self.log)}

    def calls(self) -> list[str]:
        if not self.log.exists():
            return []
        return sorted(
            {
                line.split()[1]
                for line in self.log.read_text().splitlines()
                if line.startswith("DSPARK_NCCL_STUB_CALLED")
            }
        )

    def check(self, report: Report, logs: list[str] = ()) -> None:
        if self.problem:
            report.add("no run reaches the kit's NCCL stubs", "SKIP", self.problem)
            return
        called = self.calls()
        errors = sorted({m.group(0) for text in logs for m in NCCL_ERROR.finditer(text)})
        if called or errors:
            report.add(
                "no run reaches the kit's NCCL stubs",
                "FAIL",
                f"stubbed functions called: {called}; NCCL errors in logs: {errors}",
            )
        else:
            report.add(
                "no run reaches the kit's NCCL stubs",
                "PASS",
                f"{len(self.symbols)} stubbed symbols, none called, no NCCL errors",
            )


# NVLink multicast off in NCCL, torch symmetric memory and NVSHMEM (the machines lend GPUs without
# it: see the device notes the GPU kit follows).
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def guarded_env() -> tuple[NcclStubGuard, dict]:
    """A built :class:`NcclStubGuard` in a fresh temporary folder, and the environment every child
    of a several-GPU run gets: multicast off and the guard's loud stub."""
    guard = NcclStubGuard(Path(tempfile.mkdtemp(prefix="dspark-nccl-"))).build()
    return guard, {**NO_MULTICAST_ENV, **guard.env()}
