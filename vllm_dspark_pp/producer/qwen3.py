"""Qwen3 DSpark: the context-KV-only drafter and the analytic parameter bytes.

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
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from vllm_dspark_pp.producer import drafter, families

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
QWEN3_DRAFTER_MODULE = "vllm.model_executor.models.qwen3_dflash"


@drafter.built_once
def qwen3_context_kv_class(module_name: str | None = None) -> type:
    """The Qwen3 context-only top-level class, defined against vLLM's Qwen3 DSpark drafter module
    (default :data:`QWEN3_DRAFTER_MODULE`; deferred: needs torch and vLLM layers)."""
    import importlib

    from torch import nn
    from vllm.config import get_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import QKVParallelLinear, ReplicatedLinear
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.model_loader.weight_utils import make_attention_sink
    from vllm.model_executor.models.utils import (
        AutoWeightsLoader,
        get_draft_quant_config,
        maybe_prefix,
    )
    from vllm.transformers_utils.config import set_default_rope_theta
    from vllm.v1.attention.backend import AttentionType

    qd: Any = importlib.import_module(module_name or QWEN3_DRAFTER_MODULE)

    class _EpsOnly(nn.Module):
        """Stands in for q_norm: vLLM's context path reads only its epsilon."""

        def __init__(self, eps: float) -> None:
            super().__init__()
            self.variance_epsilon = eps

        forward = drafter.refusing("q_norm")

    class Qwen3DSparkContextKVAttention(nn.Module):
        """The K/V half of DFlashQwen3Attention: same attribute names, no query side."""

        def __init__(
            self, config: Any, layer_idx: int, cache_config: Any, quant_config: Any, prefix: str
        ) -> None:
            super().__init__()
            set_default_rope_theta(config, default_theta=1000000)
            dflash_config = getattr(config, "dflash_config", None) or {}
            sliding_window, causal = qd._resolve_layer_attention(config, layer_idx)
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

    Qwen3DSparkContextKVLayer = drafter.layer_holding(
        Qwen3DSparkContextKVAttention, "Qwen3DSparkContextKVLayer"
    )

    base = qd.DFlashQwen3Model

    # vLLM 0.34.0's context-KV code, used as is (qwen3_dflash.py, DFlashQwen3Model).
    context_path: Any = drafter.context_path(
        base,
        "_build_context_kv_buffers",
        "_build_fused_kv_buffers",
        "_normalize_context_states",
        "_project_context_kv_token_major",
        "_project_context_kv",
        "_apply_context_rope",
        "_normalize_context_k",
        "precompute_and_store_context_kv",
    )

    class Qwen3DSparkContextKVModel(context_path, nn.Module):
        """fc + hidden_norm + per-layer K/V; context KV via vLLM's own precompute."""

        hf_to_vllm_mapper = base.hf_to_vllm_mapper

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
                in_features = qd._get_dflash_fc_input_size(vllm_config)
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

        get_draft_kv_cache_layer_names = qd.DFlashQwen3ForCausalLM.get_draft_kv_cache_layer_names
        get_draft_attn_causal = qd.DFlashQwen3ForCausalLM.get_draft_attn_causal
        combine_hidden_states = qd.DFlashQwen3ForCausalLM.combine_hidden_states
        precompute_and_store_context_kv = qd.DFlashQwen3ForCausalLM.precompute_and_store_context_kv

        def process_weights_after_loading(self) -> None:
            self.model._build_fused_kv_buffers()
            self.model.keep_one_kv_copy()

        def load_context_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
            prefixed = ((n if n.startswith("model.") else "model." + n, t) for n, t in weights)
            return AutoWeightsLoader(self).load_weights(prefixed)

    return Qwen3DSparkContextKVForCausalLM


# --------------------------------------------------------------------------- sizes
def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def draft_param_bytes(
    draft_hf_config: Any, role: str = "kv_producer", dtype_bytes: int = 2
) -> dict[str, Any]:
    """Parameter bytes of a Qwen3 DSpark draft, full vs context-only (pure, analytic).

    ``draft_hf_config``: the draft's HF config (object or dict) with hidden_size,
    intermediate_size, num_attention_heads, num_key_value_heads, head_dim, vocab_size,
    num_hidden_layers and optionally draft_vocab_size, markov_rank, target_hidden_size,
    dspark_target_layer_ids/target_layer_ids, attention_bias, enable_confidence_head,
    confidence_head_with_markov, has_own_embed_tokens/has_own_lm_head.
    ``role``: kv_role of the instance (None/"kv_both"/"kv_consumer" keep the full drafter).

    Returns components (name -> bytes) of the full drafter, the context-only total, the full
    total, which one this role builds (``built``), and the embedding/LM-head bytes that vLLM
    shares with the target when the draft ships none (``shared_with_target``).
    """
    h = int(_get(draft_hf_config, "hidden_size"))
    inter = int(_get(draft_hf_config, "intermediate_size"))
    nq = int(_get(draft_hf_config, "num_attention_heads"))
    nkv = int(_get(draft_hf_config, "num_key_value_heads", nq))
    hd = int(_get(draft_hf_config, "head_dim", None) or h // nq)
    vocab = int(_get(draft_hf_config, "vocab_size"))
    dvocab = int(_get(draft_hf_config, "draft_vocab_size", None) or vocab)
    layers = int(_get(draft_hf_config, "num_hidden_layers"))
    rank = int(_get(draft_hf_config, "markov_rank", 0) or 0)
    th = int(_get(draft_hf_config, "target_hidden_size", None) or h)
    tl = (
        _get(draft_hf_config, "dspark_target_layer_ids", None)
        or _get(draft_hf_config, "target_layer_ids", None)
        or (_get(draft_hf_config, "dflash_config", None) or {}).get("target_layer_ids")
    )
    n_feat = len(tl) if tl else layers
    bias = bool(_get(draft_hf_config, "attention_bias", False))
    own_embed = bool(_get(draft_hf_config, "has_own_embed_tokens", False))
    own_head = bool(_get(draft_hf_config, "has_own_lm_head", False))
    b = dtype_bytes

    q_rows, kv_rows = nq * hd, 2 * nkv * hd
    per_layer = {
        "q_proj": (h * q_rows + (q_rows if bias else 0)) * b,
        "kv_proj": (h * kv_rows + (kv_rows if bias else 0)) * b,
        "o_proj": (q_rows * h + (h if bias else 0)) * b,
        "q_norm": hd * b,
        "k_norm": hd * b,
        "layer_norms": 2 * h * b,
        "mlp": 3 * h * inter * b,
    }
    comp = {
        "embed_tokens": vocab * h * b,
        "lm_head": dvocab * h * b,
        "fc": n_feat * th * h * b,
        "hidden_norm": h * b,
        "norm": h * b,
        "mask_embedding": h * b,  # allocated by vLLM, loaded only if the checkpoint ships one
        "markov_head": (vocab * rank + dvocab * rank) * b,
        "d2t": dvocab * 8 if dvocab < vocab else 0,
    }
    if _get(draft_hf_config, "enable_confidence_head", False):
        dim = h + (rank if _get(draft_hf_config, "confidence_head_with_markov", False) else 0)
        comp["confidence_head"] = (dim + 1) * 4  # float32 + bias
    for k, v in per_layer.items():
        comp[f"layers.{k}"] = v * layers
    context_keys = ("fc", "hidden_norm", "layers.kv_proj", "layers.k_norm")
    context_only = sum(comp[k] for k in context_keys)
    full = sum(comp.values())
    shared = (0 if own_embed else comp["embed_tokens"]) + (0 if own_head else comp["lm_head"])
    prefill_only = role == "kv_producer"
    return {
        "components": comp,
        "context_only_components": list(context_keys),
        "full_bytes": full,
        "full_bytes_excluding_shared": full - shared,
        "shared_with_target": shared,
        "context_only_bytes": context_only,
        "role": role,
        "builds": "context_only" if prefill_only else "full",
        "built_bytes": context_only if prefill_only else full - shared,
    }


def draft_load_bytes(hf: Any, dtype_bytes: int, own_embed: bool, own_head: bool) -> dict:
    """GPU bytes a Qwen3 DSpark drafter holds after vLLM loads it, per role (pure).

    Parameters the drafter owns (vLLM aliases the target's embedding and LM head when the
    checkpoint ships none) plus, in the full drafter only, what
    ``DFlashQwen3Model._build_fused_kv_buffers`` derives after loading: a concatenated copy of
    every layer's K/V projection rows and the stacked K norms (``fused_kv_copy``). The
    context-KV-only drafter derives the same buffers but keeps its per-layer K/V weights and K
    norms as views of them (``keep_one_kv_copy``), so it holds no copy. Measured against the
    allocator on the H200 by benchmarks/perf_real_shapes.py (docs/results/performance.md);
    ``held_bytes`` of the build's log line is the same count of the built module.
    """
    sizes = draft_param_bytes(hf, role="kv_both", dtype_bytes=dtype_bytes)
    comp = sizes["components"]
    derived = comp["layers.kv_proj"] + comp["layers.k_norm"]
    full = sizes["full_bytes"]
    if not own_embed:
        full -= comp["embed_tokens"]
    if not own_head:
        full -= comp["lm_head"]
    return {
        "full": full + derived,
        "context_only": sizes["context_only_bytes"],
        "fused_kv_copy": derived,
        "shared_with_target": sizes["full_bytes"] - full,
    }


#: The one family with a memory rule for ``plan`` (measured, docs/results/performance.md).
families.register(
    families.DraftFamily(
        "Qwen3 DSpark",
        ("Qwen3DSparkModel",),
        __name__,
        qwen3_context_kv_class,
        draft_memory=draft_load_bytes,
    )
)
