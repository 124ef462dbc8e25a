"""The quick start's venv runs ``vllm ...`` as typed, on any x86-64 CPU (issue 24).

tools/setup_cpu_env.sh makes vLLM's CPU platform that venv's default (a ``.pth`` file written by
``dspark_dev.cpu_env.write_venv_defaults``). Without it ``.venv/bin/vllm --help`` resolves
no platform: exit 1 ("Failed to infer device type") on a CPU with AVX-512-BF16, SIGILL (exit 132)
on an AVX2-only CPU, whose flags these tests cannot have; the second test checks, with the
processor's answers simulated, which kernel library each path would load.

These run the interpreter of the venv the tests run in (``sys.executable``: CI and
``tools/run_tests.sh`` use the quick start's ``.venv``) with every CPU variable removed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.mla_cpu_config import CPUS

from dspark_dev import cpu_env

BIN = Path(sys.executable).parent


def _user_env() -> dict:
    """The environment of a user's shell: none of the CPU variables the test tiers set."""
    unset = {*cpu_env.CPU_ENV, *cpu_env.CPU_ENGINE_EXTRA, *cpu_env.VENV_DEFAULTS}
    return {k: v for k, v in os.environ.items() if k not in unset and not k.startswith("VLLM_")}


def test_vllm_help_exits_0_in_the_venv_without_cpu_variables():
    assert (BIN / "vllm").exists(), f"no vllm command beside {sys.executable}"
    proc = subprocess.run(
        [str(BIN / "vllm"), "--help"],
        env=_user_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, f"exit {proc.returncode} (132 = SIGILL):\n{tail}"
    assert "serve" in proc.stdout, tail


# Runs in the venv's interpreter with the user's environment: which platform vLLM resolves, and
# which kernel library module each platform's import_kernels() would import for each processor
# (the imports are intercepted: nothing is loaded, so no SIGILL whatever the answers).
_PROBE = r"""
import importlib.abc, importlib.machinery, json, os, sys, types
import torch

imported = []

class Intercept(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name in ("vllm._C", "vllm._C_AVX512", "vllm._C_AVX2"):
            return importlib.machinery.ModuleSpec(name, self)
        return None
    def create_module(self, spec):
        imported.append(spec.name)
        return types.ModuleType(spec.name)
    def exec_module(self, module):
        pass

from vllm.platforms import resolve_current_platform_cls_qualname
from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import UnspecifiedPlatform

out = {"env": os.environ.get("VLLM_TARGET_DEVICE"),
       "platform": resolve_current_platform_cls_qualname(),
       "already_loaded": sorted(m for m in sys.modules if m.startswith("vllm._C"))}
sys.meta_path.insert(0, Intercept())
for cpu, answers in json.loads(sys.argv[1]).items():
    torch.cpu._is_amx_tile_supported = lambda a=answers: a["amx"]
    torch.cpu._is_avx512_bf16_supported = lambda a=answers: a["avx512_bf16"]
    torch.cpu._is_avx512_supported = lambda a=answers: a["avx512"]
    for platform in (CpuPlatform, UnspecifiedPlatform):
        for m in [m for m in sys.modules if m.startswith("vllm._C")]:
            del sys.modules[m]
        imported.clear()
        platform.import_kernels()
        out[f"{cpu}/{platform.__name__}"] = [m for m in imported if m.startswith("vllm._C")]
print("PROBE", json.dumps(out))
"""


def test_the_venv_default_platform_loads_the_kernel_library_of_the_processor():
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(CPUS)],
        env=_user_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-3000:]
    out = json.loads(lines[-1][len("PROBE ") :])
    # The venv's default (the .pth), honoured by vLLM's platform resolution.
    assert out["env"] == "cpu"
    assert out["platform"] == "vllm.platforms.cpu.CpuPlatform"
    assert out["already_loaded"] == []
    # vLLM's CPU platform matches the library to the processor; AVX2-only gets _C_AVX2.
    assert out["intel-amx/CpuPlatform"] == ["vllm._C"]
    assert out["amd-zen4-avx512/CpuPlatform"] == ["vllm._C"]
    assert out["avx512-no-bf16/CpuPlatform"] == ["vllm._C_AVX512"]
    assert out["avx2-only/CpuPlatform"] == ["vllm._C_AVX2"]
    # No platform (what the venv gave before issue 24): _C, the AVX-512-BF16 build, on every CPU.
    assert {out[f"{cpu}/UnspecifiedPlatform"][0] for cpu in CPUS} == {"vllm._C"}
