"""What vLLM's DeepSeek-V4.1 target and DSpark drafter must hold after loading a checkpoint of
``dsv41_models`` (written independently of vLLM's loader), and the comparison with the loaded
models. The models themselves are built by the caller (on CPU: tests/support/tiny_dsv41.py), so
this module imports no vLLM.

V4.1's parameters differ from V4's (``dsv4_check.vllm_layer_params``) in: the ratio-1 compressor
(``fused_wkv_wgate`` is ``wkv`` alone, no ``ape``: ``deepseek_v41/compressor.py``), the indexer of a
kv source (``wk``, ``k_norm``, no compressor of its own), no hash table, no ``hc_head_*`` (the last
FFN pre collapses the streams), and the target under ``language_model.`` (``nvidia/vl_model.py``:
the text model inside the vision-language class, whose vision tower the text checkpoint leaves
unloaded).
"""

from __future__ import annotations

import torch

from dspark_dev.training.dsv4_check import compare_params, flashmla_padded_sink

#: target parameters a text-only checkpoint does not fill (vLLM skips ``vision.`` / ``aligner.``
#: / ``image_`` checkpoint names: ``nvidia/model.py`` ``load_weights``)
VISION_PREFIXES = ("vision.", "aligner.", "image_")
#: the drafter's embedding and head are the target's (vLLM's speculator aliases them)
DRAFTER_ALIASED = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


def v41_layer_params(sd: dict[str, torch.Tensor], src: str, dst: str) -> dict[str, torch.Tensor]:
    """One V4.1 decoder layer's vLLM parameters (prefix ``dst``) from the tensors under ``src``."""
    out: dict[str, torch.Tensor] = {}
    g = lambda k: sd[src + k]  # noqa: E731
    out[dst + "attn.fused_wqa_wkv.weight"] = torch.cat(
        [g("attn.wq_a.weight"), g("attn.wkv.weight")]
    )
    for k in ("q_norm.weight", "kv_norm.weight", "wq_b.weight", "wo_a.weight", "wo_b.weight"):
        out[dst + "attn." + k] = g("attn." + k)
    out[dst + "attn.attn_sink"] = flashmla_padded_sink(g("attn.attn_sink"))
    c = "attn.compressor."
    if src + c + "wkv.weight" in sd:
        out[dst + c + "fused_wkv_wgate.weight"] = g(c + "wkv.weight")
        out[dst + c + "norm.weight"] = g(c + "norm.weight")
    for k in ("wq_b.weight", "weights_proj.weight", "wk.weight", "k_norm.weight"):
        if src + "attn.indexer." + k in sd:
            out[dst + "attn.indexer." + k] = g("attn.indexer." + k)
    out[dst + "ffn.gate.weight"] = g("ffn.gate.weight")
    out[dst + "ffn.gate.e_score_correction_bias"] = g("ffn.gate.bias")
    se = "ffn.shared_experts."
    out[dst + se + "gate_up_proj.weight"] = torch.cat([g(se + "w1.weight"), g(se + "w3.weight")])
    out[dst + se + "down_proj.weight"] = g(se + "w2.weight")
    n_exp = sum(1 for k in sd if k.startswith(src + "ffn.experts.") and k.endswith(".w1.weight"))
    ex = [f"ffn.experts.{e}." for e in range(n_exp)]
    out[dst + "ffn.experts.routed_experts.w13_weight"] = torch.stack(
        [torch.cat([g(e + "w1.weight"), g(e + "w3.weight")]) for e in ex]
    )
    out[dst + "ffn.experts.routed_experts.w2_weight"] = torch.stack(
        [g(e + "w2.weight") for e in ex]
    )
    for k in ("attn_norm.weight", "ffn_norm.weight"):
        out[dst + k] = g(k)
    for kind in ("attn", "ffn"):
        for p in ("fn", "base", "scale"):
            out[dst + f"hc_{kind}_{p}"] = g(f"hc_{kind}_{p}")
    return out


def expected_v41_params(sd: dict[str, torch.Tensor], *, drafter: bool, n_layers: int):
    """{vLLM parameter name: value after load_weights} for ``DeepseekV41ForCausalLM`` (the CUDA
    vision-language class, text part) or the V4.1 DSpark drafter."""
    out: dict[str, torch.Tensor] = {}
    if not drafter:
        lm = "language_model."
        out[lm + "model.embed_tokens.weight"] = sd["embed.weight"]
        out[lm + "lm_head.weight"] = sd["head.weight"]
        out[lm + "model.norm.weight"] = sd["norm.weight"]
        for i in range(n_layers):
            out.update(v41_layer_params(sd, f"layers.{i}.", f"{lm}model.layers.{i}."))
        return out
    stages = sorted({int(k.split(".")[1]) for k in sd if k.startswith("mtp.")})
    last = f"mtp.{stages[-1]}."
    out["model.main_proj.weight"] = sd["mtp.0.main_proj.weight"]
    out["model.main_norm.weight"] = sd["mtp.0.main_norm.weight"]
    for i in stages:
        out.update(v41_layer_params(sd, f"mtp.{i}.", f"model.layers.{i}."))
    out["model.context_wkv_proj.weight"] = torch.cat(
        [sd[f"mtp.{i}.attn.wkv.weight"] for i in stages]
    )
    out["model.norm.weight"] = sd[last + "norm.weight"]
    for k in ("markov_w1", "markov_w2"):
        out[f"model.markov_head.{k}.weight"] = sd[last + f"markov_head.{k}.weight"]
    if last + "confidence_head.proj.weight" in sd:
        out["model.confidence_head.proj.weight"] = sd[last + "confidence_head.proj.weight"]
    return out


def load_problems(model, sd: dict[str, torch.Tensor], *, drafter: bool, n_layers: int) -> list[str]:
    """Run ``model.load_weights`` (vLLM's V4.1 target or drafter, built by the caller inside
    its vLLM config) on ``sd`` and list every parameter that is missing, extra, of another shape
    or value than :func:`expected_v41_params`, or not reported loaded."""
    with torch.no_grad():
        loaded = set(model.load_weights(iter(sd.items())))
    names = {n for n, _ in model.named_parameters()}
    skip = set(DRAFTER_ALIASED) if drafter else {n for n in names if n.startswith(VISION_PREFIXES)}
    problems = compare_params(model, expected_v41_params(sd, drafter=drafter, n_layers=n_layers),
                              frozenset(skip))  # fmt: skip
    problems += [f"load_weights did not load {n}" for n in sorted(names - loaded - skip)]
    return problems
