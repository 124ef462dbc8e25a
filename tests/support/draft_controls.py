"""Corrupted copies of a DSpark draft for PD controls: a control run gives the prefill-only
producer a broken draft and checks that the decoder's acceptance falls, which shows that the
decoder reads the draft context KV the producer wrote (so a PD acceptance check can fail).

Two strengths: :func:`nan_norm_draft` (a non-finite context: acceptance falls to ~0, which even
dummy weights show) and :func:`aux_perturbed_draft` (a finite, somewhat wrong context, as a real bug
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


#: The subtle control's perturbation (``dspark_dev.training.pd_control_sim.perturbed_weight``):
#: the draft's first and last aux taps exchanged in its context projection, as if the producer
#: captured or relayed its aux hidden states in the wrong order. Chosen by that module's CPU
#: estimate on the bundled trained Kimi-K3 pair (models/k3-pair; prompt context only, as in PD;
#: the GPU PD wave's 7 prompts): 38.5 % -> 27.7 %. A wrong *scale* was tried first and is too weak
#: to see: the last tap at half weight gave 37.7 %, at zero 30.6 %, because the context RMSNorm
#: after the projection undoes most of a change of magnitude (the first and second taps exchanged:
#: 34.9 %). The same default serves the DeepSeek-V4 pair (models/dsv4-pair: 2 taps, layers 0 and 1,
#: exchanged in ``mtp.0.main_proj``): 74.0 % -> 35.6 %, while a tap at half weight changes nothing
#: (74.0 %) and a tap at zero weight gives 49.5 %.
SUBTLE_PERTURB = "swap:0:-1"

#: Where each draft layout keeps its context projection (``concat(aux hidden states) -> hidden``,
#: input columns in ``target_layer_ids`` order) and the config key listing its aux layers:
#: Kimi-K3 (``K3DSparkModel``: ``context_proj``, then ``context_norm``), DeepSeek-V4 (the
#: in-checkpoint draft's ``mtp.0.main_proj``, then ``mtp.0.main_norm``) and Qwen3 DSpark (the
#: trained tiny pair's ``fc``, then ``hidden_norm``; issue 40's TP x PP PD subtle control), tried
#: in this order (the generic ``fc`` last).
CONTEXT_PROJ = (
    ("context_proj.weight", "target_layer_ids"),
    ("mtp.0.main_proj.weight", "dspark_target_layer_ids"),
    ("fc.weight", "target_layer_ids"),
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


def aux_perturbed_draft(draft_dir: str, out_dir: str, perturb: str = SUBTLE_PERTURB) -> str:
    """A copy of ``draft_dir`` whose only change is the draft's context projection, its aux
    blocks of input columns changed by ``perturb`` (``swap:I:J``: blocks I and J exchanged;
    ``scale:J:S``: block J times S; ``perturbed_weight``). Same names, shapes and dtypes; every
    other tensor and the config are bytes-equal.

    The subtle PD control (issue 26 item 2): the prefill-only producer loads it, so its draft
    context KV of the prompt is finite and somewhat wrong, as a real bug in how the producer feeds
    its drafter would make it (by default: the aux taps in the wrong order). The decoder keeps
    the real draft, so greedy output must not change, while acceptance falls (it drafts over a
    wrong prompt context). For DeepSeek-V4 the whole checkpoint directory is copied
    (``mtp.0.main_proj`` is the draft's alone; the target never reads it)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from dspark_dev.training.pd_control_sim import perturbed_weight

    st, name, ids = context_proj_layout(draft_dir)
    src = Path(draft_dir)
    dst = Path(out_dir) / f"{src.name}-aux-perturbed-control"
    shutil.copytree(src, dst, dirs_exist_ok=True)
    with safe_open(st, "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    w = tensors[name]
    if w.dim() != 2 or w.shape[1] % len(ids):
        raise AssertionError(f"{name} {tuple(w.shape)}: columns are not {len(ids)} aux blocks")
    tensors[name] = perturbed_weight(w, len(ids), perturb).contiguous()
    save_file(tensors, str(dst / Path(st).name), metadata=meta)
    return str(dst)
