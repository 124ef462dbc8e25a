"""CPU platform variables for the GSM8K gate's vLLM subprocesses (when no GPU is visible)."""

import os

if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    for k, v in {"VLLM_TARGET_DEVICE": "cpu", "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
                 "VLLM_CPU_OMP_THREADS_BIND": "nobind"}.items():
        os.environ.setdefault(k, v)
