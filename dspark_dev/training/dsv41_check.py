"""What vLLM's DeepSeek-V4.1 target and DSpark drafter must hold after loading a checkpoint of
``dsv41_models`` (written independently of vLLM's loader), and the comparison with the loaded
models. The models themselves are built by the caller (on CPU: tests/support/tiny_dsv41.py), so
this module imports no vLLM.

V4.1's parameters differ from V4's (``dsv4_check.vllm_layer_params``) in: the ratio-1 compressor
(``fused_wkv_wgate`` is ``wkv`` alone, no ``ape``: ``deepseek_v41/compressor.py``), the indexer of a
kv source (``wk``, ``k_norm``, no compressor of its own), no hash table, no ``hc_head_*`` (the last
FFN pre collapses the streams), and the target under ``language_model.`` (``nvidia/vl_model.py``:
the text model inside the vision-language class). That class also registers a vision tower, an
aligner and the image delimiters, which vLLM's loader requires from the checkpoint too
(``default_loader.py``, ``track_weights_loading``): the export holds them under the same names
(``dsv41_train.vision_tensors``), and the check expects each at its checkpoint value.
"""

from __future__ import annotations

import torch

from dspark_dev.training.dsv4_check import (
    compare_params,
    expected_vllm_params,
    vllm_layer_params,
)

#: the vision-language class's own parameters (not the text model's): vLLM loads them under their
#: checkpoint names (the text model's ``load_weights`` skips these names, ``nvidia/model.py``)
VISION_PREFIXES = ("vision.", "aligner.", "image_")
#: the drafter's embedding and head are the target's (vLLM's speculator aliases them)
DRAFTER_ALIASED = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


def v41_compression_params(sd: dict[str, torch.Tensor], src: str, dst: str):
    """A V4.1 layer's ratio-1 compressor (``fused_wkv_wgate`` is ``wkv`` alone, no ``ape``) and
    indexer (``wk`` and ``k_norm`` on a kv source) as vLLM parameters."""
    out: dict[str, torch.Tensor] = {}
    c = "attn.compressor."
    if src + c + "wkv.weight" in sd:
        out[dst + c + "fused_wkv_wgate.weight"] = sd[src + c + "wkv.weight"]
        out[dst + c + "norm.weight"] = sd[src + c + "norm.weight"]
    for k in ("wq_b.weight", "weights_proj.weight", "wk.weight", "k_norm.weight"):
        if src + "attn.indexer." + k in sd:
            out[dst + "attn.indexer." + k] = sd[src + "attn.indexer." + k]
    return out


def v41_layer_params(sd: dict[str, torch.Tensor], src: str, dst: str) -> dict[str, torch.Tensor]:
    """One V4.1 decoder layer's vLLM parameters (prefix ``dst``) from the tensors under ``src``:
    V4's with :func:`v41_compression_params` (the checkpoint has no ``tid2eid``, so the gate's
    bias is the ``e_score_correction_bias``)."""
    return vllm_layer_params(sd, src, dst, v41_compression_params)


def expected_v41_params(sd: dict[str, torch.Tensor], *, drafter: bool, n_layers: int):
    """{vLLM parameter name: value after load_weights} for ``DeepseekV41ForCausalLM`` (the CUDA
    vision-language class: the text model under ``language_model.``, V4's without
    ``hc_head_*``, and the checkpoint's vision tensors as they are) or the V4.1 DSpark drafter."""
    out = expected_vllm_params(
        sd,
        drafter=drafter,
        n_layers=n_layers,
        layer_params=v41_layer_params,
        target_prefix="language_model.",
        hc_head=False,
    )
    if not drafter:
        out.update({k: v for k, v in sd.items() if k.startswith(VISION_PREFIXES)})
    return out


def load_problems(model, sd: dict[str, torch.Tensor], *, drafter: bool, n_layers: int) -> list[str]:
    """Run ``model.load_weights`` (vLLM's V4.1 target or drafter, built by the caller inside
    its vLLM config) on ``sd`` and list every parameter that is missing, extra, of another shape
    or value than :func:`expected_v41_params`, or not reported loaded (the target's vision
    parameters included: a checkpoint without them fails here as vLLM's loader fails it)."""
    with torch.no_grad():
        loaded = set(model.load_weights(iter(sd.items())))
    names = {n for n, _ in model.named_parameters()}
    skip = set(DRAFTER_ALIASED) if drafter else set()
    problems = compare_params(model, expected_v41_params(sd, drafter=drafter, n_layers=n_layers),
                              frozenset(skip))  # fmt: skip
    problems += [f"load_weights did not load {n}" for n in sorted(names - loaded - skip)]
    return problems
