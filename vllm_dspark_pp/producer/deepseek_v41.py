"""DeepSeek-V4.1 DSpark: the context-KV-only drafter (see :mod:`.drafter` for the contract).

DeepSeek-V4.1 DSpark (``DSparkV41DraftModel`` -> ``vllm/models/deepseek_v41/nvidia/dspark.py``)
    The context path is DeepSeek-V4's (:func:`.drafter.build_mtp_context_model`: ``main_proj`` +
    ``main_norm``, ``context_wkv_proj``, per draft layer ``model.layers.<N+i>.attn``) and so are
    the checkpoint names (``mtp.<i>.*``). What differs is the attention layer the insert reads
    (``deepseek_v41/attention.py``): the layer's compress ratio comes from ``compress_ratios``
    (0, sliding window only, past the list), the SWA cache is V4.1's record
    (``DeepseekV4SWACache`` with 32-token blocks, 584 / 528-byte records, the MXFP8 record on
    SM100, bounded replay), and the insert is told ``kv_mxfp8``. Skipped as for V4: embedding,
    LM head, query/output projections, MoE, norms, hyper-connections, Markov and confidence heads.

Memory: the context-only drafter holds ``main_proj``, ``main_norm``, ``context_wkv_proj`` and
the ``kv_norm`` weights (``memory.v41_draft_bytes``, what ``vllm-dspark-pp plan`` prints per role).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.models.utils import extract_layer_index
from vllm.models.deepseek_v41 import attention as v41_attention
from vllm.models.deepseek_v41.common.rope import build_deepseek_v4_rope
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

from vllm_dspark_pp.producer import drafter
from vllm_dspark_pp.producer.memory import v41_layer_count

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: vLLM 0.34.0's CUDA implementation (the registry's pick on every platform but ROCm).
V41_NVIDIA_MODULE = "vllm.models.deepseek_v41.nvidia.dspark"
FAMILY = "DeepSeek-V4.1 DSpark"
#: vLLM's registry entry, which picks the platform's implementation.
_REGISTRY_MODULE = "vllm.models.deepseek_v41"

#: The module of vLLM's DeepSeek-V4.1 DSpark drafter the classes below borrow from: this
#: platform's where it has one, else the CUDA one (:func:`.drafter.mtp_vllm_module`).
_VLLM: Any = drafter.mtp_vllm_module(_REGISTRY_MODULE, V41_NVIDIA_MODULE)
_select_attn_cls: Any = drafter.mtp_select_attn_cls(_VLLM)
_BASE_MODEL: Any = _VLLM.DSparkDeepseekV4Model
_BASE_TOP: Any = _VLLM.DSparkDeepseekV4ForCausalLM


class DeepseekV41ContextKVAttention(nn.Module, AttentionLayerBase):
    """What ``_insert_context_kv`` (v4.1 dspark.py) reads of a draft layer's attention, at
    the values of the class vLLM selects (``_select_dsv4_attn_cls``), computed as
    attention.py:344-640 computes them for a draft layer (never a KV source)."""

    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        cache_config = vllm_config.cache_config
        assert cache_config is not None, "DeepseekV4 attention requires cache_config"
        full_cls = _select_attn_cls(vllm_config)
        self.full_attention_class = full_cls.__name__
        self.backend_cls = full_cls.backend_cls
        self.prefix = prefix
        layer_id = extract_layer_index(prefix)
        ratios = getattr(config, "compress_ratios", None)
        ratio = int(ratios[layer_id]) if ratios is not None and layer_id < len(ratios) else 0
        self.is_kv_source = False  # draft layers sit past num_hidden_layers
        drafter.set_mtp_attention_geometry(self, config, full_cls, ratio, build_deepseek_v4_rope)
        # The class's own answers (properties that read nothing of the instance).
        packed = full_cls.packed_kv_cache_dtype.fget(self)
        self.kv_cache_dtype, self.kv_cache_torch_dtype = v41_attention._resolve_dsv4_kv_cache_dtype(
            bool(full_cls.use_fp8_ds_mla_layout),
            cache_config.cache_dtype,
            cache_config,
            packed,
        )
        self.kv_mxfp8 = v41_attention._use_v41_mxfp8_kv_record()
        self.swa_bytes_per_token = 528 if self.kv_mxfp8 else 584
        self.compressed_bytes_per_token = (
            288 if self.kv_cache_dtype == "nvfp4_ds_mla" else self.swa_bytes_per_token
        )
        self.kv_page_alignment = 512 if self.kv_mxfp8 else 576
        bounded_replay = cache_config.swa_bounded_replay and not (
            vllm_config.parallel_config.prefill_context_parallel_size > 1
            and not cache_config.enable_prefix_caching
        )
        self.swa_cache_layer = DeepseekV4SWACache(
            head_dim=config.head_dim,
            window_size=config.sliding_window,
            dtype=self.kv_cache_torch_dtype,
            prefix=f"{prefix}.swa_cache",
            cache_config=cache_config,
            backend_cls=full_cls.swa_backend_cls,
            block_size=32,
            packed_bytes_per_token=self.swa_bytes_per_token,
            packed_page_alignment=self.kv_page_alignment,
            packed_block_stride_alignment=(
                math.lcm(self.swa_bytes_per_token, self.compressed_bytes_per_token)
                if self.kv_mxfp8
                else None
            ),
            bounded_replay=bounded_replay,
        )
        if self.kv_cache_torch_dtype == torch.float8_e4m3fn:
            drafter.register_fp8_scales(self)
        drafter.register_cache_layer(self, vllm_config, prefix)

    # vLLM 0.34.0's own AttentionLayerBase methods of the V4.1 attention (spec: None for a
    # layer that is no KV source; the SWA cache is its own layer).
    bind_kv_cache = v41_attention.DeepseekV4Attention.bind_kv_cache
    get_attn_backend = v41_attention.DeepseekV4Attention.get_attn_backend
    get_kv_cache_spec = v41_attention.DeepseekV4Attention.get_kv_cache_spec

    forward = drafter.refusing("draft attention forward")


class DSparkDeepseekV41ContextKVLayer(drafter.MtpContextLayer):
    """A DeepSeek-V4.1 DSpark draft layer holding only its attention."""

    attn_cls = DeepseekV41ContextKVAttention


class DSparkDeepseekV41ContextKVModel(drafter.MtpContextModel):
    """The DeepSeek-V4.1 DSpark context model: main_proj/main_norm, context_wkv_proj, its layers."""

    layer_cls = DSparkDeepseekV41ContextKVLayer
    n_layers = staticmethod(v41_layer_count)

    # vLLM 0.34.0's context-KV code, unchanged (deepseek_v41/nvidia/dspark.py).
    combine_hidden_states = _BASE_MODEL.combine_hidden_states
    precompute_and_store_context_kv = _BASE_MODEL.precompute_and_store_context_kv


class DSparkDeepseekV41ContextKVForCausalLM(drafter.MtpContextDrafter):
    """Top level of the DeepSeek-V4.1 DSpark context-KV-only drafter."""

    family = FAMILY
    model_cls = DSparkDeepseekV41ContextKVModel

    combine_hidden_states = _BASE_TOP.combine_hidden_states
    get_draft_kv_cache_layer_names = _BASE_TOP.get_draft_kv_cache_layer_names
    precompute_and_store_context_kv = _BASE_TOP.precompute_and_store_context_kv

    @classmethod
    def check_platform(cls) -> None:
        drafter.check_mtp_platform(FAMILY, _REGISTRY_MODULE)
