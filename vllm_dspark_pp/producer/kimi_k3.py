"""Kimi-K3 DSpark: the context-KV-only drafter (see :mod:`.drafter` for the contract).

Kimi-K3 DSpark (``K3DSparkModel`` -> ``vllm/models/kimi_k3/nvidia/dspark_mla.py``)
    Built: ``model.context_proj`` + ``model.context_norm``, ``model.context_kv_proj`` (every
    layer's ``kv_a_proj_with_mqa`` stacked), and per draft layer the latent KV cache layer
    ``model.layers.<N+i>.self_attn`` (an MLA attention layer: ``kv_a_layernorm``, the rotary
    table, the MLA backend/impl used to write the cache, KV-cache quant scales, the MLA prefill
    backend object vLLM's metadata builders clone). Skipped:
    embedding, LM head, ``q_a_proj``/``q_a_layernorm``/``q_b_proj``/``kv_b_proj``/``o_proj``,
    the per-layer ``fused_qkv_a_proj``, MLPs, layer norms, ``final_norm``, Markov and
    confidence heads.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.attention import (
    _init_kv_cache_quant,
    set_default_quant_scales,
    should_load_quant_weights,
)
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from vllm.model_executor.layers.quantization import resolve_quant_method
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    WeightsMapper,
    get_draft_quant_config,
    maybe_prefix,
)
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.mla.prefill import get_mla_prefill_backend
from vllm.v1.attention.selector import get_attn_backend

from vllm_dspark_pp.producer import drafter

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger("vllm.dspark_pp.producer.kimi_k3")

#: vLLM 0.34.0's CUDA implementations (the registry's platform pick on NVIDIA).
K3_NVIDIA_MODULE = "vllm.models.kimi_k3.nvidia.dspark_mla"
#: The module that defines vLLM's Kimi-K3 DSpark drafter, whose pieces the classes below borrow.
_VLLM: Any = drafter.platform_module(K3_NVIDIA_MODULE, "K3DSparkForCausalLM")

# Kimi-K3: a draft-specific checkpoint in HF layout (no ``model.`` prefix).
_K3_KEEP = re.compile(
    r"^(?:model\.)?(?:context_proj\.|context_norm\.|context_kv_proj\.|"
    r"layers\.\d+\.self_attn\.(?:kv_a_proj_with_mqa\.|kv_a_layernorm\.|"
    r"(?:k|v|q|kv|prob)_scale$))"
)

#: The MLA latent geometry an attention impl takes from its layer (keyword names of vLLM 0.34.0's
#: ``MLAAttentionImpl.__init__``).
_MLA_LATENT_DIMS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "qk_head_dim",
    "v_head_dim",
)
#: Impl arguments the context-KV-only layer has no use for: it never attends (no ``kv_b_proj``, no
#: indexer, no window, no ALiBi, no soft cap) and shares no KV cache.
_IMPL_ARGS_NOT_USED = (
    "alibi_slopes",
    "sliding_window",
    "logits_soft_cap",
    "kv_sharing_target_layer_name",
    "kv_b_proj",
    "indexer",
)
#: The dimensions an MLA prefill backend is built with (besides head count, scale and config).
_MLA_PREFILL_DIMS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


#: Whether a Kimi-K3 DSpark checkpoint tensor feeds the context-only drafter; the rest.
is_k3_context_kv_weight, k3_skipped_weight_names = drafter.weight_filter(_K3_KEEP)


# --------------------------------------------------------------------------- Kimi-K3
class K3DSparkContextKVAttention(nn.Module, AttentionLayerBase):
    """The latent-KV-cache half of Kimi-K3's MultiHeadLatentAttention (draft layer):
    same layer name, backend, head size, cache dtype and quant scales; no projections."""

    def __init__(self, *, config: Any, cache_config: Any, quant_config: Any, prefix: str) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.non_causal_multi_token_decode = True
        self.head_size = self.kv_lora_rank + self.qk_rope_head_dim  # latent "head"
        self.scale = self.qk_head_dim**-0.5
        self.rms_norm_eps = config.rms_norm_eps
        self.layer_name = prefix
        self.rotary_emb = self._make_rope(config)
        self.num_heads = config.num_attention_heads
        self.num_local_heads = self.num_heads // get_tensor_model_parallel_world_size()
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
        self.quant_config = quant_config
        self.kv_cache_dtype = cache_config.cache_dtype if cache_config else "auto"
        self.act_dtype = torch.get_default_dtype()
        self.attn_backend = get_attn_backend(
            self.head_size,
            self.act_dtype,
            self.kv_cache_dtype,
            use_mla=True,
            use_sparse=False,
            num_heads=self.num_local_heads,
        )
        _init_kv_cache_quant(self, quant_config, prefix)
        # The backend's impl writes the cache on the per-layer insert path
        # (do_kv_cache_update); it is never asked to attend, so no kv_b_proj.
        latent_dims = {dim: getattr(self, dim) for dim in _MLA_LATENT_DIMS}
        unused = dict.fromkeys(_IMPL_ARGS_NOT_USED)
        impl_cls = self.attn_backend.get_impl_cls()
        self.impl = impl_cls(  # type: ignore[assignment]  # an MLA impl
            num_heads=self.num_local_heads,
            head_size=self.head_size,
            scale=self.scale,
            num_kv_heads=1,
            kv_cache_dtype=self.kv_cache_dtype,
            attn_type=AttentionType.DECODER,
            **latent_dims,
            **unused,
        )
        # A backend that reads the decode-context-parallel world needs it set (1 rank).
        if getattr(self.impl, "dcp_world_size", -1) < 1:
            self.impl.dcp_world_size, self.impl.dcp_rank = 1, 0
        vllm_config = get_current_vllm_config()
        self._refuse_context_parallel(vllm_config.parallel_config)
        # What vLLM's MLA metadata builders read from the group's first layer besides the
        # latent dims and impl: no DCP manager (one rank), and a prefill backend that each
        # builder clones (mla_attention.py MLACommonMetadataBuilder.__init__). This layer
        # never runs prefill attention; the builders need the object all the same.
        self.dcp_manager = None
        prefill_cls = get_mla_prefill_backend(vllm_config)
        self.prefill_backend = prefill_cls(
            num_heads=self.num_local_heads,
            scale=self.scale,
            vllm_config=vllm_config,
            **{dim: getattr(self, dim) for dim in _MLA_PREFILL_DIMS},
        )
        drafter.register_cache_layer(self, vllm_config, prefix)

    @staticmethod
    def _refuse_context_parallel(parallel: Any) -> None:
        """Decode/prefill context parallelism needs a DCP manager built from kv_b_proj,
        which this layer does not have: refuse at start-up instead of failing in the
        metadata builder."""
        dcp = parallel.decode_context_parallel_size
        pcp = parallel.prefill_context_parallel_size
        if dcp > 1 or pcp > 1:
            raise ValueError(
                "The context-KV-only Kimi-K3 DSpark drafter (prefill-only KV producer) "
                f"supports no context parallelism (decode_context_parallel_size={dcp}, "
                f"prefill_context_parallel_size={pcp}); run the producer with both at 1."
            )

    def _make_rope(self, config: Any) -> Any:
        rope = dict(config.rope_parameters)
        if rope["rope_type"] != "default":
            rope["rope_type"] = (
                "deepseek_llama_scaling" if rope.get("attention_factor") == 1.0 else "deepseek_yarn"
            )
        emb = get_rope(
            self.qk_rope_head_dim,
            max_position=config.max_position_embeddings,
            rope_parameters=rope,
            is_neox_style=False,
            dtype=torch.float32,
        )
        if rope["rope_type"] == "deepseek_yarn" and rope["factor"] > 1:
            m = 0.1 * float(rope.get("mscale_all_dim", False)) * math.log(rope["factor"]) + 1
            self.scale *= m * m
        return emb

    # vLLM 0.34.0's own AttentionLayerBase methods (kimi_k3/nvidia/mla.py).
    bind_kv_cache = _VLLM.MultiHeadLatentAttention.bind_kv_cache
    get_attn_backend = _VLLM.MultiHeadLatentAttention.get_attn_backend
    get_kv_cache_spec = _VLLM.MultiHeadLatentAttention.get_kv_cache_spec

    def process_weights_after_loading(self) -> None:
        """KV-cache scales only (the full layer also absorbs kv_b_proj, absent here)."""
        method = (
            resolve_quant_method(self.quant_config, self, prefix=self.layer_name)
            if self.quant_config
            else None
        )
        if not should_load_quant_weights(method):
            set_default_quant_scales(self, register_buffer=False)

    forward = drafter.refusing("draft attention forward")


class K3DSparkContextKVLayer(drafter.AttentionOnlyLayer):
    """A Kimi-K3 DSpark draft layer holding only its latent KV cache."""

    attn_cls = K3DSparkContextKVAttention


class K3DSparkContextKVModel(drafter.ContextPath, nn.Module):
    """context_proj/context_norm + context_kv_proj + per-layer latent KV cache."""

    # vLLM 0.34.0's context-KV code, unchanged (kimi_k3/nvidia/dspark_mla.py).
    combine_hidden_states = _VLLM.K3DSparkModel.combine_hidden_states
    precompute_and_store_context_kv = _VLLM.K3DSparkModel.precompute_and_store_context_kv
    _build_fused_context_kv_metadata = _VLLM.K3DSparkModel._build_fused_context_kv_metadata
    _precompute_fused_context_kv = _VLLM.K3DSparkModel._precompute_fused_context_kv
    _has_uniform_block_layout = _VLLM.K3DSparkModel._has_uniform_block_layout
    _get_context_kv_cache_ptrs = _VLLM.K3DSparkModel._get_context_kv_cache_ptrs

    def __init__(self, *, vllm_config: VllmConfig, start_layer_id: int, prefix: str) -> None:
        super().__init__()
        spec = vllm_config.speculative_config
        assert spec is not None
        self.config = config = spec.draft_model_config.hf_config
        self.quant_config = get_draft_quant_config(vllm_config)
        self.context_proj = ReplicatedLinear(
            config.target_hidden_size * config.num_target_layers,
            config.hidden_size,
            bias=False,
            return_bias=False,
            quant_config=self.quant_config,
            prefix=maybe_prefix(prefix, "context_proj"),
        )
        self.context_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(
            K3DSparkContextKVLayer(
                config=config,
                cache_config=vllm_config.cache_config,
                quant_config=self.quant_config,
                prefix=maybe_prefix(prefix, f"layers.{start_layer_id + i}.self_attn"),
            )
            for i in range(config.num_hidden_layers)
        )
        width = config.kv_lora_rank + config.qk_rope_head_dim
        self.context_kv_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [width] * config.num_hidden_layers,
            bias=False,
            return_bias=False,
            quant_config=self.quant_config,
            # the full drafter's prefix (its quant-config lookup name)
            prefix=maybe_prefix(prefix, f"layers.{start_layer_id}.self_attn.fused_qkv_a_proj"),
            disable_tp=True,
        )
        self.confidence_head = None
        self._max_num_context_tokens = vllm_config.scheduler_config.max_num_batched_tokens


_K3_MAPPER = WeightsMapper(orig_to_new_prefix={"": "model."})


class K3DSparkContextKVForCausalLM(drafter.ContextKVDrafter, nn.Module):
    """Top level of the Kimi-K3 context-KV-only DSpark drafter."""

    family = "Kimi-K3 DSpark"
    model_cls = K3DSparkContextKVModel
    is_context_kv_weight = staticmethod(is_k3_context_kv_weight)
    speculator_config_class = getattr(_VLLM.K3DSparkForCausalLM, "speculator_config_class", None)

    combine_hidden_states = _VLLM.K3DSparkForCausalLM.combine_hidden_states
    get_draft_kv_cache_layer_names = _VLLM.K3DSparkForCausalLM.get_draft_kv_cache_layer_names
    precompute_and_store_context_kv = _VLLM.K3DSparkForCausalLM.precompute_and_store_context_kv

    def process_weights_after_loading(self) -> None:
        """vLLM's hook (stacks every layer's ``kv_a_layernorm`` weight into
        ``_context_kv_norm_weights``, which the fused insert reads), then the per-layer
        norms become views of that stack: held once. The K/V projection is already held
        once: only the stacked ``context_kv_proj`` is built (the full drafter also keeps
        every layer's rows in its ``fused_qkv_a_proj``)."""
        _VLLM.K3DSparkForCausalLM.process_weights_after_loading(self)
        norms = (layer.self_attn.kv_a_layernorm.weight for layer in self.model.layers)
        drafter.hold_as_views(self.model._context_kv_norm_weights, norms)

    def load_context_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
        unprefixed = ((n.removeprefix("model."), t) for n, t in weights)
        stacked = _VLLM._duplicate_context_kv_weights(unprefixed, len(self.model.layers))
        # The per-layer kv_a_proj_with_mqa rows live only in context_kv_proj here.
        kept = ((n, w) for n, w in stacked if ".kv_a_proj_with_mqa." not in n)
        return AutoWeightsLoader(self).load_weights(kept, mapper=_K3_MAPPER)
