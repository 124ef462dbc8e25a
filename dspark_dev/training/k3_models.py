"""Pure-torch training modules of the tiny Kimi-K3 pair: a ``KimiLinearForCausalLM`` target and its
``K3DSparkModel`` drafter, written from what vLLM 0.34.0 computes at inference (file:line below are
in ``vllm/models/kimi_k3/nvidia/``), with the checkpoint names and layouts vLLM loads.

Target (``model.py``): embeddings, then per layer ``x += attn(input_layernorm(x))``,
``x += mlp(post_attention_layernorm(x))``; the final ``model.norm`` is applied in
``compute_logits`` (model.py:1632-1640) and the untied ``lm_head`` gives the logits. Layer ``i``
(0-based) is a KDA layer when ``i + 1`` is in ``linear_attn_config.kda_layers``, else a NoPE MLA
layer; its MLP is dense for ``i < first_k_dense_replace``, else the MoE. ``aux_layer_ids`` are
vLLM's EAGLE-3 aux ids (model.py:1236-1265): id ``L`` is the residual stream after layer ``L - 1``
(``hidden_states + residual``), so a drafter ``target_layer_ids`` entry ``i`` is aux id ``i + 1``
(``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:128-130``).

* KDA (``kda.py:574-1554``, kernels ``ops/third_party/kda/fused_recurrent.py:140-300``):
  ``q, k, v = silu(causal depthwise conv of width 4 (no bias) of q/k/v_proj(h))``; gate
  ``g = -exp(A_log[h]) * softplus(f_b_proj(f_a_proj(h)) + dt_bias)`` (threshold 20, no lower
  bound); ``beta = sigmoid(b_proj(h))``; q and k are L2-normalised (``x / sqrt(sum x^2 + 1e-6)``)
  and q is scaled by ``head_dim ** -0.5``; per head the state ``S [v, k]`` runs
  ``S *= exp(g)`` (over k), ``u = beta * (v - S k)``, ``S += u k^T``, ``o = S q``. The output is
  ``o_proj(rmsnorm(o, eps 1e-5) * o_norm.weight * sigmoid(g_proj(h)))`` per head
  (``FusedRMSNormGated(head_dim, activation="sigmoid")``, kda.py:879). This is a recurrent scan
  (the chunked prefill kernel computes the same recurrence).
* MLA without RoPE (``mla.py``, ``mla_use_nope``): ``q = q_b_proj(q_a_layernorm(q_a_proj(h)))``
  per head ``[nope | rope]``; ``kv_a_proj_with_mqa(h) = [kv_c | k_pe]`` with ``k_pe`` shared by all
  heads; ``kv_b_proj(kv_a_layernorm(kv_c))`` per head ``[k_nope | v]``; causal softmax attention
  with scale ``(nope + rope) ** -0.5`` (mla.py:163); ``o_proj``.
* MoE (``model.py:366-690``, ``fused_moe/router/grouped_topk_router.py:92-190``): router logits
  ``gate(x)`` in float32, ``scores = sigmoid(logits)``, top-k of ``scores +
  e_score_correction_bias`` (one group), weights = the chosen unbiased scores renormalised to sum 1
  (times ``routed_scaling_factor`` = 1); experts ``w2(silu(w1 x) * w3 x)``; plus the shared expert
  (a SwiGLU MLP of width ``moe_intermediate_size * num_shared_experts``).

Drafter (``dspark_mla.py``): the context is ``context_norm(context_proj(concat(aux)))``; each layer
projects it with that layer's ``kv_a_proj_with_mqa`` and ``kv_a_layernorm`` (no input layernorm;
``_precompute_fused_context_kv``, dspark_mla.py:238-290), ``k_pe`` rotated at the context
position. The query block at positions ``a .. a+N-1`` is ``[anchor, noise * (N-1)]`` embedded by
the TARGET's ``embed_tokens`` (``has_own_embed_tokens = False``); each layer is a pre-norm MLA with
GPT-J style RoPE (``use_rope=True``, ``is_neox_style=False``, mla.py:170-182) that attends
non-causally to the context ``< a`` and its whole block (``non_causal_multi_token_decode``), then a
SwiGLU MLP; ``final_norm``; the logits are the target's ``lm_head`` plus the DSpark Markov bias
``markov_w2(markov_w1(prev))`` (prev_0 = anchor, then the previous drafted token) exactly as for the
Qwen3 pair (the same speculator, ``v1/worker/gpu/spec_decode/dspark/speculator.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from dspark_dev.training.models import MLP, DraftHeads, RMSNorm, _init_weights, rope_cos_sin

# vLLM 0.34.0 fuses q, k, v, g (H*d rows each), f_a (d rows) and b (H rows) of a KDA layer into
# one ``in_proj_qkvgfab`` and, when the TP-local row count is not a multiple of the alignment (16
# unless the layer is FP8_PB_WO-quantized), appends a zero padding shard (models/kimi_k3/nvidia/
# kda.py:641-659). No checkpoint name maps to that shard (model.py:1342-1356), and the default
# loader's completeness check asks for every shard with rows on the rank
# (model_executor/layers/linear.py:727-741, model_loader/default_loader.py:568-573, 608-612):
# such a checkpoint fails at engine start ("weights were not initialized ... weight.6").
KDA_IN_PROJ_ALIGNMENT = 16
# the KDA layer's plain linear projections, in checkpoint order (kda.py's names, model.py:1342-1356)
KDA_LINEARS = ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "f_a_proj", "f_b_proj", "o_proj")


def kda_in_proj_shard_rows(num_heads: int, head_dim: int, tp_size: int = 1) -> list[int]:
    """TP-local rows of each shard of vLLM's ``in_proj_qkvgfab`` (q, k, v, g, f_a, b[, padding]),
    by the rule of kda.py:641-659 (f_a is replicated on every rank, the others are split)."""
    local_heads = num_heads // tp_size
    rows = [local_heads * head_dim] * 4 + [head_dim, local_heads]
    padding = -sum(rows) % KDA_IN_PROJ_ALIGNMENT
    return rows + [padding] if padding else rows


def check_kda_geometry(num_heads: int, head_dim: int, tp_size: int = 1) -> None:
    """Refuse a KDA geometry whose fused projection vLLM pads: its checkpoint cannot load."""
    rows = kda_in_proj_shard_rows(num_heads, head_dim, tp_size)
    if len(rows) == 7:
        raise ValueError(
            f"KDA geometry {num_heads} heads x {head_dim} (TP {tp_size}) cannot be loaded by vLLM "
            f"0.34.0: 4*H*d + d + H = {sum(rows[:6])} rows per rank is not a multiple of "
            f"{KDA_IN_PROJ_ALIGNMENT}, so vLLM appends a {rows[6]}-row padding shard to "
            "in_proj_qkvgfab (models/kimi_k3/nvidia/kda.py:641-659) that no checkpoint tensor "
            "fills, and the default loader refuses it (model_loader/default_loader.py:568-573, "
            "608-612: 'in_proj_qkvgfab.weight.6' not initialized). Fix: pick (H, d) with "
            "(4*H*d + d + H) % 16 == 0, e.g. H a multiple of 16 when d is a multiple of 16 "
            "(--kda-heads 16 --kda-head-dim 16)."
        )


@dataclass
class K3TargetConfig:
    vocab_size: int = 512
    hidden_size: int = 128
    num_hidden_layers: int = 4
    intermediate_size: int = 256  # the dense MLP of the first ``first_k_dense_replace`` layers
    moe_intermediate_size: int = 64
    num_experts: int = 4
    num_experts_per_token: int = 2
    num_shared_experts: int = 1
    first_k_dense_replace: int = 1
    # KDA geometry: vLLM's loader needs 4*H*d + d + H to be a multiple of 16 (see
    # ``check_kda_geometry``); 16 x 16 is the smallest aligned one with a power-of-two d >= 16.
    kda_num_heads: int = 16
    kda_head_dim: int = 16
    short_conv_kernel_size: int = 4
    # MLA (shared geometry with the drafter: one KV-cache row width on both sides). The latent
    # widths are those the CUDA MLA backends are built for (kv_lora_rank 512 + RoPE 64 = a 576-wide
    # row, ``tiny_mla_drafts.k3_mla_dims(gpu=True)``); 2 heads keep ``kv_b_proj`` small.
    num_attention_heads: int = 2
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    q_lora_rank: int = 64
    kv_lora_rank: int = 512
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1024

    def is_kda(self, i: int) -> bool:
        """0-based layer ``i``: KDA on even layers (1-based ``kda_layers`` = odd numbers)."""
        return i % 2 == 0

    def kda_layers(self) -> list[int]:
        return [i + 1 for i in range(self.num_hidden_layers) if self.is_kda(i)]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class K3DraftConfig:
    num_hidden_layers: int = 2
    intermediate_size: int = 256
    block_size: int = 7
    markov_rank: int = 32
    mask_token_id: int = 1
    target_layer_ids: list[int] = field(default_factory=lambda: [0, 2, 3])
    rope_theta: float = 50000.0  # K3DSparkConfig's default
    confidence_head_with_markov: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J style rotation (pairs ``(x[2j], x[2j+1])``); x [..., S, heads, d], cos/sin [..., S,
    d/2]."""
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return out.to(x.dtype)


class MLA(nn.Module):
    """Kimi-K3 MLA with q-LoRA; ``rope`` selects the drafter's RoPE variant (the target's is NoPE).
    Parameter names follow the HF checkpoint."""

    def __init__(self, c: K3TargetConfig, rope: bool):
        super().__init__()
        self.c, self.rope = c, rope
        H, nh = c.hidden_size, c.num_attention_heads
        self.q_a_proj = nn.Linear(H, c.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = nn.Linear(
            c.q_lora_rank, nh * (c.qk_nope_head_dim + c.qk_rope_head_dim), False
        )
        self.kv_a_proj_with_mqa = nn.Linear(H, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, nh * (c.qk_nope_head_dim + c.v_head_dim), False)
        self.o_proj = nn.Linear(nh * c.v_head_dim, H, bias=False)
        self.scale = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5

    def q_of(self, h, cos=None, sin=None):
        c = self.c
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        q = q.unflatten(-1, (c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim))
        if self.rope:
            nope, pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], -1)
            q = torch.cat([nope, apply_rope_interleaved(pe, cos, sin)], -1)
        return q

    def kv_of(self, h, cos=None, sin=None):
        """(k [B,S,heads,nope+rope], v [B,S,heads,v])"""
        c = self.c
        kv_c, k_pe = self.kv_a_proj_with_mqa(h).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        k_pe = k_pe.unsqueeze(-2)  # one RoPE key shared by all heads
        if self.rope:
            k_pe = apply_rope_interleaved(k_pe, cos, sin)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_c))
        kv = kv.unflatten(-1, (c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim))
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], -1)
        k = torch.cat([k_nope, k_pe.expand(*k_nope.shape[:-1], c.qk_rope_head_dim)], -1)
        return k, v

    def attend(self, q, k, v, mask=None, causal=False):
        """q [B,S,H,dq], k [B,K,H,dq], v [B,K,H,dv]; mask bool [B or 1,S,K] (True = attend)."""
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=None if mask is None else mask.unsqueeze(1),
            is_causal=causal and mask is None,
            scale=self.scale,
        )
        return self.o_proj(out.transpose(1, 2).flatten(-2))


def kda_recurrent(q, k, v, g, beta):
    """The KDA recurrence token by token, as ``fused_recurrent_kda`` runs it (fp32).

    q, k, v, g [B,T,H,d] (q, k normalised, q scaled; g the log decay, <= 0), beta [B,T,H];
    per head the state ``S [v, k]``: ``S *= exp(g_t)`` over k, ``u = beta (v - S k)``,
    ``S += u k^T``, ``o = S q``. Returns o [B,T,H,d]."""
    B, T, H, d = q.shape
    decay = torch.exp(g)
    S = q.new_zeros(B, H, d, d)
    outs = []
    for t in range(T):
        S = S * decay[:, t].unsqueeze(-2)
        u = (v[:, t] - (S * k[:, t].unsqueeze(-2)).sum(-1)) * beta[:, t].unsqueeze(-1)
        S = S + u.unsqueeze(-1) * k[:, t].unsqueeze(-2)
        outs.append((S * q[:, t].unsqueeze(-2)).sum(-1))
    return torch.stack(outs, 1)


def kda_chunked(q, k, v, g, beta, chunk: int = 16):
    """:func:`kda_recurrent` in chunks of ``chunk`` tokens (same result up to rounding).

    Within a chunk with entry state ``S0`` and cumulative log decay ``G_i``, the delta-rule updates
    ``u`` solve ``(I + diag(beta) A) U = diag(beta) (V - K_hat S0^T)`` with
    ``A_ij = sum_d k_jd k_id exp(G_id - G_jd)`` (j < i) and ``K_hat = K * exp(G)``; the outputs are
    ``O = Q_hat S0^T + B U`` with ``B_ij = sum_d q_id k_jd exp(G_id - G_jd)`` (j <= i) and the exit
    state ``S0 * exp(G_C) + U^T (K * exp(G_C - G))``. Only the chunk-to-chunk state is sequential.
    """
    B, T, H, d = q.shape
    pad = (-T) % chunk
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n = (T + pad) // chunk
    # [B,H,n,C,d]
    q, k, v, g = (x.view(B, n, chunk, H, d).permute(0, 3, 1, 2, 4) for x in (q, k, v, g))
    beta = beta.view(B, n, chunk, H).permute(0, 3, 1, 2)  # [B,H,n,C]
    G = g.cumsum(-2)
    idx = torch.arange(chunk, device=q.device)
    strict = idx.view(-1, 1) > idx.view(1, -1)  # [i, j]: j < i
    lower = idx.view(-1, 1) >= idx.view(1, -1)
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [B,H,n,C(i),C(j),d] = G_i - G_j
    decay_ij = torch.exp(diff.masked_fill(~lower.view(chunk, chunk, 1), float("-inf")))
    A = torch.einsum("...id,...jd,...ijd->...ij", k, k, decay_ij) * strict
    Bm = torch.einsum("...id,...jd,...ijd->...ij", q, k, decay_ij)
    M = torch.eye(chunk, device=q.device) + beta.unsqueeze(-1) * A
    eG = torch.exp(G)
    k_hat, q_hat = k * eG, q * eG
    WV = torch.linalg.solve_triangular(M, beta.unsqueeze(-1) * v, upper=False)
    WK = torch.linalg.solve_triangular(M, beta.unsqueeze(-1) * k_hat, upper=False)
    k_end = k * torch.exp(G[..., -1:, :] - G)  # decayed to the chunk's end
    S = q.new_zeros(B, H, d, d)  # [v, k]
    outs = []
    for c in range(n):
        U = WV[:, :, c] - WK[:, :, c] @ S.transpose(-1, -2)  # [B,H,C,dv]
        outs.append(q_hat[:, :, c] @ S.transpose(-1, -2) + Bm[:, :, c] @ U)
        S = S * eG[:, :, c, -1].unsqueeze(-2) + U.transpose(-1, -2) @ k_end[:, :, c]
    o = torch.stack(outs, 2)  # [B,H,n,C,d]
    return o.permute(0, 2, 3, 1, 4).reshape(B, n * chunk, H, d)[:, :T]


class KDA(nn.Module):
    """Kimi Delta Attention with the full-rank output gate (``KimiK3DeltaAttention``)."""

    def __init__(self, c: K3TargetConfig):
        super().__init__()
        self.c = c
        H, nh, d = c.hidden_size, c.kda_num_heads, c.kda_head_dim
        P = nh * d
        self.q_proj = nn.Linear(H, P, bias=False)
        self.k_proj = nn.Linear(H, P, bias=False)
        self.v_proj = nn.Linear(H, P, bias=False)
        self.g_proj = nn.Linear(H, P, bias=False)  # output gate
        self.b_proj = nn.Linear(H, nh, bias=False)  # beta
        self.f_a_proj = nn.Linear(H, d, bias=False)  # decay gate, low rank
        self.f_b_proj = nn.Linear(d, P, bias=False)
        K = c.short_conv_kernel_size
        self.q_conv1d = nn.Parameter(torch.empty(P, K))
        self.k_conv1d = nn.Parameter(torch.empty(P, K))
        self.v_conv1d = nn.Parameter(torch.empty(P, K))
        self.A_log = nn.Parameter(torch.empty(nh))
        self.dt_bias = nn.Parameter(torch.empty(P))
        self.o_norm = nn.Parameter(torch.ones(d))
        self.o_proj = nn.Linear(P, H, bias=False)

    chunked = True  # kda_chunked (fast); kda_recurrent is the step-by-step reference

    def reset_kda_parameters(self) -> None:
        with torch.no_grad():
            for w in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
                nn.init.normal_(w, std=0.3)
            self.A_log.copy_(torch.log(torch.linspace(1.0, 4.0, self.A_log.numel())))
            # decay rates exp(-A * softplus(dt_bias)) spread over (0.5, 0.99) at init
            self.dt_bias.uniform_(-4.5, -0.5)
            self.o_norm.fill_(1.0)

    @staticmethod
    def short_conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv; x [B,T,C], w [C,K]; w[:, K-1] multiplies the current token."""
        K = w.shape[1]
        xp = F.pad(x.transpose(1, 2), (K - 1, 0))
        return F.silu(F.conv1d(xp, w.unsqueeze(1), groups=w.shape[0]).transpose(1, 2))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        c = self.c
        nh, d = c.kda_num_heads, c.kda_head_dim
        B, T, _ = h.shape
        q = self.short_conv(self.q_proj(h), self.q_conv1d).unflatten(-1, (nh, d)).float()
        k = self.short_conv(self.k_proj(h), self.k_conv1d).unflatten(-1, (nh, d)).float()
        v = self.short_conv(self.v_proj(h), self.v_conv1d).unflatten(-1, (nh, d)).float()
        raw = (self.f_b_proj(self.f_a_proj(h)).float() + self.dt_bias.float()).unflatten(
            -1, (nh, d)
        )
        g = -torch.exp(self.A_log.float()).view(nh, 1) * F.softplus(raw, beta=1.0, threshold=20.0)
        beta = torch.sigmoid(self.b_proj(h).float())  # [B,T,nh]
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * d**-0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        with torch.autocast(device_type=h.device.type, enabled=False):
            o = (kda_chunked if self.chunked else kda_recurrent)(q, k, v, g, beta)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * self.o_norm.float()
        o = o * torch.sigmoid(self.g_proj(h).float().unflatten(-1, (nh, d)))
        return self.o_proj(o.flatten(-2).to(h.dtype))


class MoE(nn.Module):
    def __init__(self, c: K3TargetConfig):
        super().__init__()
        self.c = c
        E, H, inter = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.gate = nn.Linear(H, E, bias=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.w1 = nn.Parameter(torch.empty(E, inter, H))
        self.w2 = nn.Parameter(torch.empty(E, H, inter))
        self.w3 = nn.Parameter(torch.empty(E, inter, H))
        self.shared_experts = MLP(H, inter * c.num_shared_experts)

    def reset_expert_parameters(self) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        scores = torch.sigmoid(F.linear(x.float(), self.gate.weight.float()))  # [...,E]
        ids = torch.topk(scores + self.e_score_correction_bias, c.num_experts_per_token, -1)[1]
        w = scores.gather(-1, ids)
        w = w / w.sum(-1, keepdim=True)
        dense_w = torch.zeros_like(scores).scatter(-1, ids, w)  # [...,E]
        up = torch.einsum("...h,eih->...ei", x, self.w1)
        gate3 = torch.einsum("...h,eih->...ei", x, self.w3)
        out = torch.einsum("...ei,ehi->...eh", F.silu(up) * gate3, self.w2)  # [...,E,H]
        routed = (out * dense_w.to(out.dtype).unsqueeze(-1)).sum(-2)
        return routed + self.shared_experts(x)


class K3Layer(nn.Module):
    def __init__(self, c: K3TargetConfig, i: int):
        super().__init__()
        self.is_kda = c.is_kda(i)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = KDA(c) if self.is_kda else MLA(c, rope=False)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.is_moe = i >= c.first_k_dense_replace
        if self.is_moe:
            self.block_sparse_moe = MoE(c)
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + (
            self.self_attn(h)
            if self.is_kda
            else self.self_attn.attend(
                self.self_attn.q_of(h), *self.self_attn.kv_of(h), causal=True
            )
        )
        h = self.post_attention_layernorm(x)
        return x + (self.block_sparse_moe(h) if self.is_moe else self.mlp(h))


class TinyK3(nn.Module):
    """KimiLinearForCausalLM (text only, untied lm_head)."""

    def __init__(self, cfg: K3TargetConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(K3Layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.apply(_init_weights)
        for m in self.modules():
            if isinstance(m, KDA):
                m.reset_kda_parameters()
            elif isinstance(m, MoE):
                m.reset_expert_parameters()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def forward(self, ids: torch.Tensor, aux_layer_ids: tuple[int, ...] = ()):
        """ids [B,T] -> (logits [B,T,V], final normed hidden, aux list of [B,T,H])."""
        x = self.embed_tokens(ids)
        aux = []
        for idx, layer in enumerate(self.layers):
            if idx in aux_layer_ids:
                aux.append(x)
            x = layer(x)
        if self.cfg.num_hidden_layers in aux_layer_ids:
            aux.append(x)
        hidden = self.norm(x)
        return self.lm_head(hidden), hidden, aux

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """HF Kimi-Linear checkpoint names (``KimiLinearModel.load_weights``, model.py:1331-1500):
        unfused q/k/v/g/b/f_a projections and q/k/v_conv1d ``[C, 1, K]`` for KDA, unfused
        ``q_a_proj`` / ``kv_a_proj_with_mqa`` for MLA, experts as ``experts.<e>.w1/w2/w3``."""
        sd: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": self.embed_tokens.weight,
            "model.norm.weight": self.norm.weight,
            "lm_head.weight": self.lm_head.weight,
        }
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            sd[p + "input_layernorm.weight"] = layer.input_layernorm.weight
            sd[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
            a = layer.self_attn
            if layer.is_kda:
                for n in KDA_LINEARS:
                    sd[p + f"self_attn.{n}.weight"] = getattr(a, n).weight
                for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                    sd[p + f"self_attn.{n}.weight"] = getattr(a, n).unsqueeze(1)
                sd[p + "self_attn.A_log"] = a.A_log
                sd[p + "self_attn.dt_bias"] = a.dt_bias
                sd[p + "self_attn.o_norm.weight"] = a.o_norm
            else:
                for n, v in a.state_dict().items():
                    sd[p + f"self_attn.{n}"] = v
            if layer.is_moe:
                m = layer.block_sparse_moe
                q = p + "block_sparse_moe."
                sd[q + "gate.weight"] = m.gate.weight
                sd[q + "gate.e_score_correction_bias"] = m.e_score_correction_bias
                for e in range(self.cfg.num_experts):
                    sd[q + f"experts.{e}.w1.weight"] = m.w1[e]
                    sd[q + f"experts.{e}.w2.weight"] = m.w2[e]
                    sd[q + f"experts.{e}.w3.weight"] = m.w3[e]
                for n, v in m.shared_experts.state_dict().items():
                    sd[q + f"shared_experts.{n}"] = v
            else:
                for n, v in layer.mlp.state_dict().items():
                    sd[p + f"mlp.{n}"] = v
        return {k: v.detach().float().contiguous().clone() for k, v in sd.items()}

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`hf_state_dict` (every name must be present)."""
        own = self.hf_state_dict()
        missing = sorted(set(own) - set(sd))
        assert not missing, f"missing from the checkpoint: {missing}"
        with torch.no_grad():
            self.embed_tokens.weight.copy_(sd["model.embed_tokens.weight"])
            self.norm.weight.copy_(sd["model.norm.weight"])
            self.lm_head.weight.copy_(sd["lm_head.weight"])
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                local = {k[len(p) :]: v for k, v in sd.items() if k.startswith(p)}
                layer.input_layernorm.weight.copy_(local["input_layernorm.weight"])
                layer.post_attention_layernorm.weight.copy_(
                    local["post_attention_layernorm.weight"]
                )
                a = layer.self_attn
                if layer.is_kda:
                    for n in KDA_LINEARS:
                        getattr(a, n).weight.copy_(local[f"self_attn.{n}.weight"])
                    for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                        getattr(a, n).copy_(local[f"self_attn.{n}.weight"].squeeze(1))
                    a.A_log.copy_(local["self_attn.A_log"])
                    a.dt_bias.copy_(local["self_attn.dt_bias"])
                    a.o_norm.copy_(local["self_attn.o_norm.weight"])
                else:
                    a.load_state_dict(
                        {
                            k[len("self_attn.") :]: v
                            for k, v in local.items()
                            if k.startswith("self_attn.")
                        }
                    )
                if layer.is_moe:
                    m, q = layer.block_sparse_moe, "block_sparse_moe."
                    m.gate.weight.copy_(local[q + "gate.weight"])
                    m.e_score_correction_bias.copy_(local[q + "gate.e_score_correction_bias"])
                    for e in range(self.cfg.num_experts):
                        m.w1[e].copy_(local[q + f"experts.{e}.w1.weight"])
                        m.w2[e].copy_(local[q + f"experts.{e}.w2.weight"])
                        m.w3[e].copy_(local[q + f"experts.{e}.w3.weight"])
                    m.shared_experts.load_state_dict(
                        {
                            k[len(q + "shared_experts.") :]: v
                            for k, v in local.items()
                            if k.startswith(q + "shared_experts.")
                        }
                    )
                else:
                    layer.mlp.load_state_dict(
                        {k[len("mlp.") :]: v for k, v in local.items() if k.startswith("mlp.")}
                    )


class DraftLayer(nn.Module):
    def __init__(self, c: K3TargetConfig, d: K3DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MLA(c, rope=True)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, d.intermediate_size)


class TinyK3DSpark(DraftHeads):
    """K3 DSpark drafter. Embeddings and lm_head are the target's (vLLM shares them); only the
    noise-token row of the embeddings is trained here (``mask_embedding``) and written into the
    target's ``embed_tokens`` on export (the target never reads that row: the token is not in the
    corpus)."""

    def __init__(self, tcfg: K3TargetConfig, dcfg: K3DraftConfig):
        super().__init__()
        self.tcfg, self.dcfg = tcfg, dcfg
        H = tcfg.hidden_size
        self.context_proj = nn.Linear(len(dcfg.target_layer_ids) * H, H, bias=False)
        self.context_norm = RMSNorm(H, tcfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(tcfg, dcfg) for _ in range(dcfg.num_hidden_layers))
        self.final_norm = RMSNorm(H, tcfg.rms_norm_eps)
        self._finish_init(H, tcfg.vocab_size, dcfg)

    def context(self, aux: list[torch.Tensor]) -> torch.Tensor:
        return self.context_norm(self.context_proj(torch.cat(aux, dim=-1)))

    def _rope(self, pos: torch.Tensor):
        return rope_cos_sin(pos, self.tcfg.qk_rope_head_dim, self.dcfg.rope_theta)

    def forward(
        self, ids: torch.Tensor, ctx: torch.Tensor, anchors: torch.Tensor, lm_head: torch.Tensor
    ):
        """Same contract as ``TinyDSparkDraft.forward`` (models.py): ids [B,T], ctx [B,T,H],
        anchors [B,M], lm_head [V,H] -> (logits [B,M,N,V] with the teacher-forced Markov bias,
        confidence logits [B,M,N], normed hidden [B,M,N,H])."""
        dcfg = self.dcfg
        B, T = ids.shape
        M, N = anchors.shape[1], dcfg.block_size
        dev = ids.device
        qpos = anchors.unsqueeze(-1) + torch.arange(N, device=dev)  # [B,M,N]
        blk = torch.full((B, M, N), dcfg.mask_token_id, dtype=ids.dtype, device=dev)
        blk[:, :, 0] = ids.gather(1, anchors)
        x = self.embed(blk).flatten(1, 2)  # [B,M*N,H]
        qcos, qsin = self._rope(qpos.flatten(1))
        ccos, csin = self._rope(torch.arange(T, device=dev))
        mask = self.block_mask(T, anchors, N)
        x = self.run_layers(x, ctx, (qcos, qsin), (ccos, csin), mask)
        return self.heads(self.final_norm(x).view(B, M, N, -1), ids, qpos, lm_head)

    def vllm_state_dict(self) -> dict[str, torch.Tensor]:
        """The HF-layout draft checkpoint ``K3DSparkForCausalLM.load_weights`` reads
        (dspark_mla.py:432-455: ``q_a_proj`` / ``kv_a_proj_with_mqa`` and ``gate_proj`` /
        ``up_proj`` unfused; no embeddings or lm_head, which are the target's)."""
        sd: dict[str, torch.Tensor] = {
            "context_proj.weight": self.context_proj.weight,
            "context_norm.weight": self.context_norm.weight,
            "final_norm.weight": self.final_norm.weight,
            "markov_head.markov_w1.weight": self.markov_w1.weight,
            "markov_head.markov_w2.weight": self.markov_w2.weight,
            "confidence_head.proj.weight": self.confidence_proj.weight,
            "confidence_head.proj.bias": self.confidence_proj.bias,
        }
        for k, v in self.layers.state_dict().items():
            sd[f"layers.{k}"] = v
        return {k: v.detach().float().contiguous().clone() for k, v in sd.items()}

    def load_vllm_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.context_proj.weight.copy_(sd["context_proj.weight"])
            self.context_norm.weight.copy_(sd["context_norm.weight"])
            self.final_norm.weight.copy_(sd["final_norm.weight"])
            self.markov_w1.weight.copy_(sd["markov_head.markov_w1.weight"])
            self.markov_w2.weight.copy_(sd["markov_head.markov_w2.weight"])
            self.confidence_proj.weight.copy_(sd["confidence_head.proj.weight"])
            self.confidence_proj.bias.copy_(sd["confidence_head.proj.bias"])
            self.layers.load_state_dict(
                {k[len("layers.") :]: v for k, v in sd.items() if k.startswith("layers.")}
            )

    def target_embed_with_mask(self, target: TinyK3) -> torch.Tensor:
        """The target's ``embed_tokens`` with this drafter's trained noise-token row."""
        emb = target.embed_tokens.weight.detach().clone()
        emb[self.dcfg.mask_token_id] = self.mask_embedding.detach().to(emb.dtype)
        return emb
