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

import re
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
# DeepSeek-V4: the draft weights ship in the target checkpoint as ``mtp.<i>.*``.
_DSV4_KEEP = re.compile(
    r"^(?:mtp\.\d+\.(?:main_proj|main_norm)\.|"
    r"mtp\.\d+\.attn\.(?:wkv|kv_norm)\.|"
    r"context_wkv_proj\.)"
)


#: Whether a DeepSeek-V4 checkpoint tensor feeds the context-only drafter; the rest.
is_dsv4_context_kv_weight, dsv4_skipped_weight_names = drafter.weight_filter(_DSV4_KEEP)


# --------------------------------------------------------------------------- DeepSeek-V4
@drafter.built_once
def dsv4_context_kv_class(module_name: str | None = None) -> type:
    """The DeepSeek-V4 context-only top-level class (``module_name``: vLLM's drafter module,
    default: the registry's platform pick)."""
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
            config = spec.draft_model_config.hf_config
            self.config = config
            self.hidden_size = config.hidden_size
            self.num_hidden_layers = config.num_hidden_layers
            self.target_layer_ids = tuple(config.dspark_target_layer_ids)
            self.num_dspark_layers = getattr(config, "n_mtp_layers", None) or 3
            linear: dict[str, Any] = {
                "bias": False,
                "return_bias": False,
                "quant_config": vllm_config.quant_config,
            }
            self.main_proj = ReplicatedLinear(
                config.hidden_size * len(self.target_layer_ids),
                config.hidden_size,
                prefix=maybe_prefix(prefix, "main_proj"),
                **linear,
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
                config.hidden_size,
                [config.head_dim] * self.num_dspark_layers,
                prefix=maybe_prefix(prefix, "context_wkv_proj"),
                disable_tp=True,
                **linear,
            )
            self.confidence_head = None

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
            """main_proj/main_norm, kv_norm and each layer's wkv (into context_wkv_proj,
            shard = layer) from the target checkpoint's ``mtp.*``."""
            params = dict(self.named_parameters())
            loaded: set[str] = set()
            for name, tensor in weights:
                target, shard = _dsv4_param_name(name, len(self.model.layers))
                if target is None:
                    continue
                param = params[target]
                if shard is not None:
                    param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]
                else:
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(target)
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
