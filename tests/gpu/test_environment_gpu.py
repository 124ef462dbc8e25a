"""First and cheapest: what the GPU machine runs (printed into the log), and the plugin's entry
point.

The facts test also launches the session's background engine jobs (conftest.gpu_jobs), so that
the kernel tests run while the engines start. Whether the plugin is applied inside a real vLLM
worker is checked by test_e2e_parity_gpu.py::test_plugin_is_applied_inside_the_vllm_worker.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import subprocess
import sys
import textwrap

import pytest
from gpu_common import require_cuda

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]


def test_environment_facts(request):
    require_cuda()
    import torch

    facts = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch.version.cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
        "device_count": torch.cuda.device_count(),
        "LD_PRELOAD": os.environ.get("LD_PRELOAD", ""),
        "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER"),
    }
    try:
        import triton

        facts["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        facts["triton"] = f"not importable: {e}"
    try:
        facts["mooncake-transfer-engine"] = md.version("mooncake-transfer-engine-cuda13")
    except md.PackageNotFoundError:
        facts["mooncake-transfer-engine"] = "absent"
    import vllm

    facts["vllm"] = vllm.__version__
    import vllm_dspark_pp

    facts["vllm_dspark_pp"] = f"{vllm_dspark_pp.__version__} from {vllm_dspark_pp.__file__}"
    for k, v in facts.items():
        print(f"FACT {k}: {v}")
    # launch the engines now (they run while the kernel tests do); a missing piece skips only them
    try:
        request.getfixturevalue("gpu_jobs")
        print("FACT background engine jobs: launched")
    except pytest.skip.Exception as e:
        print(f"FACT background engine jobs: not launched ({e})")
    assert facts["vllm"] == "0.34.0", "the plugin supports vLLM 0.34.0 only"
    # a tiny matmul proves the CUDA libraries behind torch work (cuBLAS from the machine's CUDA 13)
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    assert torch.isfinite((a @ a).float()).all()


def test_plugin_entry_point_is_installed():
    eps = {e.name: e.value for e in md.entry_points(group="vllm.general_plugins")}
    assert eps.get("dspark_pp") == "vllm_dspark_pp:register", (
        f"vllm.general_plugins entry points: {eps}. Install the project on the GPU machine: "
        "python3 -m pip install -q --no-deps --no-index --no-build-isolation --target /tmp/site ."
    )


def test_vllm_plugin_loader_applies_every_patch_in_a_fresh_process():
    require_cuda()
    code = textwrap.dedent(
        """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm_dspark_pp.patches import applied_patches, registry
        names = [p.name for p in registry()]
        assert applied_patches() == names, (applied_patches(), names)
        print("APPLIED", len(names), names)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    print(proc.stdout.strip())
    assert proc.returncode == 0, out[-4000:]
    assert "APPLIED" in proc.stdout
