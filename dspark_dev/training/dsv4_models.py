"""Pure-torch tiny DeepSeek-V4 target and its DSpark draft (the ``mtp.<i>.*`` stages of the same
checkpoint), written from reading vLLM 0.34.0's DeepSeek-V4 model (docs/dsv4-pure-torch.md maps
each piece to vLLM's file and line and says which parts are checked on CPU and which only on the
GPU). No vLLM import: this module trains with autograd on any device.

What the forward computes (all in the module's dtype, norms / mixing / routing in float32):

* embedding -> ``hc_mult`` copies of the token's vector (the residual streams);
* per decoder layer, twice (attention, then MoE): manifold-constrained hyper-connection mixing
  (``HyperMix``: pre weights collapse the streams into the sublayer input, post weights spread
  the sublayer output back, a Sinkhorn-normalised ``comb`` matrix mixes the old streams);
* attention: one shared key/value head (MQA, K = V), queries from a low-rank path with a
  weighted then a per-head unweighted RMSNorm, interleaved RoPE on the last ``qk_rope_head_dim``
  channels, a sliding window of raw keys plus, on compressed layers, softmax-gated compressed keys
  (ratio 4 with overlapping windows, ratio 128 without), a per-head attention sink, inverse RoPE on
  the output, grouped low-rank output projection;
* MoE: sqrt-softplus scores, hash routing (``tid2eid[token]``) on the first ``hash_moe`` layers
  and biased top-k elsewhere, the chosen unbiased scores renormalised and scaled by
  ``routed_scaling_factor``, clamped SwiGLU experts plus one shared expert;
* ``hc_head`` collapses the streams, final RMSNorm, ``head``.

The Lightning Indexer is carried (its weights are in the checkpoint) but only its short-context
rule is implemented: while a sequence has at most ``index_topk`` compressed entries vLLM selects
all of them (``DeepseekV4Indexer.forward``), so the indexer's scores cannot change the output;
longer sequences raise ``NotImplementedError``.

``kv_quant="fp8_ds_mla"`` rounds every cached key (sliding-window and compressed) the way vLLM's
fp8_ds_mla cache stores it on the H200 (the 448 no-RoPE channels in float8 e4m3 with one
power-of-two scale per 64 channels, the 64 RoPE channels in bf16), so the reference can be run with
or without the cache's rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

FP8_MAX = 448.0
FP8_BLOCK = 64


@dataclass
class DSV4Config:
    vocab_size: int = 512
    hidden_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 64
    o_groups: int = 8
    o_lora_rank: int = 32
    sliding_window: int = 128
    layer_types: list[str] = field(
        default_factory=lambda: ["compressed_sparse_attention", "heavily_compressed_attention"]
    )
    compress_rates: dict[str, int] = field(
        default_factory=lambda: {
            "compressed_sparse_attention": 4,
            "heavily_compressed_attention": 128,
        }
    )
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 4
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    moe_intermediate_size: int = 64
    routed_scaling_factor: float = 1.5
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    mlp_layer_types: list[str] = field(default_factory=lambda: ["hash_moe", "moe"])
    hc_mult: int = 2
    hc_sinkhorn_iters: int = 2
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    # the DSpark draft (mtp stages)
    n_mtp_layers: int = 2
    dspark_target_layer_ids: list[int] = field(default_factory=lambda: [0, 1])
    dspark_markov_rank: int = 8
    enable_confidence_head: bool = True
    dspark_noise_token_id: int = 3
    dspark_block_size: int = 4

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DSV4Config:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def compress_ratio(self, layer: int) -> int:
        """vLLM's ``DeepseekV4Attention.compress_ratio``: 1 for the MTP stages (layer index past
        the target's layers) and for uncompressed layer types."""
        if layer >= self.num_hidden_layers:
            return 1
        return max(1, self.compress_rates.get(self.layer_types[layer], 0))

    @property
    def num_hash_layers(self) -> int:
        return self.mlp_layer_types.count("hash_moe")


# ------------------------------------------------------------------------------ small pieces
def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMS normalisation in float32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms(x, self.eps) * self.weight.float()).to(x.dtype)


def rope_tables(positions: torch.Tensor, rope_dim: int, theta: float):
    """cos/sin [..., rope_dim // 2] for interleaved (GPT-J) pairs."""
    inv = 1.0 / theta ** (
        torch.arange(0, rope_dim, 2, dtype=torch.float32, device=positions.device) / rope_dim
    )
    ang = positions.float().unsqueeze(-1) * inv
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse=False):
    """Rotate the last ``2 * cos.shape[-1]`` channels of ``x`` as interleaved pairs
    (c0, c1), (c2, c3), ...; ``cos``/``sin`` broadcast over the dims between the token axis and the
    channel axis. ``inverse`` rotates by the negative angle."""
    rd = 2 * cos.shape[-1]
    keep, rot = x[..., :-rd], x[..., -rd:].float()
    even, odd = rot[..., 0::2], rot[..., 1::2]
    s = -sin if inverse else sin
    out = torch.stack((even * cos - odd * s, odd * cos + even * s), dim=-1).flatten(-2)
    return torch.cat((keep, out.to(x.dtype)), dim=-1)


def fp8_ds_mla_round(kv: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """What a key row looks like after a round trip through vLLM's fp8_ds_mla cache: the no-RoPE
    channels rounded to bf16, then float8 e4m3 with one power-of-two scale per 64 channels
    (scale = 2^ceil(log2(max(amax, 1e-4) / 448))), the RoPE channels in bf16. Straight-through for
    gradients."""
    nope, rope = kv[..., :-rope_dim], kv[..., -rope_dim:]
    blocks = nope.to(torch.bfloat16).float().unflatten(-1, (-1, FP8_BLOCK))
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (blocks / scale).to(torch.float8_e4m3fn).float() * scale
    rounded = torch.cat((q.flatten(-2), rope.to(torch.bfloat16).float()), dim=-1).to(kv.dtype)
    return kv + (rounded - kv).detach()


# ------------------------------------------------------------------------- hyper-connections
def hc_streams(x: torch.Tensor, hc: int) -> torch.Tensor:
    """x [..., H] -> the ``hc`` residual streams [..., hc, H] (copies of x)."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], hc, x.shape[-1])


class HyperMix(nn.Module):
    """The mixing weights of one sublayer (``hc_attn_*`` or ``hc_ffn_*``)."""

    def __init__(self, hc: int, hidden: int):
        super().__init__()
        mix = (2 + hc) * hc
        self.hc = hc
        self.fn = nn.Parameter(torch.zeros(mix, hc * hidden))
        self.base = nn.Parameter(torch.zeros(mix))
        self.scale = nn.Parameter(torch.ones(3))

    def weights(self, streams: torch.Tensor, cfg: DSV4Config):
        """streams [..., hc, H] -> (pre [..., hc], post [..., hc], comb [..., hc, hc]), float32."""
        hc = self.hc
        flat = streams.flatten(-2)
        mixes = (rms(flat, cfg.rms_norm_eps)) @ self.fn.float().t()
        base = self.base.float()
        scale = self.scale.float()
        pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + cfg.hc_eps
        post = 2.0 * torch.sigmoid(mixes[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
        comb = mixes[..., 2 * hc :].unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc :].view(hc, hc)
        comb = torch.softmax(comb, dim=-1) + cfg.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
        for _ in range(cfg.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + cfg.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
        return pre, post, comb

    @staticmethod
    def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return (pre.unsqueeze(-1) * streams.float()).sum(-2).to(streams.dtype)

    @staticmethod
    def expand(out, streams, post, comb) -> torch.Tensor:
        """new stream j = sum_i comb[i, j] * old stream i + post[j] * out."""
        mixed = torch.einsum("...ij,...ih->...jh", comb, streams.float())
        return (mixed + post.unsqueeze(-1) * out.float().unsqueeze(-2)).to(streams.dtype)


class HyperHead(nn.Module):
    """``hc_head_fn`` / ``hc_head_base`` / ``hc_head_scale``: the streams' final collapse."""

    def __init__(self, hc: int, hidden: int):
        super().__init__()
        self.fn = nn.Parameter(torch.zeros(hc, hc * hidden))
        self.base = nn.Parameter(torch.zeros(hc))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor, cfg: DSV4Config) -> torch.Tensor:
        mixes = rms(streams.flatten(-2), cfg.rms_norm_eps) @ self.fn.float().t()
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + cfg.hc_eps
        return HyperMix.collapse(streams, pre)


# --------------------------------------------------------------------------------- attention
class Compressor(nn.Module):
    """Softmax-gated pooling of ``ratio`` consecutive tokens into one key row. With ``overlap``
    (ratio 4) an entry pools 2 * ratio tokens: the previous window through the first
    ``head_dim`` channels of ``wkv``/``wgate``/``ape`` and its own window through the second."""

    def __init__(self, hidden: int, head_dim: int, ratio: int, eps: float):
        super().__init__()
        self.ratio, self.head_dim = ratio, head_dim
        self.overlap = ratio == 4
        coff = 2 if self.overlap else 1
        self.wkv = nn.Linear(hidden, coff * head_dim, bias=False)
        self.wgate = nn.Linear(hidden, coff * head_dim, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, coff * head_dim))
        self.norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] (positions 0..T-1) -> [B, T // ratio, head_dim] normalised rows, before
        RoPE; entry w pools tokens w*r .. w*r+r-1 (and, with overlap, the window before)."""
        B, T, _ = x.shape
        r, hd = self.ratio, self.head_dim
        n = T // r
        kv = self.wkv(x[:, : n * r]).float().unflatten(1, (n, r))
        score = self.wgate(x[:, : n * r]).float().unflatten(1, (n, r)) + self.ape.float()
        if self.overlap:
            prev_kv = F.pad(kv[:, :-1, :, :hd], (0, 0, 0, 0, 1, 0))
            prev_score = F.pad(score[:, :-1, :, :hd], (0, 0, 0, 0, 1, 0), value=-math.inf)
            kv = torch.cat((prev_kv, kv[..., hd:]), dim=2)
            score = torch.cat((prev_score, score[..., hd:]), dim=2)
        pooled = (kv * torch.softmax(score, dim=2)).sum(2)
        return self.norm(pooled.to(x.dtype))


class Indexer(nn.Module):
    """The Lightning Indexer's weights (``attn.indexer.*``). Only its short-context behaviour is
    modelled: every causally visible compressed entry is selected."""

    def __init__(self, cfg: DSV4Config, ratio: int):
        super().__init__()
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)
        self.compressor = Compressor(cfg.hidden_size, cfg.index_head_dim, ratio, cfg.rms_norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: DSV4Config, layer: int):
        super().__init__()
        self.cfg = cfg
        h, nh, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.ratio = cfg.compress_ratio(layer)
        self.theta = cfg.compress_rope_theta if self.ratio > 1 else cfg.rope_theta
        self.wq_a = nn.Linear(h, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, nh * hd, bias=False)
        self.wkv = nn.Linear(h, hd, bias=False)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.wo_a = nn.Linear(nh * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, h, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(nh))
        self.compressor = (
            Compressor(h, hd, self.ratio, cfg.rms_norm_eps) if self.ratio > 1 else None
        )
        self.indexer = Indexer(cfg, self.ratio) if self.ratio == 4 else None
        # whether the compressed entries pass an indexer's top-k selection (modelled only while
        # it selects them all)
        self.indexed = self.indexer is not None

    def rope(self, x, positions, *, inverse=False):
        # x is [B, S, C] or [B, S, heads, C]; positions [S] or [B, S]
        cos, sin = rope_tables(positions, self.cfg.qk_rope_head_dim, self.theta)
        for _ in range(x.dim() - 3):
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return apply_rope(x, cos, sin, inverse=inverse)

    def queries(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[B, S, heads, head_dim]: low-rank query, q_norm, per-head unweighted RMSNorm, RoPE."""
        cfg = self.cfg
        q = self.wq_b(self.q_norm(self.wq_a(x))).unflatten(-1, (cfg.num_attention_heads, -1))
        q = rms(q, cfg.rms_norm_eps).to(x.dtype)
        return self.rope(q, positions)

    def keys(self, x: torch.Tensor, positions: torch.Tensor, kv_quant: str | None):
        """[B, S, head_dim]: the shared key/value row, kv_norm then RoPE (then the cache's
        rounding)."""
        kv = self.rope(self.kv_norm(self.wkv(x)), positions)
        return fp8_ds_mla_round(kv, self.cfg.qk_rope_head_dim) if kv_quant else kv

    def compressed_keys(self, x: torch.Tensor, kv_quant: str | None):
        assert self.compressor is not None
        c = self.compressor(x)
        pos = torch.arange(c.shape[1], device=x.device) * self.ratio
        c = self.rope(c, pos)
        return fp8_ds_mla_round(c, self.cfg.qk_rope_head_dim) if kv_quant else c

    def attend(self, q, k, visible, positions):
        """q [B,S,nh,hd], k [B,K,hd] (K = V), visible bool [B or 1, S, K] -> [B, S, hidden]."""
        cfg = self.cfg
        logits = torch.einsum("bshd,bkd->bhsk", q.float(), k.float()) * cfg.head_dim**-0.5
        logits = logits.masked_fill(~visible.unsqueeze(1), -math.inf)
        sink = self.attn_sink.float().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
        probs = torch.softmax(torch.cat((logits, sink), -1), -1)[..., :-1]
        o = torch.einsum("bhsk,bkd->bshd", probs, k.float()).to(q.dtype)
        o = self.rope(o, positions, inverse=True)
        g = cfg.o_groups
        grouped = o.flatten(-2).unflatten(-1, (g, -1))  # [B, S, g, nh*hd/g]
        w = self.wo_a.weight.view(g, cfg.o_lora_rank, -1)
        z = torch.einsum("bsgi,gri->bsgr", grouped, w.to(grouped.dtype))
        return self.wo_b(z.flatten(-2))

    def forward(self, x: torch.Tensor, kv_quant: str | None = None) -> torch.Tensor:
        """Causal self-attention of a whole sequence x [B, T, H] at positions 0..T-1."""
        cfg = self.cfg
        T = x.shape[1]
        pos = torch.arange(T, device=x.device)
        q = self.queries(x, pos)
        k = self.keys(x, pos, kv_quant)
        d = pos.view(-1, 1) - pos.view(1, -1)
        visible = (d >= 0) & (d < cfg.sliding_window)
        if self.compressor is not None:
            c = self.compressed_keys(x, kv_quant)
            if self.indexed and c.shape[1] > cfg.index_topk:
                raise NotImplementedError(
                    "more compressed entries than index_topk: the indexer's top-k selection "
                    "is not modelled"
                )
            w = torch.arange(c.shape[1], device=x.device)
            closed = w.view(1, -1) < ((pos + 1) // self.ratio).view(-1, 1)
            k = torch.cat((k, c), 1)
            visible = torch.cat((visible, closed), 1)
        return self.attend(q, k, visible.unsqueeze(0), pos)

    def compression_state(self) -> dict[str, torch.Tensor]:
        """The compressor's and the indexer's tensors in the checkpoint's names (below
        ``attn.``)."""
        sd: dict[str, torch.Tensor] = {}
        comps = [("compressor", self.compressor)]
        if self.indexer is not None:
            sd["indexer.wq_b.weight"] = self.indexer.wq_b.weight
            sd["indexer.weights_proj.weight"] = self.indexer.weights_proj.weight
            comps.append(("indexer.compressor", self.indexer.compressor))
        for p, c in comps:
            if c is not None:
                sd[f"{p}.wkv.weight"] = c.wkv.weight
                sd[f"{p}.wgate.weight"] = c.wgate.weight
                sd[f"{p}.ape"] = c.ape
                sd[f"{p}.norm.weight"] = c.norm.weight
        return sd


# ----------------------------------------------------------------------------------- the MoE
class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.limit = limit

    def forward(self, x):
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class MoE(nn.Module):
    def __init__(self, cfg: DSV4Config, layer: int):
        super().__init__()
        self.cfg = cfg
        h, e = cfg.hidden_size, cfg.n_routed_experts
        self.is_hash = layer < cfg.num_hash_layers
        self.gate = nn.Linear(h, e, bias=False)
        if self.is_hash:
            self.register_buffer(
                "tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long)
            )
            self.gate_bias = None
        else:
            self.gate_bias = nn.Parameter(torch.zeros(e))
        # diagnostics of the biased routing (dsv4_check): ``margin`` is set by every routed call
        # to the biased score of the last chosen expert minus the runner-up's ([...] tokens);
        # ``swap``, a bool mask over the tokens of the next call, replaces the last chosen expert
        # by the runner-up there (what a near-tie resolved the other way in bf16 would choose)
        self.margin: torch.Tensor | None = None
        self.swap: torch.Tensor | None = None
        self.experts = nn.ModuleList(
            Expert(h, cfg.moe_intermediate_size, cfg.swiglu_limit) for _ in range(e)
        )
        self.shared_experts = Expert(
            h, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.swiglu_limit
        )

    def route(self, x: torch.Tensor, ids: torch.Tensor):
        """(weights float32 [..., k], expert ids [..., k])."""
        cfg = self.cfg
        logits = x.float() @ self.gate.weight.float().t()
        scores = torch.sqrt(F.softplus(logits))
        if self.is_hash:
            sel = self.tid2eid[ids]
        else:
            assert self.gate_bias is not None
            k = cfg.num_experts_per_tok
            top = torch.topk(
                (scores + self.gate_bias.float()).detach(), min(k + 1, cfg.n_routed_experts), -1
            )
            sel = top.indices[..., :k]
            if top.values.shape[-1] > k:
                self.margin = top.values[..., k - 1] - top.values[..., k]
                if self.swap is not None:
                    last = torch.where(self.swap, top.indices[..., k], sel[..., k - 1])
                    sel = torch.cat((sel[..., : k - 1], last.unsqueeze(-1)), -1)
        w = scores.gather(-1, sel)
        if cfg.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return w * cfg.routed_scaling_factor, sel

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w, sel = self.route(x, ids)
        out = self.shared_experts(x).float()
        for e, expert in enumerate(self.experts):
            gain = (w * (sel == e)).sum(-1, keepdim=True)
            out = out + gain * expert(x).float()
        return out.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DSV4Config, layer: int):
        super().__init__()
        self.cfg = cfg
        self.attn = Attention(cfg, layer)
        self.ffn = MoE(cfg, layer)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_attn = HyperMix(cfg.hc_mult, cfg.hidden_size)
        self.hc_ffn = HyperMix(cfg.hc_mult, cfg.hidden_size)

    def mixed(self, streams, mix: HyperMix, norm: RMSNorm, fn):
        pre, post, comb = mix.weights(streams, self.cfg)
        out = fn(norm(HyperMix.collapse(streams, pre)))
        return HyperMix.expand(out, streams, post, comb)

    def forward(self, streams, ids, attn_fn):
        streams = self.mixed(streams, self.hc_attn, self.attn_norm, attn_fn)
        return self.mixed(streams, self.hc_ffn, self.ffn_norm, lambda h: self.ffn(h, ids))


def _layer_state(layer: DecoderLayer, prefix: str) -> dict[str, torch.Tensor]:
    """One decoder layer in the checkpoint's names (vLLM's load_weights fuses wq_a + wkv,
    compressor wkv + wgate and w1 + w3, and renames ``ffn.gate.bias``)."""
    sd: dict[str, torch.Tensor] = {}
    a = layer.attn
    for name in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"):
        sd[f"attn.{name}.weight"] = getattr(a, name).weight
    sd["attn.q_norm.weight"] = a.q_norm.weight
    sd["attn.kv_norm.weight"] = a.kv_norm.weight
    sd["attn.attn_sink"] = a.attn_sink
    sd.update({f"attn.{k}": v for k, v in a.compression_state().items()})
    f = layer.ffn
    sd["ffn.gate.weight"] = f.gate.weight
    if f.is_hash:
        sd["ffn.gate.tid2eid"] = f.tid2eid.to(torch.int32)
    else:
        assert f.gate_bias is not None
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


def _hc_head_state(head: HyperHead, prefix: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}hc_head_{p}": getattr(head, p) for p in ("fn", "base", "scale")}


def _export(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        v = v.detach()
        out[k] = (v if not v.is_floating_point() else v.float()).contiguous().clone()
    return out


# --------------------------------------------------------------------------------- the target
class TinyDSV4(nn.Module):
    """DeepseekV4ForCausalLM. ``forward(ids)`` -> (logits [B,T,V], aux list): aux[j] is the
    stream mean after target layer ``aux_layers[j]`` (vLLM's aux hidden state for a DSpark
    ``dspark_target_layer_ids`` entry, captured after that layer)."""

    #: the decoder layer class (V4.1: its delayed pre-mix)
    layer_cls: type[DecoderLayer] = DecoderLayer
    #: whether a learned ``hc_head`` collapses the final streams (V4.1: the last FFN's pre)
    learned_hc_head = True

    def __init__(self, cfg: DSV4Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(cfg, i) for i in range(cfg.num_hidden_layers))
        if self.learned_hc_head:
            self.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor, aux_layers=(), kv_quant: str | None = None):
        x = self.embed(ids)
        streams = hc_streams(x, self.cfg.hc_mult)
        aux = []
        for i, layer in enumerate(self.layers):
            streams = layer(streams, ids, lambda h, a=layer.attn: a(h, kv_quant))
            if i in aux_layers:
                aux.append(streams.float().mean(-2).to(x.dtype))
        h = self.norm(self.hc_head(streams, self.cfg))
        return self.head(h), aux

    def vllm_state_dict(self) -> dict[str, torch.Tensor]:
        """The target's tensors in the DeepSeek-V4 checkpoint names (no ``mtp.``)."""
        sd = {"embed.weight": self.embed.weight, "head.weight": self.head.weight}
        sd["norm.weight"] = self.norm.weight
        if self.learned_hc_head:
            sd.update(_hc_head_state(self.hc_head, ""))
        for i, layer in enumerate(self.layers):
            sd.update(_layer_state(layer, f"layers.{i}."))
        return _export(sd)


# ---------------------------------------------------------------------------------- the draft
@dataclass
class DraftStep:
    """One greedy draft step (``TinyDSV4Draft.draft_greedy``): the drafts [k], the base
    log-softmax [k, V] (before the Markov bias), the confidence probabilities [k] or None, each
    draft's lead in nats over the runner-up after the Markov bias, and per draft stage the routing
    margin of each block position (biased score of the last chosen expert minus the runner-up's;
    small = a near-tie that bf16 may resolve the other way)."""

    drafts: list[int]
    base_lp: torch.Tensor
    conf: torch.Tensor | None
    leads: list[float]
    route_margins: list[list[float]]


class TinyDSV4Draft(nn.Module):
    """The DSpark draft of vLLM's ``DSparkDeepseekV4ForCausalLM`` (``mtp.<i>.*``): context
    ``main_x = main_norm(main_proj(concat(aux)))``; every stage projects it with its own
    ``wkv`` + ``kv_norm`` + RoPE into context keys; the block ``[anchor, noise * (N-1)]`` at
    positions a .. a+N-1 runs through the stages (attention over the ``sliding_window`` context
    positions before a and the whole block, non-causally), then ``hc_head``; block position i
    predicts the token at a+i+1 with ``head(norm(h_i)) + markov_w2(markov_w1(prev_i))``. Embedding
    and head are the target's (vLLM aliases them): pass the target to ``forward``."""

    layer_cls: type[DecoderLayer] = DecoderLayer
    learned_hc_head = True  # as ``TinyDSV4``'s

    def __init__(self, cfg: DSV4Config):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.main_proj = nn.Linear(h * len(cfg.dspark_target_layer_ids), h, bias=False)
        self.main_norm = RMSNorm(h, cfg.rms_norm_eps)
        n = cfg.num_hidden_layers
        self.layers = nn.ModuleList(self.layer_cls(cfg, n + i) for i in range(cfg.n_mtp_layers))
        if self.learned_hc_head:
            self.hc_head = HyperHead(cfg.hc_mult, h)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.markov_w1 = nn.Embedding(cfg.vocab_size, cfg.dspark_markov_rank)
        self.markov_w2 = nn.Linear(cfg.dspark_markov_rank, cfg.vocab_size, bias=False)
        self.confidence = (
            nn.Linear(h + cfg.dspark_markov_rank, 1, bias=False)
            if cfg.enable_confidence_head
            else None
        )

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.cfg.dspark_target_layer_ids)

    def context(self, aux: list[torch.Tensor]) -> torch.Tensor:
        return self.main_norm(self.main_proj(torch.cat(aux, -1)))

    def forward(
        self,
        target: TinyDSV4,
        ids,
        ctx,
        anchors,
        kv_quant: str | None = None,
        block_size: int | None = None,
    ):
        """ids [B,T], ctx [B,T,H] (``context(aux)``), anchors [B,M] -> (logits [B,M,N,V] with the
        teacher-forced Markov bias, confidence logits [B,M,N] or None, pre-norm hidden). N is
        ``block_size`` or the config's ``dspark_block_size`` (vLLM: ``num_speculative_tokens``)."""
        cfg = self.cfg
        B, T = ids.shape
        M, N = anchors.shape[1], block_size or cfg.dspark_block_size
        blk = torch.full((B, M, N), cfg.dspark_noise_token_id, dtype=ids.dtype, device=ids.device)
        blk[:, :, 0] = ids.gather(1, anchors)
        blk = blk.flatten(1)
        streams = hc_streams(target.embed(blk), cfg.hc_mult)
        fns, qpos = self.stage_attention(ctx, anchors, N, kv_quant)
        hidden = self.run_stages(streams, blk, fns).view(B, M, N, -1)
        prev = ids.gather(1, qpos.clamp(max=T - 1)).view(B, M, N)
        bias, conf = self.heads(hidden, prev)
        return target.head(self.norm(hidden)) + bias, conf, hidden

    def stage_attention(self, ctx, anchors, n: int, kv_quant: str | None = None):
        """(one attention function per stage: normed block input [B, M*N, H] -> output, block
        positions [B, M*N]): every query of block m (positions a_m .. a_m+N-1) sees the same
        block-anchored window of context, the ``sliding_window`` positions before a_m, keyed by
        the stage's own ``wkv`` + ``kv_norm`` + RoPE of ``ctx`` [B, T, H], and its whole block
        (vLLM's non-causal DSpark SWA indices)."""
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

    def run_stages(self, streams: torch.Tensor, blk: torch.Tensor, attn_fns) -> torch.Tensor:
        """The stages over the block's streams [B, M*N, hc, H] -> the collapsed pre-norm hidden
        [B, M*N, H] (V4: ``hc_head``)."""
        for layer, attn_fn in zip(self.layers, attn_fns, strict=True):
            streams = layer(streams, blk, attn_fn)
        return self.hc_head(streams, self.cfg)

    @torch.no_grad()
    def draft_greedy(
        self,
        target: TinyDSV4,
        seq: list[int],
        anchor: int,
        k: int,
        kv_quant: str | None = None,
        *,
        prevs: list[int] | None = None,
        swap: tuple[int, int] | None = None,
    ) -> DraftStep:
        """What vLLM's DSpark speculator drafts greedily when the verified tokens are
        ``seq[:anchor]`` and the bonus (anchor) token is ``seq[anchor]``: the stages run once over
        the block, then the Markov bias is applied left to right from the previous token, which is
        the anchor and then our own previous draft, or ``prevs[i]`` for draft i when given (to
        follow another drafter's chain). ``swap`` = (stage, block position): that token's last
        routed expert in that stage is replaced by the runner-up (a routing near-tie resolved the
        other way)."""
        dev = next(self.parameters()).device
        ids = torch.tensor([seq[: anchor + 1]], device=dev)
        _, aux = target(ids, self.aux_layers, kv_quant)
        ctx = self.context(aux)
        ids = torch.cat([ids, ids.new_zeros(1, k)], 1)
        ctx = torch.cat([ctx, ctx.new_zeros(1, k, ctx.shape[-1])], 1)
        anchors = torch.tensor([[anchor]], device=dev)
        moes = [layer.ffn for layer in self.layers]
        if swap is not None:
            mask = torch.zeros(1, k, dtype=torch.bool, device=dev)
            mask[0, swap[1]] = True
            moes[swap[0]].swap = mask
        try:
            _, _, hidden = self(target, ids, ctx, anchors, kv_quant, block_size=k)
        finally:
            for m in moes:
                m.swap = None
        margins = [
            [math.inf] * k if m.margin is None else m.margin.reshape(-1)[-k:].tolist() for m in moes
        ]
        hidden = hidden[0, 0]
        base = target.head(self.norm(hidden)).float()
        prev = torch.tensor([seq[anchor]], device=dev)
        drafts, used, leads = [], [], []
        for i in range(k):
            if prevs is not None:
                prev = torch.tensor([prevs[i]], device=dev)
            used.append(prev)
            bias, _ = self.heads(hidden[i : i + 1], prev)
            biased = torch.log_softmax(base[i : i + 1] + bias.float(), -1)
            top2 = torch.topk(biased[0], 2).values
            leads.append(float(top2[0] - top2[1]))
            prev = biased.argmax(-1)
            drafts.append(int(prev))
        _, conf = self.heads(hidden, torch.cat(used))
        probs = None if conf is None else torch.sigmoid(conf).cpu()
        return DraftStep(drafts, torch.log_softmax(base, -1).cpu(), probs, leads, margins)

    def heads(self, hidden: torch.Tensor, prev: torch.Tensor):
        """(Markov bias [..., V] from the previous token ``prev``, confidence logit [...] or None)
        for the pre-norm head hidden ``hidden``."""
        memb = self.markov_w1(prev)
        conf = None
        if self.confidence is not None:
            conf = self.confidence(torch.cat((hidden, memb), -1).float()).squeeze(-1)
        return self.markov_w2(memb), conf

    def vllm_state_dict(self) -> dict[str, torch.Tensor]:
        """The draft's tensors in the checkpoint names (``mtp.<stage>.*``): the context combiner
        on stage 0, the heads on the last stage."""
        last = f"mtp.{self.cfg.n_mtp_layers - 1}."
        sd = {"mtp.0.main_proj.weight": self.main_proj.weight}
        sd["mtp.0.main_norm.weight"] = self.main_norm.weight
        for i, layer in enumerate(self.layers):
            sd.update(_layer_state(layer, f"mtp.{i}."))
        sd[last + "norm.weight"] = self.norm.weight
        if self.learned_hc_head:
            sd.update(_hc_head_state(self.hc_head, last))
        sd[last + "markov_head.markov_w1.weight"] = self.markov_w1.weight
        sd[last + "markov_head.markov_w2.weight"] = self.markov_w2.weight
        if self.confidence is not None:
            sd[last + "confidence_head.proj.weight"] = self.confidence.weight
        return _export(sd)


def init_pair(target: TinyDSV4, draft: TinyDSV4Draft, seed: int = 0) -> None:
    """Random weights that keep every activation in range (what ``dsv4_check`` exports): linear
    weights N(0, 1/fan_in), norms 1, hyper-connection projections small, hash table random."""
    g = torch.Generator().manual_seed(seed)
    cfg = target.cfg
    with torch.no_grad():
        for model in (target, draft):
            for name, p in sorted(model.named_parameters()):
                leaf = name.rsplit(".", 1)[-1]
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif leaf in ("fn", "base"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
                elif leaf == "scale":
                    p.fill_(1.0)
                elif leaf in ("ape", "gate_bias", "attn_sink"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
                elif name.startswith(("embed", "markov_w1")):
                    p.copy_(torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            for m in model.modules():
                if isinstance(m, MoE) and m.is_hash:
                    m.tid2eid.copy_(
                        torch.stack(
                            [
                                torch.randperm(cfg.n_routed_experts, generator=g)[
                                    : cfg.num_experts_per_tok
                                ]
                                for _ in range(cfg.vocab_size)
                            ]
                        )
                    )


def vllm_checkpoint(target: TinyDSV4, draft: TinyDSV4Draft | None) -> dict[str, torch.Tensor]:
    """The single DeepSeek-V4 checkpoint vLLM loads twice (target, then the drafter's ``mtp.``
    tensors)."""
    sd = target.vllm_state_dict()
    if draft is not None:
        sd.update(draft.vllm_state_dict())
    return sd
