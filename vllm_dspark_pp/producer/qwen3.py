"""Qwen3 DSpark: the context-KV-only drafter (its memory rule: :mod:`.memory`).

Built: the context projection (``fc``, target aux hidden states -> draft hidden) and its norm
(``hidden_norm``); per draft layer the K/V projection (the K/V rows of ``qkv_proj`` only), the K
norm (``k_norm``), the rotary embedding and the attention (KV cache) layer, with the same layer
names, heads, head size, sliding window and sinks as the full drafter so that vLLM derives the
identical KV-cache spec. Skipped, never loaded: token embeddings, LM head, Markov head,
confidence head, the final norm, MLPs, query/output projections, q_norm and the per-layer
input/post-attention norms (the context path does not read them:
``qwen3_dflash.py::precompute_and_store_context_kv`` normalises with ``hidden_norm`` and
projects with the K/V rows only).

The K/V computation itself is vLLM's own code: the context model borrows
``DFlashQwen3Model.precompute_and_store_context_kv`` and its helpers unchanged, fed by a
``QKVParallelLinear`` with zero query heads (``q_size == 0``), so the bytes written are the full
drafter's by construction (``tests/gpu/test_producer_gpu.py`` compares cache contents).
The classes are defined here, at the top level, when the producer first routes a Qwen3 DSpark
draft to them (``producer/families.py`` names :class:`Qwen3DSparkContextKVForCausalLM`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from torch import nn
from vllm.config import get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, ReplicatedLinear
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.weight_utils import make_attention_sink
from vllm.model_executor.models import qwen3_dflash
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    get_draft_quant_config,
    maybe_prefix,
)
from vllm.transformers_utils.config import set_default_rope_theta
from vllm.v1.attention.backend import AttentionType

from vllm_dspark_pp.producer import drafter

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

logger = init_logger("vllm.dspark_pp.producer.qwen3")

# --------------------------------------------------------------------------- weights
# Names as they appear in a Qwen3 DSpark checkpoint (no "model." prefix).
_KEEP = re.compile(
    r"^(?:model\.)?(?:"
    r"fc\.|hidden_norm\.|"
    r"(?:layers|midlayer)(?:\.\d+)?\.self_attn\.(?:k_proj|v_proj|qkv_proj|k_norm|attn|"
    r"attention_sink_bias)\b"
    r")"
)


#: Whether a Qwen3 DSpark checkpoint tensor is needed by the context-only drafter; the rest.
is_context_kv_weight, skipped_weight_names = drafter.weight_filter(_KEEP)


# --------------------------------------------------------------------------- Qwen3 model
def _uses_aux_hidden_state(config: Any) -> bool:
    """Whether the draft reads target aux taps; ``dflash_config`` wins over ``eagle_config``,
    then the top-level field, default True (the same precedence as vLLM 0.34.0's drafter)."""
    for section in ("dflash_config", "eagle_config"):
        values = getattr(config, section, None) or {}
        if "use_aux_hidden_state" in values:
            return bool(values["use_aux_hidden_state"])
    return bool(getattr(config, "use_aux_hidden_state", True))


#: vLLM 0.34.0's Qwen3 DSpark (DFlash) drafter, whose context-KV code the classes borrow.
QWEN3_DRAFTER_MODULE = qwen3_dflash.__name__
_qd: Any = qwen3_dflash
_BASE_MODEL: Any = _qd.DFlashQwen3Model
_BASE_TOP: Any = _qd.DFlashQwen3ForCausalLM


class _EpsOnly(nn.Module):
    """Stands in for q_norm: vLLM's context path reads only its epsilon."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.variance_epsilon = eps

    forward = drafter.refusing("q_norm")


# --------------------------------------------------------------------------- the classes
class Qwen3DSparkContextKVAttention(nn.Module):
    """The K/V half of DFlashQwen3Attention: same attribute names, no query side."""

    def __init__(
        self, config: Any, layer_idx: int, cache_config: Any, quant_config: Any, prefix: str
    ) -> None:
        super().__init__()
        set_default_rope_theta(config, default_theta=1000000)
        dflash_config = getattr(config, "dflash_config", None) or {}
        sliding_window, causal = _qd._resolve_layer_attention(config, layer_idx)
        tp_size = get_tensor_model_parallel_world_size()
        hidden_size = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv = config.num_key_value_heads
        self.layer_name = prefix
        self.hidden_size = hidden_size
        self.total_num_heads = total_heads
        self.num_heads = total_heads // tp_size  # query heads of the cache layer
        self.total_num_kv_heads = total_kv
        self.num_kv_heads = max(1, total_kv // tp_size)
        self.head_dim = getattr(config, "head_dim", None) or hidden_size // total_heads
        self.q_size = 0  # the projection below holds K/V rows only
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.v_scale = dflash_config.get("attention_value_scale")
        self.sliding_window = sliding_window
        self.causal = causal
        self.qkv_proj = QKVParallelLinear(
            hidden_size,
            self.head_dim,
            0,
            total_kv,
            bias=getattr(config, "attention_bias", False),
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=config.max_position_embeddings,
            is_neox_style=getattr(config, "is_neox_style", True),
            rope_parameters=config.rope_parameters,
        )
        add_sink = dflash_config.get(
            "attention_sink_bias", getattr(config, "add_swa_attention_sink_bias", False)
        )
        self.attention_sink_bias = make_attention_sink(self.num_heads) if add_sink else None
        # The KV cache layer: its name (``<prefix>.attn``), heads, head size, window and
        # sinks must give exactly the full drafter's KVCacheSpec, because the decoder pulls
        # the context KV by layer name (tests/unit/producer checks the specs are equal).
        cache_layer = {
            "prefix": f"{prefix}.attn",
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_dim,
            "scale": self.scaling,
            "per_layer_sliding_window": sliding_window,
            "sinks": self.attention_sink_bias,
            "attn_type": AttentionType.DECODER,
            "cache_config": cache_config,
            "quant_config": quant_config,
        }
        self.attn = Attention(**cache_layer)
        self.q_norm = _EpsOnly(config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    forward = drafter.refusing("draft attention forward")


class Qwen3DSparkContextKVLayer(drafter.AttentionOnlyLayer):
    """A Qwen3 DSpark draft layer holding only its K/V attention."""

    attn_cls = Qwen3DSparkContextKVAttention


class Qwen3DSparkContextKVModel(drafter.ContextPath, nn.Module):
    """fc + hidden_norm + per-layer K/V; context KV via vLLM's own precompute."""

    hf_to_vllm_mapper = _BASE_MODEL.hf_to_vllm_mapper

    # vLLM 0.34.0's context-KV code, used as is (qwen3_dflash.py, DFlashQwen3Model).
    _build_context_kv_buffers = _BASE_MODEL._build_context_kv_buffers
    _build_fused_kv_buffers = _BASE_MODEL._build_fused_kv_buffers
    _normalize_context_states = _BASE_MODEL._normalize_context_states
    _project_context_kv_token_major = _BASE_MODEL._project_context_kv_token_major
    _project_context_kv = _BASE_MODEL._project_context_kv
    _apply_context_rope = _BASE_MODEL._apply_context_rope
    _normalize_context_k = _BASE_MODEL._normalize_context_k
    precompute_and_store_context_kv = _BASE_MODEL.precompute_and_store_context_kv

    def __init__(
        self, *, vllm_config: VllmConfig, start_layer_id: int = 0, prefix: str = ""
    ) -> None:
        super().__init__()
        spec = vllm_config.speculative_config
        assert spec is not None
        self.config = spec.draft_model_config.hf_config
        self.quant_config = get_draft_quant_config(vllm_config)
        self._fused_kv_weight = None
        self._fused_kv_bias = None
        self._context_kv_proj = None  # no MXFP8 fused context projection
        self.use_aux_hidden_state = _uses_aux_hidden_state(self.config)
        current = get_current_vllm_config()
        self.layers = nn.ModuleList(
            Qwen3DSparkContextKVLayer(
                config=self.config,
                layer_idx=i,
                cache_config=current.cache_config,
                quant_config=self.quant_config,
                prefix=maybe_prefix(prefix, f"layers.{i + start_layer_id}.self_attn"),
            )
            for i in range(self.config.num_hidden_layers)
        )
        if self.use_aux_hidden_state:
            # the context projection: concatenated aux taps -> draft hidden size, same
            # parameter name and dtype as the full drafter's, so the checkpoint row loads
            in_features = _qd._get_dflash_fc_input_size(vllm_config)
            fc_options: dict[str, Any] = {
                "prefix": maybe_prefix(prefix, "fc"),
                "quant_config": self.quant_config,
                "params_dtype": vllm_config.model_config.dtype,
                "bias": False,
                "return_bias": False,
            }
            self.fc = ReplicatedLinear(in_features, self.config.hidden_size, **fc_options)
        self.hidden_norm = RMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)

    def keep_one_kv_copy(self) -> None:
        """Hold the K/V projection and the K norms once, not twice.

        vLLM's ``_build_fused_kv_buffers`` (run after loading) concatenates every layer's
        K/V rows into ``_fused_kv_weight`` (and bias) and stacks the K norms into
        ``_k_norm_weights``: copies, next to the per-layer weights they came from. Here the
        projection holds K/V rows only (``q_size == 0``), so each layer's weight is a
        contiguous row block of the fused buffer: the per-layer parameters become views of
        it and their own storage is freed. The context path reads the fused buffer as
        before (same tensor, same GEMM, same bytes written); a weight reload writes
        through the views into the fused buffer, and the rebuild refills it in place.
        Without a fused buffer (quantized weights, vLLM's CPU platform: the projections
        run through their quant method) only the K norms were copied.
        """
        attns: list[Any] = [layer.self_attn for layer in self.layers]
        derived: Any = self.__dict__  # vLLM's derived tensors are plain attributes
        drafter.hold_as_views(derived["_k_norm_weights"], (a.k_norm.weight for a in attns))
        if derived["_fused_kv_weight"] is None:
            return
        drafter.hold_as_views(derived["_fused_kv_weight"], (a.qkv_proj.weight for a in attns))
        if derived["_fused_kv_bias"] is not None:
            drafter.hold_as_views(derived["_fused_kv_bias"], (a.qkv_proj.bias for a in attns))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights(self._kv_rows_only(weights), mapper=self.hf_to_vllm_mapper)

    def _kv_rows_only(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A checkpoint that ships qkv_proj fused keeps only its K/V rows here."""
        q_rows = self.config.num_attention_heads * (
            getattr(self.config, "head_dim", None)
            or self.config.hidden_size // self.config.num_attention_heads
        )
        for name, weight in weights:
            if ".qkv_proj." in name and name.endswith(("weight", "bias")):
                weight = weight[q_rows:]
            yield name, weight


class Qwen3DSparkContextKVForCausalLM(drafter.ContextKVDrafter, nn.Module):
    """Top level of the Qwen3 context-KV-only DSpark drafter."""

    family = "Qwen3 DSpark"
    model_cls = Qwen3DSparkContextKVModel
    is_context_kv_weight = staticmethod(is_context_kv_weight)

    get_draft_kv_cache_layer_names = _BASE_TOP.get_draft_kv_cache_layer_names
    get_draft_attn_causal = _BASE_TOP.get_draft_attn_causal
    combine_hidden_states = _BASE_TOP.combine_hidden_states
    precompute_and_store_context_kv = _BASE_TOP.precompute_and_store_context_kv

    def process_weights_after_loading(self) -> None:
        self.model._build_fused_kv_buffers()
        self.model.keep_one_kv_copy()

    def load_context_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
        prefixed = ((n if n.startswith("model.") else "model." + n, t) for n, t in weights)
        return AutoWeightsLoader(self).load_weights(prefixed)
