"""vLLM's CPU platform from the CUDA wheel: the one copy of the environment it needs.

Used by the CPU test tiers (``tests/support/env.py``), CPU servers (:mod:`.serve`) and any
CPU engine child. ``CPU_ENGINE_EXTRA`` is what engine children get on top: a small KV cache, and
a stuck PP rank surfaces as an engine error (``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``) before any
outer deadline.
"""

from __future__ import annotations

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
CPU_ENGINE_EXTRA = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "45",
    "VLLM_ENGINE_READY_TIMEOUT_S": "120",
}

# The CPU venv of tools/setup_cpu_env.sh (CPU build of torch: no CUDA platform is possible there)
# makes vLLM's CPU platform its default, so that `.venv/bin/vllm ...` works as typed on any x86-64
# CPU (issue 24). Without VLLM_TARGET_DEVICE vLLM's CUDA wheel resolves no platform
# (vllm/platforms/__init__.py:240-292: UnspecifiedPlatform), whose import_kernels
# (platforms/interface.py:377-382) imports vllm._C: the AVX-512-BF16 build of the CPU kernel
# library (SIGILL on an AVX2-only CPU), then `vllm --help` stops with "Failed to infer device
# type" anyway. The CPU platform picks _C, _C_AVX512 or _C_AVX2 by the processor's flags
# (platforms/cpu.py:663-699) and, on x86, needs Triton, which with no GPU driver vLLM accepts
# only with CUDA_VISIBLE_DEVICES set and empty (triton_utils/importing.py:50-79); vLLM's Triton
# kernels then run in Triton's interpreter. A variable already set wins.
VENV_DEFAULTS = {
    "VLLM_TARGET_DEVICE": "cpu",
    "TRITON_INTERPRET": "1",
    "CUDA_VISIBLE_DEVICES": "",
}
VENV_PTH_NAME = "vllm_dspark_pp_cpu_venv.pth"


def venv_pth_text() -> str:
    """A ``.pth`` file (Python's ``site`` runs its ``import`` line at every start of the venv's
    interpreter, console scripts included) that sets :data:`VENV_DEFAULTS` where unset."""
    pairs = ", ".join(f"({k!r}, {v!r})" for k, v in VENV_DEFAULTS.items())
    return (
        "# vllm-dspark-pp tools/setup_cpu_env.sh: this venv has the CPU build of torch, so vLLM's\n"
        "# CPU platform is its default; variables already set win (docs/testing.md).\n"
        f"import os; [os.environ.setdefault(k, v) for k, v in ({pairs},)]\n"
    )


def write_venv_defaults(site_dir: str | None = None) -> str:
    """Write :func:`venv_pth_text` into ``site_dir`` (default: this interpreter's site-packages);
    returns the file's path."""
    import os
    import sysconfig

    path = os.path.join(site_dir or sysconfig.get_paths()["purelib"], VENV_PTH_NAME)
    with open(path, "w") as f:
        f.write(venv_pth_text())
    return path
