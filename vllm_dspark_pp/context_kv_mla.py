"""Context-KV-only DSpark drafters for the MLA-style families: DeepSeek-V4 and Kimi-K3.

Same contract as the Qwen3 build in :mod:`vllm_dspark_pp.context_kv`: a prefill-only producer
builds only the modules that write the draft's context KV, under the same KV-cache layer names
and with the same KV-cache specs as vLLM 0.34.0's full drafter (the decoder pulls the KV by layer
name), loads only their weights, and raises ``ContextOnlyDrafterError`` for anything that drafts.
The context-KV computation itself is vLLM's own code, borrowed unchanged as methods that only
read the attributes built here.

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
Kimi-K3 DSpark (``K3DSparkModel`` -> ``vllm/models/kimi_k3/nvidia/dspark_mla.py``)
    Built: ``model.context_proj`` + ``model.context_norm``, ``model.context_kv_proj`` (every
    layer's ``kv_a_proj_with_mqa`` stacked), and per draft layer the latent KV cache layer
    ``model.layers.<N+i>.self_attn`` (an MLA attention layer: ``kv_a_layernorm``, the rotary
    table, the MLA backend/impl used to write the cache, KV-cache quant scales). Skipped:
    embedding, LM head, ``q_a_proj``/``q_a_layernorm``/``q_b_proj``/``kv_b_proj``/``o_proj``,
    the per-layer ``fused_qkv_a_proj``, MLPs, layer norms, ``final_norm``, Markov and
    confidence heads.
"""

from __future__ import annotations

import importlib
import math
import re
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from vllm_dspark_pp.context_kv import ContextOnlyDrafterError, RefuseDrafting, refusing

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

logger = init_logger("vllm.dspark_pp.context_kv_mla")

DSV4_ARCH = "DSparkDraftModel"
K3_ARCH = "K3DSparkModel"

#: vLLM 0.34.0's CUDA implementations (the registry's platform pick on NVIDIA).
DSV4_NVIDIA_MODULE = "vllm.models.deepseek_v4.nvidia.dspark"
K3_NVIDIA_MODULE = "vllm.models.kimi_k3.nvidia.dspark_mla"


# --------------------------------------------------------------------------- weights
# DeepSeek-V4: the draft weights ship in the target checkpoint as ``mtp.<i>.*``.
_DSV4_KEEP = re.compile(
    r"^(?:mtp\.\d+\.(?:main_proj|main_norm)\.|"
    r"mtp\.\d+\.attn\.(?:wkv|kv_norm)\.|"
    r"context_wkv_proj\.)"
)
# Kimi-K3: a draft-specific checkpoint in HF layout (no ``model.`` prefix).
_K3_KEEP = re.compile(
    r"^(?:model\.)?(?:context_proj\.|context_norm\.|context_kv_proj\.|"
    r"layers\.\d+\.self_attn\.(?:kv_a_proj_with_mqa\.|kv_a_layernorm\.|"
    r"(?:k|v|q|kv|prob)_scale$))"
)


def is_dsv4_context_kv_weight(name: str) -> bool:
    """Whether a DeepSeek-V4 checkpoint tensor feeds the context-only drafter."""
    return _DSV4_KEEP.match(name) is not None


def is_k3_context_kv_weight(name: str) -> bool:
    """Whether a Kimi-K3 DSpark checkpoint tensor feeds the context-only drafter."""
    return _K3_KEEP.match(name) is not None


def dsv4_skipped_weight_names(names: Iterable[str]) -> list[str]:
    return [n for n in names if not is_dsv4_context_kv_weight(n)]


def k3_skipped_weight_names(names: Iterable[str]) -> list[str]:
    return [n for n in names if not is_k3_context_kv_weight(n)]


def _platform_module(arch: str, registry_module: str, module_name: str | None) -> Any:
    """The module that holds vLLM's full drafter for ``arch`` on this platform."""
    if module_name is None:
        # The registry entry resolves the platform implementation (deepseek_v4/__init__.py).
        top = importlib.import_module(registry_module)
        cls_name = "DSparkDeepseekV4ForCausalLM" if arch == DSV4_ARCH else "K3DSparkForCausalLM"
        module_name = getattr(top, cls_name).__module__
    return importlib.import_module(module_name)


def _refuse_platform(family: str, module: Any, missing: str) -> NotImplementedError:
    return NotImplementedError(
        f"vllm-dspark-pp's context-KV-only {family} drafter needs vLLM's CUDA implementation "
        f"({missing} is missing from {module.__name__}; vLLM 0.34.0 ships a DSpark drafter for "
        "this family only on CUDA/ROCm, and the context-only build follows the CUDA one). "
        "Run this producer on NVIDIA GPUs or with kv_role='kv_both'."
    )


# --------------------------------------------------------------------------- DeepSeek-V4
def _build_dsv4_classes(module_name: str | None = None) -> type:
    """Define the DeepSeek-V4 context-only classes against vLLM's drafter module."""
    import torch
    from torch import nn
    from vllm.config import get_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.model_executor.models.utils import maybe_prefix
    from vllm.models.deepseek_v4 import attention as dsv4_attention
    from vllm.models.deepseek_v4.common.rope import build_deepseek_v4_rope
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    dspark = _platform_module(DSV4_ARCH, "vllm.models.deepseek_v4", module_name)
    base_model = getattr(dspark, "DSparkDeepseekV4Model", None)
    if base_model is None:
        raise _refuse_platform("DeepSeek-V4 DSpark", dspark, "DSparkDeepseekV4Model")
    base_top = dspark.DSparkDeepseekV4ForCausalLM
    model_module = sys.modules[dspark.DeepseekV4DecoderLayer.__module__]
    select_attn_cls = getattr(model_module, "_select_dsv4_attn_cls", None)
    if select_attn_cls is None:
        raise _refuse_platform("DeepSeek-V4 DSpark", model_module, "_select_dsv4_attn_cls")

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
                    bool(full_cls.use_fp8_ds_mla_layout), cache_config.cache_dtype,
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
                for name in ("_flashinfer_fp8_q_scale", "_flashinfer_fp8_q_scale_inv",
                             "_flashinfer_fp8_kv_scale"):
                    self.register_buffer(
                        name, torch.ones(1, dtype=torch.float32), persistent=False
                    )
            forward_context = vllm_config.compilation_config.static_forward_context
            if prefix in forward_context:
                raise ValueError(f"Duplicate layer name: {prefix}")
            forward_context[prefix] = self
            self.kv_cache = torch.tensor([])

        # vLLM 0.34.0's own AttentionLayerBase methods of DeepseekV4Attention (spec: None
        # for compress ratio 1, the SWA cache is its own layer).
        bind_kv_cache = dsv4_attention.DeepseekV4Attention.bind_kv_cache
        get_attn_backend = dsv4_attention.DeepseekV4Attention.get_attn_backend
        get_kv_cache_spec = dsv4_attention.DeepseekV4Attention.get_kv_cache_spec

        forward = refusing("draft attention forward")

    class DeepseekV4ContextKVLayer(nn.Module):
        def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
            super().__init__()
            self.attn = DeepseekV4ContextKVAttention(vllm_config, prefix=f"{prefix}.attn")

        forward = refusing("draft decoder layer forward")

    class DSparkDeepseekV4ContextKVModel(nn.Module):
        """main_proj/main_norm + context_wkv_proj + per-layer kv_norm/rope/SWA cache."""

        def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
            super().__init__()
            spec = vllm_config.speculative_config
            assert spec is not None
            config = spec.draft_model_config.hf_config
            self.config = config
            self.hidden_size = config.hidden_size
            self.num_hidden_layers = config.num_hidden_layers
            self.target_layer_ids = tuple(config.dspark_target_layer_ids)
            self.num_dspark_layers = getattr(config, "n_mtp_layers", None) or 3
            linear = {"bias": False, "return_bias": False,
                      "quant_config": vllm_config.quant_config}
            self.main_proj = ReplicatedLinear(
                config.hidden_size * len(self.target_layer_ids), config.hidden_size,
                prefix=maybe_prefix(prefix, "main_proj"), **linear,
            )
            self.main_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            current = get_current_vllm_config()
            self.layers = nn.ModuleList(
                DeepseekV4ContextKVLayer(
                    current, prefix=maybe_prefix(prefix, f"layers.{self.num_hidden_layers + i}")
                )
                for i in range(self.num_dspark_layers)
            )
            self.context_wkv_proj = MergedColumnParallelLinear(
                config.hidden_size, [config.head_dim] * self.num_dspark_layers,
                prefix=maybe_prefix(prefix, "context_wkv_proj"), disable_tp=True, **linear,
            )
            self.confidence_head = None

        # vLLM 0.34.0's context-KV code, unchanged (deepseek_v4/nvidia/dspark.py).
        combine_hidden_states = base_model.combine_hidden_states
        precompute_and_store_context_kv = base_model.precompute_and_store_context_kv

        forward = refusing("draft backbone forward")

        embed_input_ids = refusing("draft token embedding")

    class DSparkDeepseekV4ContextKVForCausalLM(RefuseDrafting, nn.Module):
        """Top level of the DeepSeek-V4 context-KV-only DSpark drafter."""

        family = "DeepSeek-V4 DSpark"

        def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
            super().__init__()
            spec = vllm_config.speculative_config
            assert spec is not None
            self.draft_model_config = spec.draft_model_config
            self.config = self.draft_model_config.hf_config
            self.quant_config = vllm_config.quant_config
            self.model = DSparkDeepseekV4ContextKVModel(
                vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model")
            )

        combine_hidden_states = base_top.combine_hidden_states
        get_draft_kv_cache_layer_names = base_top.get_draft_kv_cache_layer_names
        precompute_and_store_context_kv = base_top.precompute_and_store_context_kv

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            """Load main_proj/main_norm, kv_norm and each layer's wkv (into
            context_wkv_proj, shard = layer) from the target checkpoint's ``mtp.*``."""
            params = dict(self.named_parameters())
            loaded: set[str] = set()
            skipped = 0
            n_layers = len(self.model.layers)
            for name, tensor in weights:
                if not is_dsv4_context_kv_weight(name):
                    skipped += 1
                    continue
                target, shard = _dsv4_param_name(name, n_layers)
                if target is None:
                    skipped += 1
                    continue
                param = params[target]
                if shard is not None:
                    param.weight_loader(param, tensor, shard)
                else:
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(target)
            logger.info(
                "Context-KV-only DeepSeek-V4 DSpark drafter: loaded %d tensors, skipped %d "
                "(embeddings, heads, MoE, query/output projections, hyper-connections).",
                len(loaded), skipped,
            )
            return loaded

    return DSparkDeepseekV4ContextKVForCausalLM


def _dsv4_param_name(name: str, n_layers: int) -> tuple[str | None, int | None]:
    """Checkpoint name -> (context-only parameter, shard of context_wkv_proj or None)."""
    scale = name.endswith(".scale")
    if scale:  # block-fp8 linear scales (the full loader's ``.scale`` rename)
        name = name.removesuffix(".scale") + ".weight_scale_inv"
    if name.startswith("context_wkv_proj."):
        return "model." + name, None
    m = re.match(r"mtp\.(\d+)\.(.*)$", name)
    assert m is not None
    stage, rest = int(m.group(1)), m.group(2)
    if rest.startswith(("main_proj.", "main_norm.")):
        return "model." + rest, None
    if rest.startswith("attn.kv_norm."):
        return f"model.layers.{stage}.{rest}", None
    if rest.startswith("attn.wkv."):
        if stage >= n_layers:
            return None, None
        return "model.context_wkv_proj." + rest.removeprefix("attn.wkv."), stage
    return None, None


# --------------------------------------------------------------------------- Kimi-K3
def _build_k3_classes(module_name: str | None = None) -> type:
    """Define the Kimi-K3 context-only classes against vLLM's drafter module."""
    import torch
    from torch import nn
    from vllm.config import get_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_world_size
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
    from vllm.v1.attention.selector import get_attn_backend

    dspark = _platform_module(K3_ARCH, K3_NVIDIA_MODULE, module_name)
    base_model = getattr(dspark, "K3DSparkModel", None)
    if base_model is None:
        raise _refuse_platform("Kimi-K3 DSpark", dspark, "K3DSparkModel")
    base_top = dspark.K3DSparkForCausalLM
    base_attn = dspark.MultiHeadLatentAttention

    class K3DSparkContextKVAttention(nn.Module, AttentionLayerBase):
        """The latent-KV-cache half of Kimi-K3's MultiHeadLatentAttention (draft layer):
        same layer name, backend, head size, cache dtype and quant scales; no projections."""

        def __init__(self, *, config: Any, cache_config: Any, quant_config: Any,
                     prefix: str) -> None:
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
                self.head_size, self.act_dtype, self.kv_cache_dtype, use_mla=True,
                use_sparse=False, num_heads=self.num_local_heads,
            )
            _init_kv_cache_quant(self, quant_config, prefix)
            # The backend's impl writes the cache on the per-layer insert path
            # (do_kv_cache_update); it is never asked to attend, so no kv_b_proj.
            self.impl = self.attn_backend.get_impl_cls()(
                num_heads=self.num_local_heads, head_size=self.head_size, scale=self.scale,
                num_kv_heads=1, alibi_slopes=None, sliding_window=None,
                kv_cache_dtype=self.kv_cache_dtype, logits_soft_cap=None,
                attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                qk_nope_head_dim=self.qk_nope_head_dim,
                qk_rope_head_dim=self.qk_rope_head_dim, qk_head_dim=self.qk_head_dim,
                v_head_dim=self.v_head_dim, kv_b_proj=None, indexer=None,
            )
            if getattr(self.impl, "dcp_world_size", -1) < 1:
                self.impl.dcp_world_size = 1
                self.impl.dcp_rank = 0
            forward_context = get_current_vllm_config().compilation_config
            if prefix in forward_context.static_forward_context:
                raise ValueError(f"Duplicate layer name: {prefix}")
            forward_context.static_forward_context[prefix] = self
            self.kv_cache = torch.tensor([])

        def _make_rope(self, config: Any) -> Any:
            rope = dict(config.rope_parameters)
            if rope["rope_type"] != "default":
                rope["rope_type"] = ("deepseek_llama_scaling"
                                     if rope.get("attention_factor") == 1.0 else "deepseek_yarn")
            emb = get_rope(self.qk_rope_head_dim, max_position=config.max_position_embeddings,
                           rope_parameters=rope, is_neox_style=False, dtype=torch.float32)
            if rope["rope_type"] == "deepseek_yarn" and rope["factor"] > 1:
                m = 0.1 * float(rope.get("mscale_all_dim", False)) * math.log(rope["factor"]) + 1
                self.scale *= m * m
            return emb

        # vLLM 0.34.0's own AttentionLayerBase methods (kimi_k3/nvidia/mla.py).
        bind_kv_cache = base_attn.bind_kv_cache
        get_attn_backend = base_attn.get_attn_backend
        get_kv_cache_spec = base_attn.get_kv_cache_spec

        def process_weights_after_loading(self) -> None:
            """KV-cache scales only (the full layer also absorbs kv_b_proj, absent here)."""
            method = (resolve_quant_method(self.quant_config, self, prefix=self.layer_name)
                      if self.quant_config else None)
            if not should_load_quant_weights(method):
                set_default_quant_scales(self, register_buffer=False)

        forward = refusing("draft attention forward")

    class K3DSparkContextKVLayer(nn.Module):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__()
            self.self_attn = K3DSparkContextKVAttention(**kwargs)

        forward = refusing("draft decoder layer forward")

    class K3DSparkContextKVModel(nn.Module):
        """context_proj/context_norm + context_kv_proj + per-layer latent KV cache."""

        def __init__(self, *, vllm_config: VllmConfig, start_layer_id: int,
                     prefix: str) -> None:
            super().__init__()
            spec = vllm_config.speculative_config
            assert spec is not None
            self.config = config = spec.draft_model_config.hf_config
            self.quant_config = get_draft_quant_config(vllm_config)
            self.context_proj = ReplicatedLinear(
                config.target_hidden_size * config.num_target_layers, config.hidden_size,
                bias=False, return_bias=False, quant_config=self.quant_config,
                prefix=maybe_prefix(prefix, "context_proj"),
            )
            self.context_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.layers = nn.ModuleList(
                K3DSparkContextKVLayer(
                    config=config, cache_config=vllm_config.cache_config,
                    quant_config=self.quant_config,
                    prefix=maybe_prefix(prefix, f"layers.{start_layer_id + i}.self_attn"),
                )
                for i in range(config.num_hidden_layers)
            )
            width = config.kv_lora_rank + config.qk_rope_head_dim
            self.context_kv_proj = MergedColumnParallelLinear(
                config.hidden_size, [width] * config.num_hidden_layers,
                bias=False, return_bias=False, quant_config=self.quant_config,
                # the full drafter's prefix (its quant-config lookup name)
                prefix=maybe_prefix(prefix, f"layers.{start_layer_id}.self_attn.fused_qkv_a_proj"),
                disable_tp=True,
            )
            self.confidence_head = None
            self._max_num_context_tokens = vllm_config.scheduler_config.max_num_batched_tokens

        # vLLM 0.34.0's context-KV code, unchanged (kimi_k3/nvidia/dspark_mla.py).
        combine_hidden_states = base_model.combine_hidden_states
        precompute_and_store_context_kv = base_model.precompute_and_store_context_kv
        _build_fused_context_kv_metadata = base_model._build_fused_context_kv_metadata
        _precompute_fused_context_kv = base_model._precompute_fused_context_kv
        _has_uniform_block_layout = base_model._has_uniform_block_layout
        _get_context_kv_cache_ptrs = base_model._get_context_kv_cache_ptrs

        forward = refusing("draft backbone forward")

        embed_input_ids = refusing("draft token embedding")

    k3_mapper = WeightsMapper(orig_to_new_prefix={"": "model."})

    class K3DSparkContextKVForCausalLM(RefuseDrafting, nn.Module):
        """Top level of the Kimi-K3 context-KV-only DSpark drafter."""

        family = "Kimi-K3 DSpark"
        speculator_config_class = getattr(base_top, "speculator_config_class", None)

        def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
            super().__init__()
            spec = vllm_config.speculative_config
            assert spec is not None
            self.draft_model_config = spec.draft_model_config
            self.config = self.draft_model_config.hf_config
            self.model = K3DSparkContextKVModel(
                vllm_config=vllm_config,
                start_layer_id=vllm_config.model_config.get_total_num_hidden_layers(),
                prefix=maybe_prefix(prefix, "model"),
            )

        combine_hidden_states = base_top.combine_hidden_states
        get_draft_kv_cache_layer_names = base_top.get_draft_kv_cache_layer_names
        precompute_and_store_context_kv = base_top.precompute_and_store_context_kv
        process_weights_after_loading = base_top.process_weights_after_loading

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            counts = {"skipped": 0}
            stacked = dspark._duplicate_context_kv_weights(
                self._context_only(weights, counts), len(self.model.layers)
            )
            # The per-layer kv_a_proj_with_mqa rows live only in context_kv_proj here.
            kept = ((n, w) for n, w in stacked if ".kv_a_proj_with_mqa." not in n)
            loaded = AutoWeightsLoader(self).load_weights(kept, mapper=k3_mapper)
            logger.info(
                "Context-KV-only Kimi-K3 DSpark drafter: loaded %d parameters, skipped %d "
                "tensors (embeddings, heads, MLPs, query/output projections).",
                len(loaded), counts["skipped"],
            )
            return loaded

        @staticmethod
        def _context_only(
            weights: Iterable[tuple[str, torch.Tensor]], counts: dict[str, int]
        ) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if is_k3_context_kv_weight(name):
                    yield name.removeprefix("model."), tensor
                else:
                    counts["skipped"] += 1

    return K3DSparkContextKVForCausalLM


# --------------------------------------------------------------------------- cache
_CLASSES: dict[tuple[str, str | None], type] = {}


def dsv4_context_kv_class(module_name: str | None = None) -> type:
    """The DeepSeek-V4 context-only top-level class (``module_name``: vLLM's drafter module,
    default: the registry's platform pick)."""
    key = (DSV4_ARCH, module_name)
    if key not in _CLASSES:
        _CLASSES[key] = _build_dsv4_classes(module_name)
    return _CLASSES[key]


def k3_context_kv_class(module_name: str | None = None) -> type:
    """The Kimi-K3 context-only top-level class."""
    key = (K3_ARCH, module_name)
    if key not in _CLASSES:
        _CLASSES[key] = _build_k3_classes(module_name)
    return _CLASSES[key]


__all__ = [
    "ContextOnlyDrafterError",
    "DSV4_ARCH",
    "K3_ARCH",
    "dsv4_context_kv_class",
    "dsv4_skipped_weight_names",
    "is_dsv4_context_kv_weight",
    "is_k3_context_kv_weight",
    "k3_context_kv_class",
    "k3_skipped_weight_names",
]
