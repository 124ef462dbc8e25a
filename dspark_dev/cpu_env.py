"""vLLM's CPU platform from the CUDA wheel: the one copy of the environment it needs.

Used by the CPU test tiers (``tests/support/env.py``), the demo (:mod:`.serve_demo`) and any
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
