"""Write the pair as two HF-style model directories vLLM loads: ``<out>/target`` (Qwen3ForCausalLM)
and ``<out>/dspark-draft`` (Qwen3 DSpark draft; the ``dspark`` in the directory name is what vLLM's
DSparkSpeculatorConfig.matches looks for). Checkpoints are safetensors when the package is
importable, otherwise a torch state dict (``*.pt``) that ``convert_pt_dir`` turns into safetensors.
"""

from __future__ import annotations

import json
import os

import torch

from dspark_dev.training.models import DraftConfig, TargetConfig
from dspark_dev.training.tokenizer import EOS_ID, PAD_ID, write_hf_tokenizer_files

TARGET_DIR = "target"
DRAFT_DIR = "dspark-draft"


def target_hf_config(t: TargetConfig) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": t.vocab_size,
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": t.num_hidden_layers,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": t.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta},
        "max_position_embeddings": t.max_position_embeddings,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32",
    }


def draft_hf_config(t: TargetConfig, d: DraftConfig) -> dict:
    cfg = target_hf_config(t)
    cfg.update(
        {
            # vLLM's hf_config_override maps DSparkDraftModel + model_type qwen3 to
            # Qwen3DSparkModel.
            "architectures": ["DSparkDraftModel"],
            "num_hidden_layers": d.num_hidden_layers,
            "intermediate_size": d.intermediate_size,
            "num_attention_heads": d.num_attention_heads,
            "num_key_value_heads": d.num_key_value_heads,
            "head_dim": d.head_dim,
            "tie_word_embeddings": False,
            "target_hidden_size": t.hidden_size,
            "block_size": d.block_size,
            "target_layer_ids": list(d.target_layer_ids),
            "mask_token_id": d.mask_token_id,
            "dflash_config": {
                "mask_token_id": d.mask_token_id,
                "target_layer_ids": list(d.target_layer_ids),
                "use_aux_hidden_state": True,
            },
            "markov_rank": d.markov_rank,
            "markov_head_type": "vanilla",
            "enable_confidence_head": True,
            "confidence_head_with_markov": d.confidence_head_with_markov,
            "sample_from_anchor": True,
        }
    )
    return cfg


def _save(sd: dict[str, torch.Tensor], path_no_ext: str, metadata: dict | None = None) -> str:
    try:
        from safetensors.torch import save_file
    except ImportError:
        torch.save(sd, path_no_ext + ".pt")
        return path_no_ext + ".pt"
    save_file(sd, path_no_ext + ".safetensors", metadata={"format": "pt", **(metadata or {})})
    return path_no_ext + ".safetensors"


def write_model_dir(
    path: str,
    hf_config: dict,
    sd: dict[str, torch.Tensor],
    tokenizer_json: str,
    extra: dict | None = None,
) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": False}, f, indent=2)
        f.write("\n")
    write_hf_tokenizer_files(path, tokenizer_json)
    if extra:
        with open(os.path.join(path, "training.json"), "w") as f:
            json.dump(extra, f, indent=2, sort_keys=True)
            f.write("\n")
    return _save(sd, os.path.join(path, "model"))


def write_pair(
    out: str, target, draft, tokenizer_json: str, extra: dict | None = None
) -> tuple[str, str]:
    t = write_model_dir(
        os.path.join(out, TARGET_DIR),
        target_hf_config(target.cfg),
        target.hf_state_dict(),
        tokenizer_json,
        extra,
    )
    d = write_model_dir(
        os.path.join(out, DRAFT_DIR),
        draft_hf_config(draft.tcfg, draft.dcfg),
        draft.vllm_state_dict(),
        tokenizer_json,
        extra,
    )
    return t, d


def convert_pt_dir(path: str) -> None:
    """Turn ``model.pt`` in every model directory under ``path`` into ``model.safetensors``."""
    from safetensors.torch import save_file

    for root, _dirs, files in os.walk(path):
        if "model.pt" in files:
            sd = torch.load(os.path.join(root, "model.pt"), map_location="cpu", weights_only=True)
            save_file(
                {k: v.contiguous() for k, v in sd.items()},
                os.path.join(root, "model.safetensors"),
                metadata={"format": "pt"},
            )
            os.remove(os.path.join(root, "model.pt"))


def load_pair(out: str):
    """Rebuild (target, draft) training modules from a directory written by ``write_pair``."""
    from dspark_dev.training.models import TinyDSparkDraft, TinyQwen3

    with open(os.path.join(out, DRAFT_DIR, "training.json")) as f:
        extra = json.load(f)
    tcfg, dcfg = TargetConfig(**extra["target_config"]), DraftConfig(**extra["draft_config"])
    target, draft = TinyQwen3(tcfg), TinyDSparkDraft(tcfg, dcfg)
    tsd, dsd = _load(os.path.join(out, TARGET_DIR)), _load(os.path.join(out, DRAFT_DIR))
    target.load_state_dict({k.removeprefix("model."): v for k, v in tsd.items()})
    emb = dsd.pop("embed_tokens.weight")
    mapped = {
        "fc.weight": dsd.pop("fc.weight"),
        "hidden_norm.weight": dsd.pop("hidden_norm.weight"),
        "norm.weight": dsd.pop("norm.weight"),
        "markov_w1.weight": dsd.pop("markov_head.markov_w1.weight"),
        "markov_w2.weight": dsd.pop("markov_head.markov_w2.weight"),
        "confidence_proj.weight": dsd.pop("confidence_head.proj.weight"),
        "confidence_proj.bias": dsd.pop("confidence_head.proj.bias"),
        "embed_tokens.weight": emb,
        "mask_embedding": emb[dcfg.mask_token_id].clone(),
    }
    mapped.update(dsd)  # layers.*
    draft.load_state_dict(mapped)
    return target, draft


def _load(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "model.safetensors")
    if os.path.exists(st):
        from safetensors.torch import load_file

        return load_file(st)
    return torch.load(os.path.join(path, "model.pt"), map_location="cpu", weights_only=True)


# ---- Kimi-K3 pair (``--family k3``) ----

K3_TARGET_DIR = "k3-target"
K3_DRAFT_DIR = "k3-dspark"


# The training.json entries a pair's model card tabulates (every family's card).
CARD_KEYS = (
    "device",
    "target_steps_run",
    "draft_steps_run",
    "target_heldout_loss",
    "target_heldout_answer_loss",
    "draft_heldout_loss",
    "simulated_mean_acceptance_length",
    "simulated_per_position_acceptance",
    "target_heldout_accuracy",
)


def training_table(e: dict) -> list[str]:
    """A model card's markdown table of the training record ``e`` (empty if it has none)."""
    rows = [f"| {k} | {e[k]} |" for k in CARD_KEYS if k in e]
    return ["", "| training.json | value |", "|---|---|", *rows] if rows else []


def _mla_fields(t) -> dict:
    """The MLA geometry the K3 target and its drafter share (both read the target's config)."""
    return {
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_attention_heads,
        "qk_nope_head_dim": t.qk_nope_head_dim,
        "qk_rope_head_dim": t.qk_rope_head_dim,
        "v_head_dim": t.v_head_dim,
        "q_lora_rank": t.q_lora_rank,
        "kv_lora_rank": t.kv_lora_rank,
    }


def k3_target_hf_config(t) -> dict:
    """``KimiLinearConfig`` fields of :class:`k3_models.TinyK3` (the routing knobs are written out
    even where they equal KimiLinearConfig's defaults, so the semantics are pinned)."""
    from dspark_dev.training.k3_models import check_kda_geometry

    check_kda_geometry(t.kda_num_heads, t.kda_head_dim)
    kda = t.kda_layers()
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": t.vocab_size,
        "hidden_size": t.hidden_size,
        "num_hidden_layers": t.num_hidden_layers,
        "intermediate_size": t.intermediate_size,
        "moe_intermediate_size": t.moe_intermediate_size,
        "num_experts": t.num_experts,
        "num_experts_per_token": t.num_experts_per_token,
        "num_shared_experts": t.num_shared_experts,
        "first_k_dense_replace": t.first_k_dense_replace,
        "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "hidden_act": "silu",
        "mla_use_nope": True,
        "mla_use_output_gate": False,
        **_mla_fields(t),
        "linear_attn_config": {
            "kda_layers": kda,
            "full_attn_layers": [i + 1 for i in range(t.num_hidden_layers) if i + 1 not in kda],
            "num_heads": t.kda_num_heads,
            "head_dim": t.kda_head_dim,
            "short_conv_kernel_size": t.short_conv_kernel_size,
            "use_full_rank_gate": True,
        },
        "max_position_embeddings": t.max_position_embeddings,
        "rms_norm_eps": t.rms_norm_eps,
        "tie_word_embeddings": False,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "bfloat16",
    }


def k3_draft_hf_config(t, d) -> dict:
    """``K3DSparkConfig`` fields of :class:`k3_models.TinyK3DSpark`."""
    return {
        "architectures": ["K3DSparkModel"],
        "model_type": "k3_dspark",
        "vocab_size": t.vocab_size,
        "draft_vocab_size": t.vocab_size,
        "hidden_size": t.hidden_size,
        "target_hidden_size": t.hidden_size,
        "intermediate_size": d.intermediate_size,
        "num_hidden_layers": d.num_hidden_layers,
        **_mla_fields(t),
        "n_routed_experts": 0,
        "n_shared_experts": 0,
        "num_experts_per_tok": 0,
        "hidden_act": "silu",
        "rms_norm_eps": t.rms_norm_eps,
        "max_position_embeddings": t.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": d.rope_theta},
        "num_target_layers": len(d.target_layer_ids),
        "target_layer_ids": list(d.target_layer_ids),
        "block_size": d.block_size,
        "markov_rank": d.markov_rank,
        "enable_confidence_head": True,
        "confidence_head_with_markov": d.confidence_head_with_markov,
        "sample_from_anchor": True,
        "dspark_noise_token_id": d.mask_token_id,
        "ptd_token_id": d.mask_token_id,
        "tie_word_embeddings": False,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "bfloat16",
    }


def round_to_bf16_(*modules) -> None:
    """Round every parameter and buffer to bfloat16 values in place (kept float32): what the
    bfloat16 checkpoint holds, so later simulations use the shipped weights."""
    with torch.no_grad():
        for m in modules:
            for t_ in list(m.parameters()) + list(m.buffers()):
                if t_.is_floating_point():
                    t_.copy_(t_.to(torch.bfloat16).to(t_.dtype))


def write_k3_pair(
    out: str, target, draft, tokenizer_json: str, extra: dict | None = None
) -> tuple[str, str]:
    """``<out>/k3-target`` (KimiLinearForCausalLM, with the drafter's trained noise-token row in
    ``embed_tokens``) and ``<out>/k3-dspark``; bfloat16 safetensors."""
    tsd = target.hf_state_dict()
    tsd["model.embed_tokens.weight"] = draft.target_embed_with_mask(target).float()
    bf = lambda sd: {k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}  # noqa: E731
    t = write_model_dir(
        os.path.join(out, K3_TARGET_DIR),
        k3_target_hf_config(target.cfg),
        bf(tsd),
        tokenizer_json,
        extra,
    )
    d = write_model_dir(
        os.path.join(out, K3_DRAFT_DIR),
        k3_draft_hf_config(draft.tcfg, draft.dcfg),
        bf(draft.vllm_state_dict()),
        tokenizer_json,
        extra,
    )
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(k3_model_card(target, draft, extra))
    return t, d


def k3_model_card(target, draft, extra: dict | None) -> str:
    """``<out>/README.md``: what the two directories hold and how they were made."""
    t, d = target.cfg, draft.dcfg
    e = extra or {}
    n_t = sum(v.numel() for v in target.hf_state_dict().values())
    n_d = sum(v.numel() for v in draft.vllm_state_dict().values())
    lines = [
        "# Tiny Kimi-K3 pair (trained): KimiLinearForCausalLM target + K3DSparkModel drafter",
        "",
        "Made by `python3 -m dspark_dev.training.train_tiny_pair --family k3` (vllm-dspark-pp) on",
        "the seeded synthetic GSM8K-style corpus and BPE tokenizer of models/tiny-pair; model card",
        "in docs/tiny-pair.md. Weights are bfloat16 safetensors.",
        "",
        f"* `{K3_TARGET_DIR}/`: {n_t} parameters. {t.num_hidden_layers} layers, hidden "
        f"{t.hidden_size}: KDA (layers {t.kda_layers()}, 1-based; {t.kda_num_heads} heads x "
        f"{t.kda_head_dim}, short conv {t.short_conv_kernel_size}, full-rank gate) and NoPE MLA "
        f"({t.num_attention_heads} heads, kv_lora_rank {t.kv_lora_rank} + rope "
        f"{t.qk_rope_head_dim}, q_lora_rank {t.q_lora_rank}); MoE from layer "
        f"{t.first_k_dense_replace} ({t.num_experts} experts, top {t.num_experts_per_token}, "
        f"{t.num_shared_experts} shared, sigmoid router); vocab {t.vocab_size}, untied lm_head.",
        f"* `{K3_DRAFT_DIR}/`: {n_d} parameters. {d.num_hidden_layers} RoPE MLA layers (theta "
        f"{d.rope_theta:g}) fed by target layers {list(d.target_layer_ids)}; block "
        f"{d.block_size}, Markov rank {d.markov_rank}, confidence head; noise token id "
        f"{d.mask_token_id} (`<|mask|>`, its embedding row trained and stored in the target's "
        "`embed_tokens`; the target never reads it).",
        "",
        'Serve: `--speculative-config \'{"method": "dspark", "model": "<dir>/'
        f'{K3_DRAFT_DIR}", "num_speculative_tokens": {d.block_size}}}\'` with model '
        f"`<dir>/{K3_TARGET_DIR}`.",
    ]
    return "\n".join(lines + training_table(e)) + "\n"


def load_k3_pair(out: str):
    """Rebuild (target, draft) K3 training modules (float32) from a ``write_k3_pair`` directory."""
    from dspark_dev.training.k3_models import K3DraftConfig, K3TargetConfig, TinyK3, TinyK3DSpark

    with open(os.path.join(out, K3_DRAFT_DIR, "training.json")) as f:
        extra = json.load(f)
    tcfg = K3TargetConfig(**extra["target_config"])
    dcfg = K3DraftConfig(**extra["draft_config"])
    target, draft = TinyK3(tcfg), TinyK3DSpark(tcfg, dcfg)
    tsd = {k: v.float() for k, v in _load(os.path.join(out, K3_TARGET_DIR)).items()}
    target.load_hf_state_dict(tsd)
    draft.load_vllm_state_dict(
        {k: v.float() for k, v in _load(os.path.join(out, K3_DRAFT_DIR)).items()}
    )
    draft.init_from_target(target)
    return target, draft
