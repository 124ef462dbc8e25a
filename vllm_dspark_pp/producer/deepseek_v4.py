"""DeepSeek-V4 DSpark: the context-KV-only drafter (see :mod:`.drafter` for the contract).

DeepSeek-V4 DSpark (``DSparkDraftModel`` -> ``vllm/models/deepseek_v4/nvidia/dspark.py``)
    Built: ``model.main_proj`` + ``model.main_norm`` (the context projection, read by
    ``combine_hidden_states``), ``model.context_wkv_proj`` (every draft layer's ``wkv`` stacked
    into one projection) and, per draft layer ``model.layers.<N+i>.attn``, ``kv_norm``, the
    rotary table and the SWA KV cache layer ``model.layers.<N+i>.attn.swa_cache``
    (``DeepseekV4SWACache``); the ``attn`` module itself is registered as an attention layer
    whose KV-cache spec is ``None``, as vLLM's ``DeepseekV4Attention`` is for draft layers
    (compress ratio 1). Skipped: embedding, LM head, ``wq_a``/``q_norm``/``wq_b``/``wo_a``/
    ``wo_b``/``attn_sink``, the per-layer ``fused_wqa_wkv`` (the context path reads only
    ``context_wkv_proj``), MoE ``ffn``, ``attn_norm``/``ffn_norm``, the hyper-connection
    parameters, the final norm, ``hc_head_*``, Markov and confidence heads.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from vllm_dspark_pp.producer import drafter, families

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

logger = init_logger("vllm.dspark_pp.producer.deepseek_v4")

#: vLLM 0.34.0's CUDA implementations (the registry's platform pick on NVIDIA).
DSV4_NVIDIA_MODULE = "vllm.models.deepseek_v4.nvidia.dspark"

# --------------------------------------------------------------------------- weights
# The draft weights ship in the target checkpoint as ``mtp.<i>.*`` (shared with V4.1: drafter.py).
is_dsv4_context_kv_weight = drafter.is_mtp_context_weight
dsv4_skipped_weight_names = drafter.mtp_skipped_weight_names
_dsv4_param_name = drafter.mtp_context_param_name


# --------------------------------------------------------------------------- DeepSeek-V4
@drafter.built_once
def dsv4_context_kv_class(module_name: str | None = None) -> type:
    """The DeepSeek-V4 context-only top-level class (``module_name``: vLLM's drafter module,
    default: the registry's platform pick)."""
    import torch
    from torch import nn
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.models.deepseek_v4 import attention as dsv4_attention
    from vllm.models.deepseek_v4.common.rope import build_deepseek_v4_rope
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    dspark = drafter.platform_module(
        "vllm.models.deepseek_v4", "DSparkDeepseekV4ForCausalLM", module_name
    )
    base_model: Any = getattr(dspark, "DSparkDeepseekV4Model", None)
    if base_model is None:
        raise drafter.refuse_platform("DeepSeek-V4 DSpark", dspark, "DSparkDeepseekV4Model")
    base_top = dspark.DSparkDeepseekV4ForCausalLM
    model_module = sys.modules[dspark.DeepseekV4DecoderLayer.__module__]
    select_attn_cls: Any = getattr(model_module, "_select_dsv4_attn_cls", None)
    if select_attn_cls is None:
        raise drafter.refuse_platform("DeepSeek-V4 DSpark", model_module, "_select_dsv4_attn_cls")

    class DeepseekV4ContextKVAttention(nn.Module, AttentionLayerBase):
        """What ``_insert_context_kv`` reads of a DeepseekV4Attention draft layer.

        Mirrors the attribute values of the attention class vLLM selects for this config
        (``_select_dsv4_attn_cls``): its backend classes, padded query heads and KV-cache
        layout decide the SWA cache dtype, hence the KV-cache spec.
        """

        def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
            super().__init__()
            config = vllm_config.model_config.hf_config
            cache_config = vllm_config.cache_config
            assert cache_config is not None, "DeepseekV4 attention requires cache_config"
            full_cls = select_attn_cls(vllm_config)
            self.full_attention_class = full_cls.__name__
            self.backend_cls = full_cls.backend_cls
            self.prefix = prefix
            self.n_heads = config.num_attention_heads
            self.n_local_heads = self.n_heads // get_tensor_model_parallel_world_size()
            self.head_dim = config.head_dim
            self.rope_head_dim = config.qk_rope_head_dim
            self.window_size = config.sliding_window
            # Draft layers sit past num_hidden_layers: never compressed (attention.py).
            self.compress_ratio = 1
            self.eps = config.rms_norm_eps
            self.scale = self.head_dim**-0.5
            self.padded_heads = full_cls.get_padded_num_q_heads(self.n_local_heads)
            self.kv_norm = RMSNorm(self.head_dim, self.eps)
            self.rotary_emb = build_deepseek_v4_rope(
                config,
                head_dim=self.head_dim,
                rope_head_dim=self.rope_head_dim,
                max_position_embeddings=config.max_position_embeddings,
                compress_ratio=self.compress_ratio,
            )
            # Same resolution (and the same cache_config write-back) as the full layer.
            self.kv_cache_dtype, self.kv_cache_torch_dtype = (
                dsv4_attention._resolve_dsv4_kv_cache_dtype(
                    bool(full_cls.use_fp8_ds_mla_layout),
                    cache_config.cache_dtype,
                    cache_config,
                )
            )
            self.swa_cache_layer = DeepseekV4SWACache(
                head_dim=self.head_dim,
                window_size=self.window_size,
                dtype=self.kv_cache_torch_dtype,
                prefix=f"{prefix}.swa_cache",
                cache_config=cache_config,
                backend_cls=full_cls.swa_backend_cls,
            )
            if self.kv_cache_torch_dtype == torch.float8_e4m3fn:
                # The per-tensor FP8 insert reads these (FlashInfer classes set them to 1).
                for name in (
                    "_flashinfer_fp8_q_scale",
                    "_flashinfer_fp8_q_scale_inv",
                    "_flashinfer_fp8_kv_scale",
                ):
                    self.register_buffer(name, torch.ones(1, dtype=torch.float32), persistent=False)
            drafter.register_cache_layer(self, vllm_config, prefix)

        # vLLM 0.34.0's own AttentionLayerBase methods of DeepseekV4Attention (spec: None
        # for compress ratio 1, the SWA cache is its own layer).
        bind_kv_cache = dsv4_attention.DeepseekV4Attention.bind_kv_cache
        get_attn_backend = dsv4_attention.DeepseekV4Attention.get_attn_backend
        get_kv_cache_spec = dsv4_attention.DeepseekV4Attention.get_kv_cache_spec

        forward = drafter.refusing("draft attention forward")

    class DeepseekV4ContextKVLayer(nn.Module):
        def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
            super().__init__()
            self.attn = DeepseekV4ContextKVAttention(vllm_config, prefix=f"{prefix}.attn")

        forward = drafter.refusing("draft decoder layer forward")

    # vLLM 0.34.0's context-KV code, unchanged (deepseek_v4/nvidia/dspark.py).
    context_path: Any = drafter.context_path(
        base_model, "combine_hidden_states", "precompute_and_store_context_kv"
    )

    class DSparkDeepseekV4ContextKVModel(context_path, nn.Module):
        """main_proj/main_norm + context_wkv_proj + per-layer kv_norm/rope/SWA cache."""

        def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
            super().__init__()
            spec = vllm_config.speculative_config
            assert spec is not None
            n_layers = getattr(spec.draft_model_config.hf_config, "n_mtp_layers", None) or 3
            drafter.build_mtp_context_model(
                self, vllm_config, prefix, n_layers, DeepseekV4ContextKVLayer
            )

    class DSparkDeepseekV4ContextKVForCausalLM(drafter.ContextKVDrafter, nn.Module):
        """Top level of the DeepSeek-V4 context-KV-only DSpark drafter."""

        family = "DeepSeek-V4 DSpark"
        model_cls = DSparkDeepseekV4ContextKVModel
        is_context_kv_weight = staticmethod(is_dsv4_context_kv_weight)
        skipped_note = "embeddings, heads, MoE, query/output projections, hyper-connections"

        def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self.quant_config = vllm_config.quant_config

        @staticmethod
        def model_kwargs(vllm_config: VllmConfig) -> dict[str, Any]:
            return {}  # numbered from the draft config's num_hidden_layers (the target's own)

        combine_hidden_states = base_top.combine_hidden_states
        get_draft_kv_cache_layer_names = base_top.get_draft_kv_cache_layer_names
        precompute_and_store_context_kv = base_top.precompute_and_store_context_kv

        def load_context_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
            return drafter.load_mtp_context_weights(self, weights)

    return DSparkDeepseekV4ContextKVForCausalLM


#: Its drafter ships inside the target checkpoint: the target must be a DeepSeek-V4 one.
families.register(
    families.DraftFamily(
        "DeepSeek-V4 DSpark",
        ("DSparkDraftModel",),
        __name__,
        dsv4_context_kv_class,
        start_checks=(drafter.check_target_carries_the_draft,),
    )
)
