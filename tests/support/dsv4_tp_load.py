"""The DeepSeek-V4 and V4.1 tiny pairs as :mod:`support.tp_load` families: vLLM's CUDA model
classes (the target, and the DSpark drafter of the GPU tests' speculative config) built on CPU in
a TP x PP gloo world, with the constructors' CUDA-only calls answered as in
``dspark_dev.tiny_dsv4_cpu.construct_on_cpu`` / ``support.tiny_dsv41.cuda_stand_ins``.

:func:`family` hands the ranks the model directory to read (a test's changed copy of a bundled
pair, or the bundle).
"""

from __future__ import annotations

from pathlib import Path

from support import mla_pairs
from support.tp_load import Family

#: the drafter's embedding and head: vLLM's speculator shares the target's
DRAFTER_SHARED = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


def bundled(fam: str) -> Path:
    """The bundled pair's directory (target and drafter in one checkpoint)."""
    root, tdir, _, _, _ = mla_pairs.LAYOUT[fam]
    return mla_pairs.MODELS / root / tdir


def family(fam: str, role: str, model_dir: Path | None = None, drops=()) -> Family:
    """``fam`` (dsv4, dsv41) ``role`` (target, drafter) as a :class:`Family`, reading
    ``model_dir`` (default: the bundled pair)."""
    here = __name__
    drafter = role == "drafter"
    return Family(
        name=f"{fam} {role}",
        config=f"{here}:config_{fam}",
        build=f"{here}:build_{fam}_{role}",
        model_config=f"{here}:draft_model_config" if drafter else None,
        shared=DRAFTER_SHARED if drafter else frozenset(),
        drops=tuple(drops),
        config_args=(str(model_dir or bundled(fam)),),
    )


def _config(tp: int, pp: int, model_dir: str, **kw):
    from dspark_dev import tiny_dsv4_cpu
    from dspark_dev.tiny_mla_targets import TinyPair

    pair = TinyPair(model_dir, model_dir, "tp-load")
    k = mla_pairs.block_size(pair, "dsv4")  # the GPU tests' block: the trained one
    return tiny_dsv4_cpu.engine_config(
        pair,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend="mp",
        speculative_config=pair.speculative_config(k),
        **kw,
    )


def config_dsv4(tp: int, pp: int, model_dir: str):
    return _config(tp, pp, model_dir)


def config_dsv41(tp: int, pp: int, model_dir: str):
    return _config(tp, pp, model_dir, **mla_pairs.engine_kwargs("dsv41"))


def draft_model_config(cfg):
    return cfg.speculative_config.draft_model_config


def _construct(cfg, cls, flashmla):
    """``cls`` built into ``cfg`` with the CUDA-only constructor calls answered."""
    import pytest
    import torch

    cfg.compilation_config.static_forward_context = {}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.cuda, "Stream", lambda *a, **k: None)
        m.setattr(torch.cuda, "Event", lambda *a, **k: None)
        m.setattr(flashmla, "compute_fp8_einsum_recipe", lambda *a, **k: (None, False))
        return cls(vllm_config=cfg, prefix="")


def build_dsv4_target(cfg):
    import vllm.models.deepseek_v4.nvidia.flashmla as flashmla
    from vllm.models.deepseek_v4.nvidia.model import DeepseekV4ForCausalLM

    return _construct(cfg, DeepseekV4ForCausalLM, flashmla)


def build_dsv4_drafter(cfg):
    import vllm.models.deepseek_v4.nvidia.flashmla as flashmla
    from vllm.models.deepseek_v4.nvidia.dspark import DSparkDeepseekV4ForCausalLM

    return _construct(cfg, DSparkDeepseekV4ForCausalLM, flashmla)


def build_dsv41_target(cfg):
    import vllm.models.deepseek_v41.nvidia.flashmla as flashmla
    from vllm.models.deepseek_v41.nvidia.vl_model import DeepseekV41ForCausalLM

    return _construct(cfg, DeepseekV41ForCausalLM, flashmla)


def build_dsv41_drafter(cfg):
    import vllm.models.deepseek_v41.nvidia.flashmla as flashmla
    from vllm.models.deepseek_v41.nvidia.dspark import DSparkDeepseekV4ForCausalLM

    return _construct(cfg, DSparkDeepseekV4ForCausalLM, flashmla)
