"""Load the bundled Kimi-K3 target with vLLM's own loader at TP x PP on CPU, one gloo process per
rank (tests/unit/producer/test_k3_weight_tracking.py): a :mod:`support.tp_load` family.

Each rank builds vLLM's ``KimiLinearForCausalLM`` in a world made by vLLM's
``init_distributed_environment`` + ``ensure_model_parallel_initialized`` and runs
``DefaultModelLoader.load_weights`` (``track_weights_loading`` included) three times on the same
model, writing what it saw to ``<out>/rank<i>.json``:

* ``full``: the whole checkpoint, the plugin as the process loaded it;
* ``no_g_proj``: the checkpoint without its ``g_proj`` tensors (a shard really missing);
* ``stock``: the whole checkpoint with vLLM's own ``pop_missing_shards`` on the KDA projection
  class (the patch ``models_kimi_k3_nvidia_kda`` taken off, if the process applied it).

After ``full`` it also compares each KDA layer's ``in_proj_qkvgfab.weight`` with the rows the
checkpoint holds for the rank (q, k, v, g, b split over TP, f_a whole) and zero padding.
"""

from __future__ import annotations

from pathlib import Path

from support import tp_load

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "models" / "k3-pair" / "k3-target"
#: checkpoint projection -> in_proj_qkvgfab shard (models/kimi_k3/nvidia/model.py:1342-1356)
SHARDS = ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj")
REPLICATED = "f_a_proj"  # replicated_shard_id=4 (kda.py:660-669)
FAMILY = tp_load.Family(
    name="kimi-k3 target",
    config=f"{__name__}:config",
    build=f"{__name__}:build",
    extra=f"{__name__}:kda_checks",
    env=(("VLLM_KIMI_K3_GEMM_AR", "0"),),  # no CUTLASS GEMM-AR kernel in the CPU build
)


def run(world: int, tp: int, pp: int, out: Path, timeout_s: float = 240.0) -> dict[int, dict]:
    """Spawn the ``world`` ranks, wait for them (killing any left after ``timeout_s``) and return
    each rank's record."""
    return tp_load.run(FAMILY, world, tp, pp, out, timeout_s)


def config(tp: int, pp: int):
    from dspark_dev.tiny_mla_targets import TinyPair
    from support.mla_cpu_config import k3_engine_config

    pair = TinyPair(str(TARGET), str(TARGET.parent / "k3-dspark"), "kimi-k3")
    return k3_engine_config(
        pair, tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="mp"
    )


def build(cfg):
    import torch
    import vllm.models.kimi_k3.nvidia.model as k3_model

    real_stream = torch.cuda.Stream
    torch.cuda.Stream = lambda *a, **k: None  # the aux stream only overlaps GEMMs at run time
    try:
        return k3_model.KimiLinearForCausalLM(vllm_config=cfg, prefix="")
    finally:
        torch.cuda.Stream = real_stream


def kda_checks(model, cfg, record: dict, tp: int) -> None:
    """The KDA projections, their padding, the patch, and the rows, ``no_g_proj`` and ``stock``
    verdicts (after the whole checkpoint was loaded)."""
    from vllm_dspark_pp.patches import applied_patches

    kda = sorted(n for n, _ in model.named_modules() if n.endswith(".in_proj_qkvgfab"))
    record["kda_projections"] = kda
    record["padding_rows"] = {n: model.get_submodule(n).padding_size for n in kda}
    record["patch_applied"] = "models_kimi_k3_nvidia_kda" in applied_patches()
    record["in_proj_mismatch"] = _in_proj_mismatch(model, kda, record["tp_rank"], tp)
    record["no_g_proj"] = tp_load.verdict(model, cfg.model_config, drop=".g_proj.")
    record["stock"] = _stock_verdict(model, cfg)


def _stock_verdict(model, cfg) -> list[str] | None:
    """:func:`tp_load.verdict` with vLLM 0.34.0's own ``pop_missing_shards`` on the KDA
    projection."""
    from vllm.models.kimi_k3.nvidia import kda

    from vllm_dspark_pp.patches._util import original

    cls = kda._KimiGDNMergedColumnParallelLinear
    own = cls.__dict__.get("pop_missing_shards")
    cls.pop_missing_shards = original(cls, "pop_missing_shards")
    try:
        return tp_load.verdict(model, cfg.model_config)
    finally:
        if own is None:
            del cls.pop_missing_shards
        else:
            cls.pop_missing_shards = own


def _in_proj_mismatch(model, kda: list[str], tp_rank: int, tp: int) -> list[str]:
    """The KDA projections whose rows differ from the rank's checkpoint rows (and zero padding)."""
    import torch
    from safetensors.torch import load_file

    ckpt = load_file(str(TARGET / "model.safetensors"))
    bad = []
    for name in kda:
        layer = name.removesuffix(".in_proj_qkvgfab")
        parts = []
        for proj in SHARDS:
            w = ckpt[f"{layer}.{proj}.weight"]
            parts.append(w if proj == REPLICATED else w.chunk(tp, dim=0)[tp_rank])
        mod = model.get_submodule(name)
        if mod.padding_size:
            parts.append(torch.zeros(mod.padding_size, w.shape[1], dtype=w.dtype))
        want = torch.cat(parts).float()
        if not torch.equal(mod.weight.detach().float(), want):
            bad.append(name)
    return bad
