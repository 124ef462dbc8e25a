"""Load the bundled Kimi-K3 target with vLLM's own loader at TP x PP on CPU, one gloo process per
rank (tests/unit/producer/test_k3_weight_tracking.py).

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

import json
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "models" / "k3-pair" / "k3-target"
#: checkpoint projection -> in_proj_qkvgfab shard (models/kimi_k3/nvidia/model.py:1342-1356)
SHARDS = ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj")
REPLICATED = "f_a_proj"  # replicated_shard_id=4 (kda.py:660-669)


def run(world: int, tp: int, pp: int, out: Path, timeout_s: float = 240.0) -> dict[int, dict]:
    """Spawn the ``world`` ranks, wait for them (killing any left after ``timeout_s``) and return
    each rank's record."""
    import torch.multiprocessing as tmp

    init = f"file://{out / 'dist-init'}"
    ctx = tmp.start_processes(
        _rank, args=(world, tp, pp, init, str(out)), nprocs=world, join=False,
        start_method="spawn",
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"TP={tp} x PP={pp} load not done after {timeout_s:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world)}


def _rank(rank: int, world: int, tp: int, pp: int, init: str, out: str) -> None:
    os.environ["VLLM_HOST_IP"] = "127.0.0.1"
    # distinct per rank: vLLM's CPU communicator keeps plain torch.distributed (no shm segments)
    os.environ["VLLM_DIST_IDENT"] = f"k3-tp-load-{os.getpid()}"
    os.environ["VLLM_KIMI_K3_GEMM_AR"] = "0"  # no CUTLASS GEMM-AR kernel in the CPU build
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    from dspark_dev.tiny_mla_targets import TinyPair
    from support.mla_cpu_config import k3_engine_config

    torch.set_num_threads(1)
    pair = TinyPair(str(TARGET), str(TARGET.parent / "k3-dspark"), "kimi-k3")
    cfg = k3_engine_config(
        pair, tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="mp"
    )
    with set_current_vllm_config(cfg):
        init_distributed_environment(world, rank, init, rank, "gloo")
        ensure_model_parallel_initialized(tp, pp)
    import vllm.models.kimi_k3.nvidia.model as k3_model

    with set_current_vllm_config(cfg), torch.device("cpu"):
        real_stream = torch.cuda.Stream
        torch.cuda.Stream = lambda *a, **k: None  # the aux stream only overlaps GEMMs at run time
        try:
            model = k3_model.KimiLinearForCausalLM(vllm_config=cfg, prefix="")
        finally:
            torch.cuda.Stream = real_stream
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

    from vllm_dspark_pp.patches import applied_patches

    kda = sorted(n for n, _ in model.named_modules() if n.endswith(".in_proj_qkvgfab"))
    record: dict = {
        "rank": rank,
        "tp_rank": get_tensor_model_parallel_rank(),
        "pp_rank": get_pp_group().rank_in_group,
        "kda_projections": kda,
        "padding_rows": {n: model.get_submodule(n).padding_size for n in kda},
        "patch_applied": "models_kimi_k3_nvidia_kda" in applied_patches(),
    }
    with set_current_vllm_config(cfg), torch.no_grad():
        record["full"] = _verdict(model, cfg)
        record["in_proj_mismatch"] = _in_proj_mismatch(model, kda, record["tp_rank"], tp)
        record["no_g_proj"] = _verdict(model, cfg, drop=".g_proj.")
        record["stock"] = _stock_verdict(model, cfg)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))


def _verdict(model, cfg, drop: str | None = None) -> list[str] | None:
    """vLLM's loader on the bundled checkpoint (without the tensors whose names hold ``drop``):
    None when its check passes, else the sorted names it says were not initialised."""
    import ast

    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    real = type(model).load_weights

    def filtered(weights):
        return real(model, ((n, w) for n, w in weights if drop is None or drop not in n))

    model.load_weights = filtered
    try:
        DefaultModelLoader(LoadConfig(load_format="safetensors")).load_weights(
            model, cfg.model_config
        )
    except ValueError as e:
        head = "Following weights were not initialized from checkpoint: "
        if not str(e).startswith(head):
            raise
        return sorted(ast.literal_eval(str(e)[len(head) :]))
    finally:
        del model.load_weights
    return None


def _stock_verdict(model, cfg) -> list[str] | None:
    """:func:`_verdict` with vLLM 0.34.0's own ``pop_missing_shards`` on the KDA projection."""
    from vllm.models.kimi_k3.nvidia import kda

    from vllm_dspark_pp.patches._util import original

    cls = kda._KimiGDNMergedColumnParallelLinear
    own = cls.__dict__.get("pop_missing_shards")
    cls.pop_missing_shards = original(cls, "pop_missing_shards")
    try:
        return _verdict(model, cfg)
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
