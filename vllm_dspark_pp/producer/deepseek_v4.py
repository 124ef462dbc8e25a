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

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from vllm.logger import init_logger
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.models.deepseek_v4 import attention as dsv4_attention
from vllm.models.deepseek_v4.common.rope import build_deepseek_v4_rope
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

from vllm_dspark_pp.producer import drafter

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger("vllm.dspark_pp.producer.deepseek_v4")

#: vLLM 0.34.0's CUDA implementations (the registry's platform pick on NVIDIA).
DSV4_NVIDIA_MODULE = "vllm.models.deepseek_v4.nvidia.dspark"
FAMILY = "DeepSeek-V4 DSpark"
#: vLLM's registry entry, which picks the platform's implementation.
_REGISTRY_MODULE = "vllm.models.deepseek_v4"


def _n_layers(config: Any) -> int:
    return getattr(config, "n_mtp_layers", None) or 3


# --------------------------------------------------------------------------- weights
# The draft weights ship in the target checkpoint as ``mtp.<i>.*`` (shared with V4.1: drafter.py).
is_dsv4_context_kv_weight = drafter.is_mtp_context_weight
dsv4_skipped_weight_names = drafter.mtp_skipped_weight_names
_dsv4_param_name = drafter.mtp_context_param_name


# --------------------------------------------------------------------------- vLLM's drafter
#: The module of vLLM's DeepSeek-V4 DSpark drafter the classes below borrow from: this platform's
#: where it has one, else the CUDA one (:func:`.drafter.mtp_vllm_module`).
_VLLM: Any = drafter.mtp_vllm_module(_REGISTRY_MODULE, DSV4_NVIDIA_MODULE)
_select_attn_cls: Any = drafter.mtp_select_attn_cls(_VLLM)
_BASE_MODEL: Any = _VLLM.DSparkDeepseekV4Model
_BASE_TOP: Any = _VLLM.DSparkDeepseekV4ForCausalLM


# --------------------------------------------------------------------------- DeepSeek-V4
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
        full_cls = _select_attn_cls(vllm_config)
        self.full_attention_class = full_cls.__name__
        self.backend_cls = full_cls.backend_cls
        self.prefix = prefix
        # Draft layers sit past num_hidden_layers: never compressed (attention.py).
        drafter.set_mtp_attention_geometry(self, config, full_cls, 1, build_deepseek_v4_rope)
        # Same resolution (and the same cache_config write-back) as the full layer.
        self.kv_cache_dtype, self.kv_cache_torch_dtype = (
            dsv4_attention._resolve_dsv4_kv_cache_dtype(
                bool(full_cls.use_fp8_ds_mla_layout),
                cache_config.cache_dtype,
                cache_config,
            )
        )
        self.swa_cache_layer = DeepseekV4SWACache(
            head_dim=config.head_dim,
            window_size=config.sliding_window,
            dtype=self.kv_cache_torch_dtype,
            prefix=f"{prefix}.swa_cache",
            cache_config=cache_config,
            backend_cls=full_cls.swa_backend_cls,
        )
        if self.kv_cache_torch_dtype == torch.float8_e4m3fn:
            drafter.register_fp8_scales(self)
        drafter.register_cache_layer(self, vllm_config, prefix)

    # vLLM 0.34.0's own AttentionLayerBase methods of DeepseekV4Attention (spec: None
    # for compress ratio 1, the SWA cache is its own layer).
    bind_kv_cache = dsv4_attention.DeepseekV4Attention.bind_kv_cache
    get_attn_backend = dsv4_attention.DeepseekV4Attention.get_attn_backend
    get_kv_cache_spec = dsv4_attention.DeepseekV4Attention.get_kv_cache_spec

    forward = drafter.refusing("draft attention forward")


class DSparkDeepseekV4ContextKVLayer(drafter.MtpContextLayer):
    """A DeepSeek-V4 DSpark draft layer holding only its attention."""

    attn_cls = DeepseekV4ContextKVAttention


class DSparkDeepseekV4ContextKVModel(drafter.MtpContextModel):
    """The DeepSeek-V4 DSpark context model: main_proj/main_norm, context_wkv_proj, its layers."""

    layer_cls = DSparkDeepseekV4ContextKVLayer
    n_layers = staticmethod(_n_layers)

    # vLLM 0.34.0's context-KV code, unchanged (deepseek_v4/nvidia/dspark.py).
    combine_hidden_states = _BASE_MODEL.combine_hidden_states
    precompute_and_store_context_kv = _BASE_MODEL.precompute_and_store_context_kv


class DSparkDeepseekV4ContextKVForCausalLM(drafter.MtpContextDrafter):
    """Top level of the DeepSeek-V4 DSpark context-KV-only drafter."""

    family = FAMILY
    model_cls = DSparkDeepseekV4ContextKVModel

    combine_hidden_states = _BASE_TOP.combine_hidden_states
    get_draft_kv_cache_layer_names = _BASE_TOP.get_draft_kv_cache_layer_names
    precompute_and_store_context_kv = _BASE_TOP.precompute_and_store_context_kv

    @classmethod
    def check_platform(cls) -> None:
        drafter.check_mtp_platform(FAMILY, _REGISTRY_MODULE)
