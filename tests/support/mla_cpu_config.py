"""The tiny Kimi-K3 targets' VllmConfigs built on vLLM's CPU platform the same way on every
x86-64 CPU, with the settings a GPU deployment has (issue 24), and the CPU answers the guard test
forces.

Why a helper: vLLM 0.34.0's CPU platform adapts an MLA target's config to the MLA kernel it would
run, and chooses that kernel by the processor:

* ``platforms/cpu.py:268-289``: the AMX MLA kernel when ``torch.cpu._is_amx_tile_supported()``
  (Intel Sapphire Rapids and later), otherwise the reference CPU MLA kernel;
* ``platforms/cpu.py:532-546``: with the reference kernel, prefix caching and chunked prefill are
  turned off (and ``platforms/cpu.py:290-297`` sets the block size to 16);
* ``platforms/cpu.py:317-335``: with AVX-512-BF16 the SSM state cache dtype becomes float32.

Kimi-K3 is hybrid (KDA + MLA). vLLM's hybrid-model hook runs first (``config/vllm.py:1483`` ->
``model_executor/models/config.py:1094-1110``) and, prefix caching being on by default
(``config/cache.py:267``), sets ``mamba_block_size`` to the block size; the platform hook comes
later (``config/vllm.py:1979``) and, without AMX, turns prefix caching off under it, so the
validator at ``config/vllm.py:3583-3594`` refuses the config: "--mamba-block-size can only be set
with --enable-prefix-caching". CI had so far run on CPUs with AMX; an AMD EPYC has none.

The configs here describe GPU deployments (prefix caching and chunked prefill on, mamba
block size = block size, the KV-cache plans a GPU engine makes); the tests only plan and inspect
them, they never run the CPU's MLA kernel. So :func:`k3_engine_config` builds them with vLLM's
MLA-kernel question answered as on an AMX CPU (the CPU on which vLLM keeps those settings), and
sets the SSM state dtype explicitly (float32, what vLLM picks with AVX-512-BF16), so that the
result is the same VllmConfig on every CPU. tests/unit/producer/test_mla_configs_on_every_cpu.py
builds them under each CPU's answers and checks it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# What vLLM 0.34.0's CPU platform reads to choose (platforms/cpu.py): AMX tiles for the MLA kernel
# (and for DeepSeek-V4's prefix caching), AVX-512-BF16 for the SSM state dtype and the kernel
# library (_C), AVX-512 for the kernel library (_C_AVX512, else _C_AVX2).
CPU_FEATURES = {
    "amx": "_is_amx_tile_supported",
    "avx512_bf16": "_is_avx512_bf16_supported",
    "avx512": "_is_avx512_supported",
}

# Processors vLLM's x86 CPU platform supports, by the answers it reads.
CPUS = {
    "intel-amx": {"amx": True, "avx512_bf16": True, "avx512": True},
    "amd-zen4-avx512": {"amx": False, "avx512_bf16": True, "avx512": True},
    "avx512-no-bf16": {"amx": False, "avx512_bf16": False, "avx512": True},
    "avx2-only": {"amx": False, "avx512_bf16": False, "avx512": False},
}


@contextlib.contextmanager
def cpu_answers(**answers: bool) -> Iterator[None]:
    """``torch.cpu``'s feature queries answer ``answers`` (keys of :data:`CPU_FEATURES`) inside the
    block; the real functions are back afterwards."""
    saved = {}
    try:
        for key, value in answers.items():
            name = CPU_FEATURES[key]
            saved[name] = getattr(torch.cpu, name)
            setattr(torch.cpu, name, lambda value=value: value)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cpu, name, fn)


# Set explicitly so that no CPU feature decides them (see the module docstring).
K3_EXPLICIT = {"mamba_ssm_cache_dtype": "float32"}


def k3_engine_args(pair, **kw):
    """``EngineArgs`` for the tiny Kimi-K3 target of ``pair`` (dummy weights, no engine)."""
    from vllm.engine.arg_utils import EngineArgs

    args = {
        "model": pair.target,
        "load_format": "dummy",
        "dtype": "bfloat16",
        "max_model_len": 256,
        "max_num_seqs": 8,
        "enforce_eager": True,
        **K3_EXPLICIT,
        **kw,
    }
    return EngineArgs(**args)


def k3_engine_config(pair, **kw):
    """The VllmConfig of a GPU deployment of the tiny Kimi-K3 target, the same on every CPU."""
    with cpu_answers(amx=True):
        return k3_engine_args(pair, **kw).create_engine_config()


def decided_by_the_cpu(cfg) -> dict:
    """The VllmConfig fields vLLM's CPU platform may set from the processor's features."""
    cache, sched = cfg.cache_config, cfg.scheduler_config
    return {
        "enable_prefix_caching": cache.enable_prefix_caching,
        "enable_chunked_prefill": sched.enable_chunked_prefill,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "block_size": cache.block_size,
        "mamba_block_size": cache.mamba_block_size,
        "mamba_cache_mode": cache.mamba_cache_mode,
        "mamba_ssm_cache_dtype": cache.mamba_ssm_cache_dtype,
    }
