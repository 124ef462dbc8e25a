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

    def compressed_keys(self, x: torch.Tensor, kv_quant: str | None):
        assert self.compressor is not None
        c = self.rope(self.compressor(x), torch.arange(x.shape[1], device=x.device))
        return V4.fp8_ds_mla_round(c, self.cfg.qk_rope_head_dim) if kv_quant else c

    def forward(self, x: torch.Tensor, kv_quant: str | None = None) -> torch.Tensor:
        """Causal self-attention of a whole sequence x [B, T, H] at positions 0..T-1: the
        sliding window of raw keys, plus on a ratio-1 layer every compressed entry up to t."""
        cfg = self.cfg
        T = x.shape[1]
        pos = torch.arange(T, device=x.device)
        q = self.queries(x, pos)
        k = self.keys(x, pos, kv_quant)
        d = pos.view(-1, 1) - pos.view(1, -1)
        visible = (d >= 0) & (d < cfg.sliding_window)
        if self.ratio > 0:
            if T > cfg.index_topk:
                raise NotImplementedError(
                    "more compressed entries than index_topk: the indexer's top-k selection "
                    "is not modelled"
                )
            k = torch.cat((k, self.compressed_keys(x, kv_quant)), 1)
            visible = torch.cat((visible, d >= 0), 1)
        return self.attend(q, k, visible.unsqueeze(0), pos)


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


def _layer_state(layer: DecoderLayer41, prefix: str) -> dict[str, torch.Tensor]:
    """One V4.1 decoder layer in the checkpoint's names (as V4's, with V4.1's compressor and
    indexer and no hash table)."""
    sd: dict[str, torch.Tensor] = {}
    a = layer.attn
    for name in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"):
        sd[f"attn.{name}.weight"] = getattr(a, name).weight
    sd["attn.q_norm.weight"] = a.q_norm.weight
    sd["attn.kv_norm.weight"] = a.kv_norm.weight
    sd["attn.attn_sink"] = a.attn_sink
    if a.compressor is not None:
        sd["attn.compressor.wkv.weight"] = a.compressor.wkv.weight
        sd["attn.compressor.norm.weight"] = a.compressor.norm.weight
    if a.indexer is not None:
        ix = a.indexer
        sd["attn.indexer.wq_b.weight"] = ix.wq_b.weight
        sd["attn.indexer.weights_proj.weight"] = ix.weights_proj.weight
        if ix.wk is not None and ix.k_norm is not None:
            sd["attn.indexer.wk.weight"] = ix.wk.weight
            sd["attn.indexer.k_norm.weight"] = ix.k_norm.weight
    f = layer.ffn
    assert f.gate_bias is not None
    sd["ffn.gate.weight"] = f.gate.weight
    sd["ffn.gate.bias"] = f.gate_bias
    for e, ex in enumerate(f.experts):
        for w in ("w1", "w2", "w3"):
            sd[f"ffn.experts.{e}.{w}.weight"] = getattr(ex, w).weight
    for w in ("w1", "w2", "w3"):
        sd[f"ffn.shared_experts.{w}.weight"] = getattr(f.shared_experts, w).weight
    sd["attn_norm.weight"] = layer.attn_norm.weight
    sd["ffn_norm.weight"] = layer.ffn_norm.weight
    for kind, mix in (("attn", layer.hc_attn), ("ffn", layer.hc_ffn)):
        sd[f"hc_{kind}_fn"] = mix.fn
        sd[f"hc_{kind}_base"] = mix.base
        sd[f"hc_{kind}_scale"] = mix.scale
    return {prefix + k: v for k, v in sd.items()}


# --------------------------------------------------------------------------------- the target
class TinyDSV41(nn.Module):
    """DeepseekV41ForCausalLM (text). ``forward(ids, aux_layers)`` -> (logits [B,T,V], aux
    list): aux[j] is the stream mean entering layer ``aux_layers[j]`` (V4.1's tap)."""

    def __init__(self, cfg: DSV41Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer41(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor, aux_layers=(), kv_quant: str | None = None):
        x = self.embed(ids)
        streams = x.unsqueeze(-2).expand(*x.shape[:-1], self.cfg.hc_mult, x.shape[-1])
        fns = [lambda h, a=layer.attn: a(h, kv_quant) for layer in self.layers]
        streams, pre, aux = run_layers(self.layers, streams, ids, fns, tuple(aux_layers))
        h = self.norm(HyperMix.collapse(streams, pre))
        return self.head(h), [aux[i] for i in aux_layers]

    def vllm_state_dict(self) -> dict[str, torch.Tensor]:
        """The target's tensors in the checkpoint names (no ``mtp.``, no ``hc_head``)."""
        sd = {"embed.weight": self.embed.weight, "head.weight": self.head.weight}
        sd["norm.weight"] = self.norm.weight
        for i, layer in enumerate(self.layers):
            sd.update(_layer_state(layer, f"layers.{i}."))
        return V4._export(sd)


# ---------------------------------------------------------------------------------- the draft
class TinyDSV41Draft(V4.TinyDSV4Draft):
    """vLLM's ``DSparkDeepseekV4ForCausalLM`` of V4.1 (``DSparkV41DraftModel``): V4's draft with
    V4.1 stages (ratio 0: sliding window over the context, ``rope_theta``), the delayed pre-mix,
    and the last stage's FFN pre collapsing the streams instead of a learned ``hc_head``."""

    def __init__(self, cfg: DSV41Config):
        nn.Module.__init__(self)
        self.cfg = cfg
        h = cfg.hidden_size
        self.main_proj = nn.Linear(h * len(cfg.dspark_target_layer_ids), h, bias=False)
        self.main_norm = RMSNorm(h, cfg.rms_norm_eps)
        n = cfg.num_hidden_layers
        self.layers = nn.ModuleList(DecoderLayer41(cfg, n + i) for i in range(cfg.n_mtp_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.markov_w1 = nn.Embedding(cfg.vocab_size, cfg.dspark_markov_rank)
        self.markov_w2 = nn.Linear(cfg.dspark_markov_rank, cfg.vocab_size, bias=False)
        self.confidence = (
            nn.Linear(h + cfg.dspark_markov_rank, 1, bias=False)
            if cfg.enable_confidence_head
            else None
        )

    def stage_attention(self, ctx, anchors, n: int, kv_quant=None):
        """(one attention function per stage: normed block input [B, M*N, H] -> output, block
        positions [B, M*N]): every query of block m (positions a_m .. a_m+N-1) sees the
        ``sliding_window`` context positions before a_m, keyed by the stage's own ``wkv`` +
        ``kv_norm`` + RoPE of ``ctx`` [B, T, H], and its whole block (non-causal)."""
        cfg = self.cfg
        B, T = ctx.shape[:2]
        M, dev = anchors.shape[1], ctx.device
        qpos = (anchors.unsqueeze(-1) + torch.arange(n, device=dev)).flatten(1)
        cpos = torch.arange(T, device=dev)
        a = anchors.repeat_interleave(n, dim=1).view(B, M * n, 1)
        c = cpos.view(1, 1, T)
        ctx_ok = (c < a) & (c >= a - cfg.sliding_window)
        bid = torch.arange(M, device=dev).repeat_interleave(n)
        blk_ok = (bid.view(-1, 1) == bid.view(1, -1)).expand(B, -1, -1)
        visible = torch.cat((ctx_ok, blk_ok), -1)
        fns = []
        for layer in self.layers:
            attn = layer.attn
            ck = attn.keys(ctx, cpos, kv_quant)

            def attn_fn(hn, attn=attn, ck=ck):
                q = attn.queries(hn, qpos)
                bk = attn.keys(hn, qpos, kv_quant)
                return attn.attend(q, torch.cat((ck, bk), 1), visible, qpos)

            fns.append(attn_fn)
        return fns, qpos

    def forward(self, target, ids, ctx, anchors, kv_quant=None, block_size=None):
        """As ``TinyDSV4Draft.forward``: ids [B,T], ctx [B,T,H], anchors [B,M] -> (logits
        [B,M,N,V] with the teacher-forced Markov bias, confidence logits or None, the pre-norm
        hidden [B,M,N,H]); the block is ``[anchor, noise x (N-1)]``."""
        cfg = self.cfg
        B, T = ids.shape
        M, N = anchors.shape[1], block_size or cfg.dspark_block_size
        blk = torch.full((B, M, N), cfg.dspark_noise_token_id, dtype=ids.dtype, device=ids.device)
        blk[:, :, 0] = ids.gather(1, anchors)
        blk = blk.flatten(1)
        x = target.embed(blk)
        streams = x.unsqueeze(-2).expand(*x.shape[:-1], cfg.hc_mult, x.shape[-1])
        fns, qpos = self.stage_attention(ctx, anchors, N, kv_quant)
        streams, pre, _ = run_layers(self.layers, streams, blk, fns)
        hidden = HyperMix.collapse(streams, pre).view(B, M, N, -1)
        prev = ids.gather(1, qpos.clamp(max=T - 1)).view(B, M, N)
        bias, conf = self.heads(hidden, prev)
        return target.head(self.norm(hidden)) + bias, conf, hidden

    def vllm_state_dict(self) -> dict[str, torch.Tensor]:
        """``mtp.<stage>.*``: the context combiner on stage 0, the heads on the last stage."""
        last = f"mtp.{self.cfg.n_mtp_layers - 1}."
        sd = {"mtp.0.main_proj.weight": self.main_proj.weight}
        sd["mtp.0.main_norm.weight"] = self.main_norm.weight
        for i, layer in enumerate(self.layers):
            sd.update(_layer_state(layer, f"mtp.{i}."))
        sd[last + "norm.weight"] = self.norm.weight
        sd[last + "markov_head.markov_w1.weight"] = self.markov_w1.weight
        sd[last + "markov_head.markov_w2.weight"] = self.markov_w2.weight
        if self.confidence is not None:
            sd[last + "confidence_head.proj.weight"] = self.confidence.weight
        return V4._export(sd)


def init_pair(target: TinyDSV41, draft: TinyDSV41Draft, seed: int = 0) -> None:
    """``dsv4_models.init_pair``'s seeded ranges (by parameter name; no hash tables here)."""
    V4.init_pair(target, draft, seed)  # type: ignore[arg-type]


def vllm_checkpoint(target: TinyDSV41, draft: TinyDSV41Draft | None) -> dict[str, torch.Tensor]:
    sd = target.vllm_state_dict()
    if draft is not None:
        sd.update(draft.vllm_state_dict())
    return sd


__all__ = [
    "DSV41Config",
    "TinyDSV41",
    "TinyDSV41Draft",
    "init_pair",
    "vllm_checkpoint",
]
