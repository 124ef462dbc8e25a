"""Pure-torch tiny DeepSeek-V4.1 target and its DSpark draft (``DSparkV41DraftModel``: the
``mtp.<i>.*`` stages of the same checkpoint), built from the DeepSeek-V4 reference
(``dsv4_models``) where the two architectures agree. Written from reading vLLM 0.34.0's
``models/deepseek_v41/`` (docs/dsv41-pure-torch.md maps each difference to its file); no vLLM
import, so it trains with autograd on any device.

What V4.1 changes (everything else is ``dsv4_models``: RMSNorm, RoPE, the mHC weights and the
stream update, MQA with a sink, inverse RoPE, the grouped output projection, the clamped SwiGLU
MoE with sqrt-softplus scores, the draft's context path and heads):

* **Delayed pre-mix** (``nvidia/model.py`` ``DeepseekV4DecoderLayer.forward``, reference
  ``model_executor/kernels/mhc/torch.py`` ``mhc_pre_delayed_torch``): a sublayer still computes
  its own pre / post / comb weights from the streams it receives, but collapses its input with
  the *previous* sublayer's pre weights: attention with the pre carried in from the previous
  layer's FFN (copy 0 of the streams for the first layer, i.e. the embedding), the FFN with this
  layer's attention pre. The last FFN's pre collapses the final streams (no learned ``hc_head``),
  in the target before ``norm`` and in the draft before the heads.
* **Taps**: ``dspark_target_layer_ids`` entry ``L`` is the stream mean *entering* layer ``L``
  (``L`` = the layer count: the final streams), not the stream after layer ``L``.
* **Attention topology** (``attention.py``): ``compress_ratios`` has one entry per layer, MTP
  stages included (past its end: 0); 0 = sliding window only (``rope_theta``), 1 = a full-length
  compressed cache, 2 = ratio-2 pooling, both with ``compress_rope_theta``. Compressors live only
  on ``kv_source_layer_ids``, indexers only on ``index_source_layer_ids``; other compressed layers
  read the latest source's cache. Modelled here: ratio 0, and ratio 1 on a layer that is its own
  kv and index source. The ratio-1 compressor (``compressor.py``) has no gate and no ``ape``:
  entry t is ``norm(wkv x_t)`` with RoPE at position t, visible from position t on. Ratio 2 and
  kv-sharing consumers raise ``NotImplementedError``.
* **Indexer**: ``wq_b``, ``weights_proj``, and on a kv source ``wk`` (head_dim -> index_head_dim,
  reading the compressor's latent) and ``k_norm``. While a sequence has at most ``index_topk``
  compressed entries vLLM selects all of them (``DeepseekV4Indexer.forward``), so its weights
  cannot change the output; longer sequences raise ``NotImplementedError``.
* **MoE**: no hash-routed layers (``num_hash_layers=0``); every layer routes by score + bias.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from dspark_dev.training import dsv4_models as V4
from dspark_dev.training.dsv4_models import HyperMix, RMSNorm


@dataclass
class DSV41Config(V4.DSV4Config):
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    o_groups: int = 1
    q_lora_rank: int = 32
    compress_ratios: list[int] = field(default_factory=lambda: [0, 1, 0, 0])
    kv_source_layer_ids: list[int] = field(default_factory=lambda: [1])
    index_source_layer_ids: list[int] = field(default_factory=lambda: [1])
    mlp_layer_types: list[str] = field(default_factory=lambda: ["moe", "moe"])
    dspark_target_layer_ids: list[int] = field(default_factory=lambda: [1, 2])

    def compress_ratio(self, layer: int) -> int:
        """vLLM's ``DeepseekV4Attention.compress_ratio`` for V4.1: the list entry, 0 past it."""
        return int(self.compress_ratios[layer]) if layer < len(self.compress_ratios) else 0

    @property
    def num_hash_layers(self) -> int:
        return 0


# --------------------------------------------------------------------------------- attention
class Compressor41(nn.Module):
    """The ratio-1 compressor of a kv-source layer: one latent per token, ``norm(wkv x)``."""

    def __init__(self, hidden: int, head_dim: int, eps: float):
        super().__init__()
        self.wkv = nn.Linear(hidden, head_dim, bias=False)
        self.norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.wkv(x))


class Indexer41(nn.Module):
    """The indexer's weights (``attn.indexer.*``); only its short-context rule is modelled."""

    def __init__(self, cfg: DSV41Config, owns_k: bool):
        super().__init__()
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)
        self.wk = nn.Linear(cfg.head_dim, cfg.index_head_dim, bias=False) if owns_k else None
        self.k_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps) if owns_k else None


class Attention41(V4.Attention):
    def __init__(self, cfg: DSV41Config, layer: int):
        super().__init__(cfg, layer)  # ratio 0 / 1: no V4 compressor or indexer is built
        ratio = cfg.compress_ratio(layer)
        backbone = layer < cfg.num_hidden_layers
        self.ratio = ratio
        self.theta = cfg.compress_rope_theta if ratio > 0 else cfg.rope_theta
        self.is_kv_source = backbone and layer in cfg.kv_source_layer_ids
        self.is_index_source = backbone and layer in cfg.index_source_layer_ids
        if ratio > 1:
            raise NotImplementedError(f"layer {layer}: compress ratio {ratio} is not modelled")
        if ratio > 0 and not self.is_kv_source:
            raise NotImplementedError(
                f"layer {layer}: a compressed layer reading another layer's cache (kv sharing) "
                "is not modelled"
            )
        self.compressor = (
            Compressor41(cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps)
            if ratio > 0 and self.is_kv_source
            else None
        )
        self.indexer = Indexer41(cfg, self.is_kv_source) if self.is_index_source else None
        # a compressed layer without its own indexer reads its index source's selection
        self.indexed = ratio > 0

    def compression_state(self) -> dict[str, torch.Tensor]:
        """V4.1's compressor (``wkv``, ``norm``) and indexer (``wq_b``, ``weights_proj``, on a kv
        source ``wk`` and ``k_norm``) in the checkpoint's names (below ``attn.``)."""
        sd: dict[str, torch.Tensor] = {}
        if self.compressor is not None:
            sd["compressor.wkv.weight"] = self.compressor.wkv.weight
            sd["compressor.norm.weight"] = self.compressor.norm.weight
        if self.indexer is not None:
            ix = self.indexer
            sd["indexer.wq_b.weight"] = ix.wq_b.weight
            sd["indexer.weights_proj.weight"] = ix.weights_proj.weight
            if ix.wk is not None and ix.k_norm is not None:
                sd["indexer.wk.weight"] = ix.wk.weight
                sd["indexer.k_norm.weight"] = ix.k_norm.weight
        return sd


# ----------------------------------------------------------------------------------- layers
class DecoderLayer41(V4.DecoderLayer):
    def __init__(self, cfg: DSV41Config, layer: int):
        super().__init__(cfg, layer)
        self.attn = Attention41(cfg, layer)

    def forward(self, streams, pre_in, ids, attn_fn):  # type: ignore[override]
        """(streams [..., hc, H], pre_in [..., hc] or None) -> (streams, this layer's FFN pre):
        each sublayer's input is collapsed with the previous sublayer's pre weights."""
        cfg = self.cfg
        pre_a, post_a, comb_a = self.hc_attn.weights(streams, cfg)
        x = streams[..., 0, :] if pre_in is None else HyperMix.collapse(streams, pre_in)
        streams = HyperMix.expand(attn_fn(self.attn_norm(x)), streams, post_a, comb_a)
        pre_f, post_f, comb_f = self.hc_ffn.weights(streams, cfg)
        x = HyperMix.collapse(streams, pre_a)
        streams = HyperMix.expand(self.ffn(self.ffn_norm(x), ids), streams, post_f, comb_f)
        return streams, pre_f


def run_layers(layers, streams, ids, attn_fns, taps=(), first: int = 0):
    """Run ``layers`` (ids ``first``..) -> (streams, last pre, {tap L: mean stream entering L})."""
    pre = None
    aux: dict[int, torch.Tensor] = {}
    for i, (layer, fn) in enumerate(zip(layers, attn_fns, strict=True)):
        if first + i in taps:
            aux[first + i] = streams.float().mean(-2).to(streams.dtype)
        streams, pre = layer(streams, pre, ids, fn)
    end = first + len(layers)
    if end in taps:
        aux[end] = streams.float().mean(-2).to(streams.dtype)
    return streams, pre, aux


# --------------------------------------------------------------------------------- the target
class TinyDSV41(V4.TinyDSV4):
    """DeepseekV41ForCausalLM (text). ``forward(ids, aux_layers)`` -> (logits [B,T,V], aux
    list): aux[j] is the stream mean entering layer ``aux_layers[j]`` (V4.1's tap). Its
    ``vllm_state_dict`` has no ``mtp.`` and no ``hc_head``."""

    layer_cls = DecoderLayer41
    learned_hc_head = False

    def forward(self, ids: torch.Tensor, aux_layers=(), kv_quant: str | None = None):
        streams = V4.hc_streams(self.embed(ids), self.cfg.hc_mult)
        fns = [lambda h, a=layer.attn: a(h, kv_quant) for layer in self.layers]
        streams, pre, aux = run_layers(self.layers, streams, ids, fns, tuple(aux_layers))
        h = self.norm(HyperMix.collapse(streams, pre))
        return self.head(h), [aux[i] for i in aux_layers]


# ---------------------------------------------------------------------------------- the draft
class TinyDSV41Draft(V4.TinyDSV4Draft):
    """vLLM's ``DSparkDeepseekV4ForCausalLM`` of V4.1 (``DSparkV41DraftModel``): V4's draft with
    V4.1 stages (ratio 0: sliding window over the context, ``rope_theta``), the delayed pre-mix,
    and the last stage's FFN pre collapsing the streams instead of a learned ``hc_head``."""

    layer_cls = DecoderLayer41
    learned_hc_head = False

    def run_stages(self, streams: torch.Tensor, blk: torch.Tensor, attn_fns) -> torch.Tensor:
        streams, pre, _ = run_layers(self.layers, streams, blk, attn_fns)
        return HyperMix.collapse(streams, pre)


#: ``dsv4_models``' seeded ranges (by parameter name; V4.1 has no hash tables) and checkpoint
init_pair = V4.init_pair
vllm_checkpoint = V4.vllm_checkpoint


__all__ = [
    "DSV41Config",
    "TinyDSV41",
    "TinyDSV41Draft",
    "init_pair",
    "vllm_checkpoint",
]
