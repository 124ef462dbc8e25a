"""Tiny real-architecture Kimi-K3 and DeepSeek-V4 (Flash) targets with matching DSpark drafts.

Generated, never downloaded: :func:`make_tiny_k3_pair` and :func:`make_tiny_dsv4_pair` write
Hugging Face style directories (``config.json``, the project's word-level tokenizer,
``generation_config.json``) that vLLM 0.34.0 resolves to its own model classes:

* Kimi-K3: ``KimiLinearForCausalLM`` (``vllm/models/kimi_k3``, the K3 text stack: KDA layers with
  the full-rank gate interleaved with NoPE MLA layers, MoE after the first dense layer) and a
  ``K3DSparkModel`` draft (``models/kimi_k3/nvidia/dspark_mla.py``: RoPE MLA layers marked
  ``non_causal_multi_token_decode``) fed by target layers ``target_layer_ids``.
* DeepSeek-V4: ``DeepseekV4ForCausalLM`` with the DSpark draft in the same checkpoint
  (``DSparkDraftModel``, ``mtp.<i>.*``), the config of :func:`tiny_mla_drafts.tiny_dsv4_config`.

No weights are written: the engines run with ``load_format="dummy"``, whose initialisation
(``weight_utils.initialize_single_dummy_weight``) is seeded with a fixed seed per parameter, so
two engine runs of one configuration hold the same weights and greedy runs are comparable.

``gpu=True`` keeps the latent widths the CUDA MLA kernels are built for (512 + 64).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dspark_dev import tiny_mla_drafts
from vllm_dspark_pp.tiny_models import SPECIAL_TOKENS, _write_json, _write_tokenizer

VOCAB = 512
# The drafts' noise (mask) token fed to the parallel-drafting slots: the tokenizer's ``<|mask|>``
# (``tiny_models.SPECIAL_TOKENS``). vLLM's DSpark speculator resolves it in
# ``v1/worker/gpu/spec_decode/utils.get_parallel_drafting_token_id`` and refuses a draft config
# without one; the released configs carry ``dspark_noise_token_id`` (DeepSeek-V4-Flash: 128799, a
# reserved id near the end of its vocabulary; Kimi-K3's DSpark draft: 163839, also as
# ``ptd_token_id``).
NOISE_TOKEN_ID = SPECIAL_TOKENS.index("<|mask|>")


@dataclasses.dataclass(frozen=True)
class TinyPair:
    target: str
    draft: str
    family: str

    def speculative_config(self, num_speculative_tokens: int = 4, **extra: Any) -> dict:
        return {
            "method": "dspark",
            "model": self.draft,
            "num_speculative_tokens": num_speculative_tokens,
            **extra,
        }


def k3_target_fields(*, gpu: bool = False, num_layers: int = 4) -> dict[str, Any]:
    """A tiny Kimi-K3 text config (``KimiLinearConfig`` fields): KDA on odd layers (1-based
    ``kda_layers``), NoPE MLA on the even ones, MoE from layer 1 on."""
    mla = tiny_mla_drafts.k3_mla_dims(gpu=gpu)
    kda_layers = [i + 1 for i in range(num_layers) if i % 2 == 0]
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": VOCAB,
        "num_hidden_layers": num_layers,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "mla_use_nope": True,
        "linear_attn_config": {
            "kda_layers": kda_layers,
            "full_attn_layers": [i + 1 for i in range(num_layers) if i + 1 not in kda_layers],
            "num_heads": 4,
            "head_dim": 32 if not gpu else 64,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
        },
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "eos_token_id": 2,
        **mla,
    }


def k3_draft_fields(*, gpu: bool = False, target_layers: int = 4) -> dict[str, Any]:
    cfg = tiny_mla_drafts.tiny_k3_config(gpu=gpu)
    out = cfg.to_dict()
    out.update(
        {
            "architectures": ["K3DSparkModel"],
            "model_type": "k3_dspark",
            "num_target_layers": 2,
            "target_layer_ids": [0, target_layers - 1],
            "vocab_size": VOCAB,
            "torch_dtype": "bfloat16",
            "dspark_noise_token_id": NOISE_TOKEN_ID,
            "ptd_token_id": NOISE_TOKEN_ID,
        }
    )
    return out


def _write_dir(path: Path, config: dict[str, Any]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(path, VOCAB)
    _write_json(path / "config.json", config)
    _write_json(path / "generation_config.json", {"eos_token_id": config.get("eos_token_id", 2)})


def make_tiny_k3_pair(out: str | Path, *, gpu: bool = False, num_layers: int = 4) -> TinyPair:
    out = Path(out)
    _write_dir(out / "k3-target", k3_target_fields(gpu=gpu, num_layers=num_layers))
    _write_dir(out / "k3-dspark", k3_draft_fields(gpu=gpu, target_layers=num_layers))
    return TinyPair(str(out / "k3-target"), str(out / "k3-dspark"), "kimi-k3")


DSV4_BLOCK = 4  # the tests' num_speculative_tokens

# The attention geometry of a released DeepSeek-V4-Flash config where the tiny config of
# ``tiny_mla_drafts`` (built for CPU module checks) departs from it in ways the CUDA engine cares
# about:
# * one compressed-sparse (ratio 4, with the Lightning Indexer) and one heavily-compressed
#   (ratio 128) layer. With ratio-128 layers only, no backend declares a KV-cache layout, vLLM
#   resolves the layer-outermost LBNHC, the DeepSeek-V4 page sizes (37440 / 32832 / 1728 B) cannot
#   be unified, and the planner's full-allocation fallback promotes the compressor state caches to
#   the 256-token block (``v1/core/kv_cache_planning._try_get_full_allocation_fallback_groups``),
#   which the CuTe DSL C128 compressor refuses ("requires state-cache block_size=8, got 256").
#   The indexer's backend (``DeepseekV4IndexerBackend``) asks for a block-outermost layout, under
#   which vLLM packs the groups and the state caches keep their 4 / 8-token blocks.
# * the indexer's 128-wide heads (64 of them) and top-512: the fused quant+cache compressor takes
#   head_dim 128 or 512 only, and FlashMLA's sparse decode wants a top-k width that is a multiple
#   of its 64 / 128-wide tiles.
DSV4_GPU_ATTENTION = {
    "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 512,
}


# The training geometry (``dsv4_fields(train=True)``, what ``train_tiny_pair --family dsv4``
# trains and the bundled pair ships): the GPU geometry with the query side shrunk to the smallest
# shape vLLM's H200 path runs for the released DeepSeek-V4-Flash, the 8 query heads and one
# ``wo_a`` group each rank of Flash holds at TP=8 (64 heads, 8 groups). FlashMLA pads the heads
# to 64 (``nvidia/flashmla.py:74-81``), the fused q-norm/RoPE/insert op zero-fills the padding
# heads (``attention.py:753-770``), the inverse-RoPE kernel takes any group shape whose heads
# split into 1/2/4-head programs and the unquantised ``wo_a`` is a bf16 bmm
# (``nvidia/ops/o_proj.py:101-107``); the q-LoRA rank feeds only bf16 GEMMs and the masked Triton
# RMSNorm (``models/common/ops/fused_qk_rmsnorm.py:179``). What the kernels fix (head_dim 512 with
# 64 RoPE channels, the indexer's 64 x 128 heads and top-512, the compressor ratios) and what is
# kept as run (hidden, the MoE widths, hc_mult) stays as in the GPU geometry; TP 1 only (one
# group). docs/dsv4-pure-torch.md has the table. bf16 checkpoint: 8.25 MiB (GPU geometry:
# 31.3 MiB, 75 % of it wq_b and wo_a).
DSV4_TRAIN_ATTENTION = {
    "num_attention_heads": 8,
    "o_groups": 1,
    "o_lora_rank": 32,
    "q_lora_rank": 32,
}


def dsv4_fields(*, gpu: bool = True, train: bool = False) -> dict[str, Any]:
    """The tiny DeepSeek-V4 config. ``gpu``: the CUDA kernels' widths (what the dummy-weight GPU
    tests run); ``train`` (needs ``gpu``): the smaller query side of ``DSV4_TRAIN_ATTENTION``."""
    if train and not gpu:
        raise ValueError("the training geometry is a variant of the GPU one (gpu=True)")
    cfg = tiny_mla_drafts.tiny_dsv4_config(gpu=gpu)
    out = cfg.to_dict()
    if gpu:
        out.update(DSV4_GPU_ATTENTION)
    if train:
        out.update(DSV4_TRAIN_ATTENTION)
    # The DSpark fields of a released DeepSeek-V4-Flash config.json (its drafter reads the
    # target's config): the noise token for the parallel-drafting slots and the draft block.
    out.update(
        {
            "architectures": ["DeepseekV4ForCausalLM"],
            "vocab_size": VOCAB,
            "torch_dtype": "bfloat16",
            "eos_token_id": 2,
            "dspark_noise_token_id": NOISE_TOKEN_ID,
            "dspark_block_size": DSV4_BLOCK,
        }
    )
    return out


def make_tiny_dsv4_pair(out: str | Path, *, gpu: bool = True, train: bool = False) -> TinyPair:
    """The DeepSeek-V4 draft lives in the target checkpoint: one directory, used twice."""
    out = Path(out)
    _write_dir(out / "dsv4", dsv4_fields(gpu=gpu, train=train))
    return TinyPair(str(out / "dsv4"), str(out / "dsv4"), "deepseek-v4")
