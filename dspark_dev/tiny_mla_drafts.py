"""Tiny DeepSeek-V4 DSpark and Kimi-K3 DSpark draft configs and synthetic checkpoints.

Generated, never downloaded: the tests of :mod:`vllm_dspark_pp.producer.deepseek_v4` and
:mod:`vllm_dspark_pp.producer.kimi_k3` build vLLM's full
drafter and our context-only one from these configs and feed both the same checkpoint. The
checkpoint names follow what vLLM 0.34.0's full drafters load:

* DeepSeek-V4 (``deepseek_v4/nvidia/dspark.py::DSparkDeepseekV4ForCausalLM.load_weights``): the
  draft ships inside the target checkpoint as ``mtp.<i>.*`` (context combiner ``main_proj`` /
  ``main_norm`` on stage 0, heads on the last stage, one decoder block per stage); target weights
  (no ``mtp.`` prefix) are in the same file and are ignored by the drafter.
* Kimi-K3 (``kimi_k3/nvidia/dspark_mla.py::K3DSparkForCausalLM``): a draft checkpoint in HF
  layout (unfused ``q_a_proj`` / ``kv_a_proj_with_mqa``, ``gate_proj`` / ``up_proj``).
"""

from __future__ import annotations

from typing import Any

# The MoE routing of the released DeepSeek-V4-Flash config.json: sqrt-softplus scores with the
# aux-free correction bias (``topk_method: noaux_tc``) on every routed layer but the hash-routed
# ones (its first ``num_hash_layers: 3`` of 43; the MTP stages are biased, not hashed). Scaled to
# two target layers: layer 0 hash-routed, layer 1 biased (both of vLLM's DeepSeek-V4 routings:
# the hash table and the biased top-k), and the draft's stages (layers 2, 3) biased as released.
# Without ``noaux_tc`` vLLM gives a non-hash layer no ``e_score_correction_bias`` and its CUDA
# router factory falls back to FusedTopKRouter, which has no sqrt-softplus (the 2026-12-03 H200
# run: "Unsupported scoring function: sqrtsoftplus" in the draft's MoE).
DSV4_ROUTING = {
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "mlp_layer_types": ["hash_moe", "moe"],
}


def tiny_dsv4_config(*, gpu: bool = False) -> Any:
    """A tiny DeepSeek-V4 config carrying the DSpark draft fields (the DeepSeek-V4 drafter reads
    the same config as the target: its layers are the checkpoint's MTP stages).

    ``gpu=True`` keeps the dimensions the CUDA kernels hard-code (head_dim 512 with a 64-wide
    RoPE part, 64 query heads for FlashMLA's padding); the CPU variant is smaller.
    """
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    dims = (
        {
            "hidden_size": 256,
            "num_attention_heads": 64,
            "head_dim": 512,
            "q_lora_rank": 64,
            "o_groups": 8,
            "o_lora_rank": 32,
            "sliding_window": 128,
            "max_position_embeddings": 1024,
        }
        if gpu
        else {
            "hidden_size": 64,
            "num_attention_heads": 4,
            "head_dim": 64,
            "q_lora_rank": 32,
            "o_groups": 2,
            "o_lora_rank": 16,
            "sliding_window": 16,
            "max_position_embeddings": 256,
        }
    )
    cfg = DeepseekV4Config(
        vocab_size=512,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        index_n_heads=2,
        index_head_dim=32,
        index_topk=8,
        hc_mult=2,
        hc_sinkhorn_iters=2,
        **DSV4_ROUTING,
        **dims,
    )
    cfg.architectures = ["DSparkDraftModel"]
    cfg.dspark_target_layer_ids = [0, 1]
    cfg.n_mtp_layers = 2
    cfg.dspark_markov_rank = 8
    cfg.enable_confidence_head = True
    return cfg


def dsv4_checkpoint_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Tensor names -> shapes of a DeepSeek-V4 checkpoint holding the tiny DSpark draft."""
    h, hd, n_heads = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    hc = cfg.hc_mult
    mix = (2 + hc) * hc
    n_layers = cfg.n_mtp_layers
    shapes: dict[str, tuple[int, ...]] = {
        # target weights in the same file (not the drafter's)
        "embed.weight": (cfg.vocab_size, h),
        "layers.0.attn.wkv.weight": (hd, h),
        "head.weight": (cfg.vocab_size, h),
        # the context combiner (stage 0) and the heads (last stage)
        "mtp.0.main_proj.weight": (h, h * len(cfg.dspark_target_layer_ids)),
        "mtp.0.main_norm.weight": (h,),
        f"mtp.{n_layers - 1}.norm.weight": (h,),
        f"mtp.{n_layers - 1}.hc_head_fn": (hc, hc * h),
        f"mtp.{n_layers - 1}.hc_head_base": (hc,),
        f"mtp.{n_layers - 1}.hc_head_scale": (1,),
        f"mtp.{n_layers - 1}.markov_head.markov_w1.weight": (
            cfg.vocab_size,
            cfg.dspark_markov_rank,
        ),
        f"mtp.{n_layers - 1}.markov_head.markov_w2.weight": (
            cfg.vocab_size,
            cfg.dspark_markov_rank,
        ),
        f"mtp.{n_layers - 1}.confidence_head.proj.weight": (1, h + cfg.dspark_markov_rank),
        f"mtp.{n_layers - 1}.confidence_head.proj.bias": (1,),
    }
    for i in range(n_layers):
        p = f"mtp.{i}."
        shapes.update(
            {
                p + "attn.wq_a.weight": (cfg.q_lora_rank, h),
                p + "attn.wkv.weight": (hd, h),
                p + "attn.q_norm.weight": (cfg.q_lora_rank,),
                p + "attn.wq_b.weight": (n_heads * hd, cfg.q_lora_rank),
                p + "attn.kv_norm.weight": (hd,),
                p + "attn.wo_a.weight": (
                    cfg.o_groups * cfg.o_lora_rank,
                    n_heads * hd // cfg.o_groups,
                ),
                p + "attn.wo_b.weight": (h, cfg.o_groups * cfg.o_lora_rank),
                p + "attn.attn_sink": (n_heads,),
                p + "attn_norm.weight": (h,),
                p + "ffn_norm.weight": (h,),
                p + "hc_attn_fn": (mix, hc * h),
                p + "hc_ffn_fn": (mix, hc * h),
                p + "hc_attn_base": (mix,),
                p + "hc_ffn_base": (mix,),
                p + "hc_attn_scale": (3,),
                p + "hc_ffn_scale": (3,),
                p + "ffn.gate.weight": (cfg.n_routed_experts, h),
                p + "ffn.gate.bias": (cfg.n_routed_experts,),
                p + "ffn.shared_experts.w1.weight": (cfg.moe_intermediate_size, h),
                p + "ffn.shared_experts.w2.weight": (h, cfg.moe_intermediate_size),
                p + "ffn.shared_experts.w3.weight": (cfg.moe_intermediate_size, h),
            }
        )
        for e in range(cfg.n_routed_experts):
            shapes.update(
                {
                    p + f"ffn.experts.{e}.w1.weight": (cfg.moe_intermediate_size, h),
                    p + f"ffn.experts.{e}.w2.weight": (h, cfg.moe_intermediate_size),
                    p + f"ffn.experts.{e}.w3.weight": (cfg.moe_intermediate_size, h),
                }
            )
    return shapes


#: The DeepSeek-V4 checkpoint tensors the context-only drafter loads (tiny config, 2 stages).
DSV4_CONTEXT_NAMES = frozenset(
    {
        "mtp.0.main_proj.weight",
        "mtp.0.main_norm.weight",
        "mtp.0.attn.wkv.weight",
        "mtp.1.attn.wkv.weight",
        "mtp.0.attn.kv_norm.weight",
        "mtp.1.attn.kv_norm.weight",
    }
)


def k3_mla_dims(*, gpu: bool = False) -> dict[str, int]:
    """The tiny Kimi-K3 MLA geometry, shared by the target and its DSpark draft (one KV-cache
    geometry on both sides, as in the released model). ``gpu=True``: the latent width the CUDA
    MLA backends are built for (``kv_lora_rank`` 512 + RoPE 64 = a 576-wide latent row)."""
    if gpu:
        return {
            "hidden_size": 256,
            "num_attention_heads": 16,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "q_lora_rank": 64,
            "kv_lora_rank": 512,
        }
    return {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "v_head_dim": 16,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
    }


def tiny_k3_config(*, gpu: bool = False) -> Any:
    """A tiny Kimi-K3 DSpark draft config (vLLM's ``K3DSparkConfig``).

    ``gpu=True`` uses the MLA latent geometry the CUDA MLA backends are built for
    (``kv_lora_rank`` 512 + RoPE 64 = a 576-wide latent row); the CPU variant is smaller.
    """
    from vllm.transformers_utils.configs.k3_dspark import K3DSparkConfig

    dims = k3_mla_dims(gpu=gpu)
    dims["target_hidden_size"] = dims["hidden_size"]
    cfg = K3DSparkConfig(
        vocab_size=512,
        intermediate_size=96,
        num_hidden_layers=2,
        max_position_embeddings=512,
        num_target_layers=2,
        target_layer_ids=[0, 1],
        markov_rank=8,
        hidden_act="silu",
        **dims,
    )
    cfg.architectures = ["K3DSparkModel"]
    return cfg


def k3_checkpoint_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Tensor names -> shapes of a Kimi-K3 DSpark draft checkpoint (HF layout)."""
    h = cfg.hidden_size
    heads = cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (cfg.vocab_size, h),  # shared with the target: dropped
        "context_proj.weight": (h, cfg.target_hidden_size * cfg.num_target_layers),
        "context_norm.weight": (h,),
        "final_norm.weight": (h,),
        "markov_head.markov_w1.weight": (cfg.vocab_size, cfg.markov_rank),
        "markov_head.markov_w2.weight": (cfg.draft_vocab_size, cfg.markov_rank),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_a_proj.weight": (cfg.q_lora_rank, h),
                p + "self_attn.kv_a_proj_with_mqa.weight": (
                    cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                    h,
                ),
                p + "self_attn.q_a_layernorm.weight": (cfg.q_lora_rank,),
                p + "self_attn.q_b_proj.weight": (heads * qk, cfg.q_lora_rank),
                p + "self_attn.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
                p + "self_attn.kv_b_proj.weight": (
                    heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                    cfg.kv_lora_rank,
                ),
                p + "self_attn.o_proj.weight": (h, heads * cfg.v_head_dim),
                p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
                p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    return shapes


#: The Kimi-K3 checkpoint tensors the context-only drafter loads (tiny config, 2 layers).
K3_CONTEXT_NAMES = frozenset(
    {
        "context_proj.weight",
        "context_norm.weight",
        "layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "layers.1.self_attn.kv_a_proj_with_mqa.weight",
        "layers.0.self_attn.kv_a_layernorm.weight",
        "layers.1.self_attn.kv_a_layernorm.weight",
    }
)


def make_checkpoint(
    shapes: dict[str, tuple[int, ...]], *, seed: int = 0, dtype: Any = None, device: Any = "cpu"
) -> dict[str, Any]:
    """Random tensors for ``shapes`` (norm weights near 1 so RMSNorm stays well scaled)."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        t = torch.randn(shape, generator=g) * 0.05
        if "norm" in name and len(shape) == 1:
            t = 1.0 + t
        out[name] = t.to(dtype=dtype or torch.float32, device=device)
    return out


def shim_vllm_config(cfg: Any, *, target_hf: Any, draft_hf: Any) -> Any:
    """A copy of a real ``VllmConfig`` whose target and draft HF configs are replaced (a
    construction-only config for building drafters outside an engine): fresh cache config and
    layer registry (``static_forward_context``), so two builds never share layer names."""
    import copy

    c = copy.copy(cfg)
    c.model_config = copy.copy(cfg.model_config)
    c.model_config.hf_config = target_hf
    c.model_config.hf_text_config = target_hf
    c.speculative_config = copy.copy(cfg.speculative_config)
    draft = copy.copy(cfg.speculative_config.draft_model_config)
    draft.hf_config = draft_hf
    draft.hf_text_config = draft_hf
    c.speculative_config.draft_model_config = draft
    c.cache_config = copy.copy(cfg.cache_config)
    c.compilation_config = copy.copy(cfg.compilation_config)
    c.compilation_config.static_forward_context = {}
    return c
