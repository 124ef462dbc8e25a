"""The CPU test environment, the device mode and the CPU kernel library check.

On a machine without an NVIDIA GPU (or with ``DSPARK_PP_TEST_DEVICE=cpu``) tests/conftest.py puts
:data:`CPU_ENV` into ``os.environ`` before anything imports vLLM; the e2e runner always gives its
children :data:`CPU_ENV` plus :data:`CPU_E2E_EXTRA`. On a GPU machine nothing is set.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

from dspark_dev import cpu_env as _dev_cpu_env

# The one copy lives in the package's dev tooling (the demo uses it too); the CPU e2e tier gives
# its engine children CPU_ENV + CPU_E2E_EXTRA.
CPU_ENV = _dev_cpu_env.CPU_ENV
# ... with one OpenMP thread per engine process: the e2e tier runs two engines at a time on the
# 2-core CI machine, each with one to three workers, and at torch's default (one thread per core)
# their OpenMP threads outnumber the cores. Measured 2026-12-06 on the 2-core machine, the pool's
# files and the launcher tests, interleaved (default, 1 thread): 434 / 404 s, 387 / 338 s; the
# shared-run pool 307 / 274 s, 278 / 224 s (docs/testing.md, "Durations"). `vllm serve` launchers
# keep the default: the four-launcher test took 91 / 96 s and 74 / 79 s.
CPU_E2E_EXTRA = {**_dev_cpu_env.CPU_ENGINE_EXTRA, "OMP_NUM_THREADS": "1"}


def test_device() -> str:
    forced = os.environ.get("DSPARK_PP_TEST_DEVICE", "auto").lower()
    if forced in ("cpu", "gpu"):
        return forced
    return "gpu" if glob.glob("/dev/nvidia[0-9]*") else "cpu"


_CPU_KERNEL_CHECK = r"""
import glob, os, sys
import vllm
site = os.path.dirname(vllm.__file__)
libs = sorted(os.path.basename(p) for p in glob.glob(os.path.join(site, "_C*.abi3.so")))
if not libs:
    print("no vllm/_C*.abi3.so next to vLLM in " + site); sys.exit(3)
import torch
from vllm.platforms import current_platform
if not current_platform.is_cpu():
    print("vLLM did not select its CPU platform (VLLM_TARGET_DEVICE=cpu ignored?)"); sys.exit(4)
current_platform.import_kernels()
needed = ("cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache")  # vllm/_cpu_ops.py
missing = [n for n in needed if not hasattr(torch.ops._C, n)]
if missing:
    print("loaded " + ", ".join(libs) + " but torch.ops._C lacks " + ", ".join(missing))
    sys.exit(5)
print("ok: %s (CPU attention ops registered)" % ", ".join(libs))
"""

_cpu_kernels: tuple[bool, str] | None = None


def cpu_kernels_status() -> tuple[bool, str]:
    """(usable, message) for vLLM's CPU kernel library, checked once in a fresh subprocess."""
    global _cpu_kernels
    if _cpu_kernels is None:
        env = {**os.environ, **CPU_ENV}
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _CPU_KERNEL_CHECK],
                env=env,
                capture_output=True,
                text=True,
                timeout=180,
            )
            lines = (proc.stdout.strip() or proc.stderr.strip() or "no output").splitlines()
            _cpu_kernels = (proc.returncode == 0, lines[-1])
        except subprocess.TimeoutExpired:
            _cpu_kernels = (False, "the kernel check timed out after 180 s")
    return _cpu_kernels


def set_cpu_env_defaults() -> None:
    """Put :data:`CPU_ENV` into ``os.environ`` where a variable is not set yet (tiers that always
    run on the CPU, in process, even on a GPU machine: protocol and producer unit tests)."""
    for k, v in CPU_ENV.items():
        os.environ.setdefault(k, v)
