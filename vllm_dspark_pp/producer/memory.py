"""The draft families' memory rules: what a drafter holds per role, from its config alone.

Pure functions of a draft's HF config (no torch, no vLLM), so ``vllm-dspark-pp plan`` sizes a
deployment without importing any drafter's model code; ``producer/families.py`` names each
family's rule (``DraftFamily.memory``).

* Qwen3 DSpark: :func:`draft_param_bytes` (every component, full vs context-only) and
  :func:`draft_load_bytes` (the rule: what vLLM holds after loading, measured on the H200);
* DeepSeek-V4.1 DSpark: :func:`v41_draft_bytes`.
"""

from __future__ import annotations

from typing import Any


# --------------------------------------------------------------------------- Qwen3 DSpark
def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def draft_param_bytes(
    draft_hf_config: Any, role: str = "kv_producer", dtype_bytes: int = 2
) -> dict[str, Any]:
    """Parameter bytes of a Qwen3 DSpark draft, full vs context-only (pure, analytic).

    ``draft_hf_config``: the draft's HF config (object or dict) with hidden_size,
    intermediate_size, num_attention_heads, num_key_value_heads, head_dim, vocab_size,
    num_hidden_layers and optionally draft_vocab_size, markov_rank, target_hidden_size,
    dspark_target_layer_ids/target_layer_ids, attention_bias, enable_confidence_head,
    confidence_head_with_markov, has_own_embed_tokens/has_own_lm_head.
    ``role``: kv_role of the instance (None/"kv_both"/"kv_consumer" keep the full drafter).

    Returns components (name -> bytes) of the full drafter, the context-only total, the full
    total, which one this role builds (``built``), and the embedding/LM-head bytes that vLLM
    shares with the target when the draft ships none (``shared_with_target``).
    """
    h = int(_get(draft_hf_config, "hidden_size"))
    inter = int(_get(draft_hf_config, "intermediate_size"))
    nq = int(_get(draft_hf_config, "num_attention_heads"))
    nkv = int(_get(draft_hf_config, "num_key_value_heads", nq))
    hd = int(_get(draft_hf_config, "head_dim", None) or h // nq)
    vocab = int(_get(draft_hf_config, "vocab_size"))
    dvocab = int(_get(draft_hf_config, "draft_vocab_size", None) or vocab)
    layers = int(_get(draft_hf_config, "num_hidden_layers"))
    rank = int(_get(draft_hf_config, "markov_rank", 0) or 0)
    th = int(_get(draft_hf_config, "target_hidden_size", None) or h)
    tl = (
        _get(draft_hf_config, "dspark_target_layer_ids", None)
        or _get(draft_hf_config, "target_layer_ids", None)
        or (_get(draft_hf_config, "dflash_config", None) or {}).get("target_layer_ids")
    )
    n_feat = len(tl) if tl else layers
    bias = bool(_get(draft_hf_config, "attention_bias", False))
    own_embed = bool(_get(draft_hf_config, "has_own_embed_tokens", False))
    own_head = bool(_get(draft_hf_config, "has_own_lm_head", False))
    b = dtype_bytes

    q_rows, kv_rows = nq * hd, 2 * nkv * hd
    per_layer = {
        "q_proj": (h * q_rows + (q_rows if bias else 0)) * b,
        "kv_proj": (h * kv_rows + (kv_rows if bias else 0)) * b,
        "o_proj": (q_rows * h + (h if bias else 0)) * b,
        "q_norm": hd * b,
        "k_norm": hd * b,
        "layer_norms": 2 * h * b,
        "mlp": 3 * h * inter * b,
    }
    comp = {
        "embed_tokens": vocab * h * b,
        "lm_head": dvocab * h * b,
        "fc": n_feat * th * h * b,
        "hidden_norm": h * b,
        "norm": h * b,
        "mask_embedding": h * b,  # allocated by vLLM, loaded only if the checkpoint ships one
        "markov_head": (vocab * rank + dvocab * rank) * b,
        "d2t": dvocab * 8 if dvocab < vocab else 0,
    }
    if _get(draft_hf_config, "enable_confidence_head", False):
        dim = h + (rank if _get(draft_hf_config, "confidence_head_with_markov", False) else 0)
        comp["confidence_head"] = (dim + 1) * 4  # float32 + bias
    for k, v in per_layer.items():
        comp[f"layers.{k}"] = v * layers
    context_keys = ("fc", "hidden_norm", "layers.kv_proj", "layers.k_norm")
    context_only = sum(comp[k] for k in context_keys)
    full = sum(comp.values())
    shared = (0 if own_embed else comp["embed_tokens"]) + (0 if own_head else comp["lm_head"])
    prefill_only = role == "kv_producer"
    return {
        "components": comp,
        "context_only_components": list(context_keys),
        "full_bytes": full,
        "full_bytes_excluding_shared": full - shared,
        "shared_with_target": shared,
        "context_only_bytes": context_only,
        "role": role,
        "builds": "context_only" if prefill_only else "full",
        "built_bytes": context_only if prefill_only else full - shared,
    }


def draft_load_bytes(hf: Any, dtype_bytes: int, own_embed: bool, own_head: bool) -> dict:
    """GPU bytes a Qwen3 DSpark drafter holds after vLLM loads it, per role (pure).

    Parameters the drafter owns (vLLM aliases the target's embedding and LM head when the
    checkpoint ships none) plus, in the full drafter only, what
    ``DFlashQwen3Model._build_fused_kv_buffers`` derives after loading: a concatenated copy of
    every layer's K/V projection rows and the stacked K norms (``fused_kv_copy``). The
    context-KV-only drafter derives the same buffers but keeps its per-layer K/V weights and K
    norms as views of them (``keep_one_kv_copy``), so it holds no copy. Measured against the
    allocator on the H200 by benchmarks/perf_real_shapes.py (docs/results/performance.md);
    ``held_bytes`` of the build's log line is the same count of the built module.
    """
    sizes = draft_param_bytes(hf, role="kv_both", dtype_bytes=dtype_bytes)
    comp = sizes["components"]
    derived = comp["layers.kv_proj"] + comp["layers.k_norm"]
    full = sizes["full_bytes"]
    if not own_embed:
        full -= comp["embed_tokens"]
    if not own_head:
        full -= comp["lm_head"]
    return {
        "full": full + derived,
        "context_only": sizes["context_only_bytes"],
        "fused_kv_copy": derived,
        "shared_with_target": sizes["full_bytes"] - full,
    }


# --------------------------------------------------------------------------- DeepSeek-V4.1 DSpark
def v41_layer_count(config: Any) -> int:
    # as DSparkDeepseekV4Model (v4.1) counts them
    return (
        getattr(config, "n_mtp_layers", None)
        or getattr(config, "num_nextn_predict_layers", None)
        or 3
    )


def v41_draft_bytes(
    config: Any, dtype_bytes: int, own_embed: bool, own_head: bool
) -> dict[str, int]:
    """Weight bytes of the DeepSeek-V4.1 drafter per role (``plan``; unquantized weights).

    ``context_only``: main_proj + main_norm + context_wkv_proj + the kv_norms.
    ``full``: that plus every layer's attention (wq_a+wkv fused, q_norm, wq_b, wo_a, wo_b, the
    sink in fp32), its MoE (routed and shared experts, gate and bias), its two norms and its
    hyper-connection parameters (fp32), the final norm, the Markov and confidence heads; and
    the ``context_wkv_proj`` copy vLLM makes of the wkv rows (``fused_kv_copy``).
    ``shared_with_target``: the embedding and LM head vLLM aliases (the drafter ships none).
    """
    h, hd, n = config.hidden_size, config.head_dim, v41_layer_count(config)
    heads, q_rank = config.num_attention_heads, config.q_lora_rank
    groups, o_rank = config.o_groups, config.o_lora_rank
    taps = len(config.dspark_target_layer_ids)
    experts = getattr(config, "dspark_n_routed_experts", 0) or config.n_routed_experts
    inter, shared = config.moe_intermediate_size, config.n_shared_experts or 0
    hc = config.hc_mult
    mix = (2 + hc) * hc
    markov = config.dspark_markov_rank
    context_wkv = n * hd * h
    context_only = h * taps * h + h + context_wkv + n * hd
    per_layer = (
        (q_rank + hd) * h  # fused_wqa_wkv
        + q_rank
        + heads * hd * q_rank  # wq_b
        + groups * o_rank * (heads * hd // groups)  # wo_a
        + h * groups * o_rank  # wo_b
        + hd  # kv_norm
        + experts * 3 * inter * h
        + shared * 3 * inter * h
        + experts * h
        + 2 * h  # attn_norm, ffn_norm
    )
    fp32_per_layer = heads + experts + 2 * (mix * hc * h + mix + 3)  # sink, bias, hc params
    heads_bytes = h + 2 * config.vocab_size * markov + (h + markov)  # norm, Markov, confidence
    full = (
        h * taps * h + h + context_wkv + n * per_layer + heads_bytes
    ) * dtype_bytes + n * fp32_per_layer * 4
    return {
        "full": full,
        "context_only": context_only * dtype_bytes,
        "fused_kv_copy": context_wkv * dtype_bytes,
        "shared_with_target": 2 * config.vocab_size * h * dtype_bytes,
    }
