"""Corrupted copies of a DSpark draft for PD controls: a control run gives the prefill-only
producer a broken draft and checks that the decoder's acceptance falls, which shows that the
decoder reads the draft context KV the producer wrote (so a PD acceptance check can fail).

Two strengths: :func:`nan_norm_draft` (a non-finite context: acceptance falls to ~0, which even
dummy weights show) and :func:`scaled_aux_draft` (a finite, slightly wrong context, as a real bug
would give: only a trained pair, whose drafts depend on their context, can show the fall).
Used by tests/e2e/producer (CPU), tests/unit/producer and tests/gpu/test_dsv4_k3_engine.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

#: The corrupted draft's ``rms_norm_eps``: rsqrt(mean(x^2) + eps) is NaN for any real input.
NAN_NORM_EPS = -1e30


def nan_norm_draft(draft_dir: str, out_dir: str) -> str:
    """A copy of ``draft_dir`` whose config differs only in ``rms_norm_eps = -1e30``: the same
    layer names, shapes and (dummy, seeded) weights, but every RMS norm, the context norm
    included, takes the square root of a negative number and outputs NaN, so a prefill-only
    producer loading it writes a NaN draft context KV.

    Not ``eps = NaN``: vLLM 0.34.0 asserts that the draft layers' norm eps are equal
    (``qwen3_dflash.py:663``, and for Kimi-K3 ``dspark_mla.py:244``, which compares every layer
    with the first, itself included), and NaN != NaN stops the engine at start-up (seen on CPU,
    tests/e2e/producer/test_pd_producer_cpu.py). -1e30 equals itself and is plain JSON.

    The PD control's prefiller draft (``run_pd(prefill_speculative_config=...)``); for a draft
    that lives in its target's checkpoint (DeepSeek-V4) the whole directory is copied and only
    the draft reads it."""
    src = Path(draft_dir)
    dst = Path(out_dir) / f"{src.name}-nan-norm-control"
    shutil.copytree(src, dst, dirs_exist_ok=True)
    cfg = json.loads((dst / "config.json").read_text())
    if "rms_norm_eps" not in cfg:
        raise AssertionError(f"{draft_dir}/config.json has no rms_norm_eps to corrupt")
    cfg["rms_norm_eps"] = NAN_NORM_EPS
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(dst)


#: The subtle control's default: one aux layer's share of the draft's context projection at half
#: its weight. A power of two, so the scaled bf16 / fp32 weights are exact (the writer's unit test
#: checks the factor bit for bit).
SUBTLE_SCALE = 0.5

#: Where each draft layout keeps its context projection (``concat(aux hidden states) -> hidden``,
#: input columns in ``target_layer_ids`` order) and the config key listing its aux layers:
#: Kimi-K3 (``K3DSparkModel``: ``context_proj``, then ``context_norm``) and DeepSeek-V4 (the
#: in-checkpoint draft's ``mtp.0.main_proj``, then ``mtp.0.main_norm``).
CONTEXT_PROJ = (
    ("context_proj.weight", "target_layer_ids"),
    ("mtp.0.main_proj.weight", "dspark_target_layer_ids"),
)


def context_proj_layout(draft_dir: str) -> tuple[str, str, list[int]]:
    """(safetensors file, tensor name, aux layer ids) of the draft's context projection."""
    from safetensors import safe_open

    cfg = json.loads((Path(draft_dir) / "config.json").read_text())
    for st in sorted(Path(draft_dir).glob("*.safetensors")):
        with safe_open(str(st), "pt") as f:
            names = set(f.keys())
        for name, key in CONTEXT_PROJ:
            if name in names:
                if not cfg.get(key):
                    raise AssertionError(f"{draft_dir}/config.json has no {key} for {name}")
                return str(st), name, [int(x) for x in cfg[key]]
    raise AssertionError(
        f"{draft_dir}: no context projection ({', '.join(n for n, _ in CONTEXT_PROJ)}) in its "
        "safetensors"
    )


def scaled_aux_draft(
    draft_dir: str, out_dir: str, aux_index: int = -1, scale: float = SUBTLE_SCALE
) -> str:
    """A copy of ``draft_dir`` whose only change is the draft's context projection: the input
    columns that read aux layer ``target_layer_ids[aux_index]`` (the last, deepest tap by
    default) multiplied by ``scale``. Same names, shapes and dtypes; every other tensor and the
    config are bytes-equal.

    The subtle PD control (issue 26 item 2): as if the prefill-only producer captured one aux
    hidden state at a wrong scale (a plausible bug, e.g. a tap taken before instead of after a
    residual add, or a stage boundary relaying a pre-norm tensor), its draft context KV is finite
    and a little off. A uniform scale of the whole projection would be undone by the context
    RMSNorm that follows it; scaling one aux block changes the mix of layers, i.e. the direction
    of the context state, so every context key and value moves. The decoder keeps the real
    draft, so greedy output must not change, while acceptance falls (it drafts from prompt
    context KV that is slightly wrong). For DeepSeek-V4 the whole checkpoint directory is copied
    (``mtp.0.main_proj`` is the draft's alone; the target never reads it)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    st, name, ids = context_proj_layout(draft_dir)
    src = Path(draft_dir)
    dst = Path(out_dir) / f"{src.name}-scaled-aux-control"
    shutil.copytree(src, dst, dirs_exist_ok=True)
    out_st = dst / Path(st).name
    with safe_open(st, "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    w = tensors[name]
    n = len(ids)
    if w.dim() != 2 or w.shape[1] % n:
        raise AssertionError(f"{name} {tuple(w.shape)}: columns are not {n} aux blocks")
    width = w.shape[1] // n
    j = range(n)[aux_index]  # IndexError for an index out of range
    w = w.clone()
    w[:, j * width : (j + 1) * width] *= torch.tensor(scale, dtype=w.dtype)
    tensors[name] = w.contiguous()
    save_file(tensors, str(out_st), metadata=meta)
    return str(dst)
