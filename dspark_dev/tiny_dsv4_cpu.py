"""The tiny DeepSeek-V4 GPU target (``tiny_mla_targets.make_tiny_dsv4_pair(gpu=True)``) built on
CPU, for the KV-cache planning and MoE router checks: vLLM's CUDA model classes constructed with
their CUDA-only constructor calls stood in for, then the per-layer KV-cache specs its layers
register.

Needs the ``plugin`` and ``dist_env`` fixtures of tests/unit/producer (a one-process world).
"""

from __future__ import annotations

import torch


def engine_config(pair, **kw):
    """A real VllmConfig for the pair's target (dummy weights, no engine started); ``kw``: more
    engine arguments, or other values of these."""
    from vllm.engine.arg_utils import EngineArgs

    args = dict(
        model=pair.target,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=8,
        enforce_eager=True,
    )
    args.update(kw)
    return EngineArgs(**args).create_engine_config()


def construct_on_cpu(cfg, cls, monkeypatch, *, cuda_router: bool = False):
    """Construct a DeepSeek-V4 model class of vLLM's CUDA implementation (the target, or the
    DSpark drafter) into ``cfg`` on CPU, with a fresh layer registry; returns the model.

    ``cuda_router``: vLLM's MoE router factory answers as on a CUDA platform. Its only platform
    question is ``is_cpu`` (on CPU it picks the all-schemes CPURouter before anything else), so
    every MoE layer gets the router class a CUDA engine builds for the same config."""
    import vllm.model_executor.layers.fused_moe.router.router_factory as router_factory
    import vllm.models.deepseek_v4.nvidia.flashmla as flashmla
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    cfg.compilation_config.static_forward_context = {}
    with monkeypatch.context() as m, set_current_vllm_config(cfg), torch.device("cpu"):
        if parallel_state._EP is None:  # dist_env's world was set up for a dense model
            m.setattr(parallel_state, "_EP", parallel_state.get_tp_group())  # one rank: same
        # Construction only: an aux stream and events (used to overlap work at run time) and the
        # fp8 einsum recipe (reads the CUDA capability) are the constructor's CUDA calls.
        m.setattr(torch.cuda, "Stream", lambda *a, **k: None)
        m.setattr(torch.cuda, "Event", lambda *a, **k: None)
        m.setattr(flashmla, "compute_fp8_einsum_recipe", lambda: (None, False))
        if cuda_router:
            m.setattr(router_factory, "current_platform", _NotCpu(router_factory.current_platform))
        return cls(vllm_config=cfg, prefix="")


class _NotCpu:
    """The platform with ``is_cpu()`` answering False; every other answer is the real one's."""

    def __init__(self, real):
        self._real = real

    def is_cpu(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._real, name)


def build_dsv4_target(cfg, monkeypatch) -> dict:
    """Construct the DeepSeek-V4 target into ``cfg`` (its layers land in the config's static
    forward context) and return ``{layer name: KV-cache spec}`` as the engine collects them."""
    import vllm.models.deepseek_v4.nvidia.model as dsv4
    from vllm.config import set_current_vllm_config

    construct_on_cpu(cfg, dsv4.DeepseekV4ForCausalLM, monkeypatch)
    ctx = cfg.compilation_config.static_forward_context
    with set_current_vllm_config(cfg):
        return {
            n: s
            for n, layer in ctx.items()
            if hasattr(layer, "get_kv_cache_spec")
            and (s := layer.get_kv_cache_spec(cfg)) is not None
        }


def resolve_layout(cfg, specs: dict):
    """Resolve the KV-cache layout from the layers' backends, as the engine core does before
    planning (``resolve_kv_cache_layout``); returns the layout."""
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )

    ctx = cfg.compilation_config.static_forward_context
    backends = {ctx[n].get_attn_backend() for n in specs}
    supported = [x.name for x in get_supported_kv_cache_layouts(backends)]
    return resolve_kv_cache_layout(cfg, [supported], specs.values())


def plan_as_engine_core(cfg, specs: dict, kv_bytes: int = 1 << 30):
    """vLLM's KV-cache planning for one worker as the engine core runs it: the layout resolved
    from the layers' backends, then the worker's and the scheduler's KV-cache configs. Returns
    ``(layout, worker config, scheduler config, rewritten)``; ``rewritten`` is the value the
    engine core then writes into ``cache_config.block_size`` (the smallest prefix-cacheable
    group block, vllm/v1/engine/core.py:364-378). ``cfg`` itself is left unchanged."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    layout = resolve_layout(cfg, specs)
    with set_current_vllm_config(cfg):
        groups = get_global_kv_cache_groups(cfg, [specs])
        (kv_cfg,) = get_kv_cache_configs(cfg, [specs], [kv_bytes], groups)
    sched_cfg = generate_scheduler_kv_cache_config([kv_cfg])
    rewritten = min(
        g.kv_cache_spec.block_size
        for g in sched_cfg.kv_cache_groups
        if g.kv_cache_spec.prefix_cacheable
    )
    return layout, kv_cfg, sched_cfg, rewritten
