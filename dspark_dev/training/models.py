"""Pure-torch training modules of the tiny pair: a Qwen3 target and a Qwen3 DSpark drafter.

Both compute what vLLM 0.34.0 computes at inference with the same weights (checked by
tests/unit/dspark_dev/training/test_dspark_equivalence.py against CPU vLLM):

* ``TinyQwen3`` mirrors ``vllm/model_executor/models/qwen3.py`` (pre-norm decoder, per-head q/k
  RMSNorm before neox RoPE, SwiGLU MLP, tied embeddings). ``aux_layer_ids`` are vLLM's aux ids: id
  ``L`` is the residual stream entering layer ``L`` (``hidden_states + residual``), so a DSpark
  ``target_layer_ids`` entry ``i`` is aux id ``i + 1``
  (eagle3_utils.get_eagle3_aux_layers_from_config).
* ``TinyDSparkDraft`` mirrors ``qwen3_dflash.py`` + ``qwen3_dspark.py`` and the DSpark speculator
  (``v1/worker/gpu/spec_decode/dspark/speculator.py``): context = ``hidden_norm(fc(concat(aux)))``
  projected by every layer's k/v (k_norm, RoPE at the context position) with no input layernorm;
  the query block at positions ``a .. a+N-1`` is ``[anchor, mask * (N-1)]`` (anchor-as-first-
  prediction, ``sample_from_anchor``), attends non-causally to the context ``< a`` and to its whole
  block; block position ``i`` predicts the token at ``a+i+1`` with logits
  ``lm_head(norm(h_i)) + markov_w2(markov_w1(prev_i))`` where ``prev_0`` is the anchor and
  ``prev_i`` the token at ``a+i``; confidence ``sigmoid(proj([h_i, markov_w1(prev_i)]))``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TargetConfig:
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1024

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DraftConfig:
    num_hidden_layers: int = 2
    intermediate_size: int = 384
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    block_size: int = 7
    markov_rank: int = 32
    mask_token_id: int = 1
    # zero-based target layers whose outputs feed the drafter (vLLM aux ids are these + 1)
    target_layer_ids: list[int] = field(default_factory=lambda: [0, 2, 3])
    confidence_head_with_markov: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(dtype) * self.weight.to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    )
    freqs = positions.float().unsqueeze(-1) * inv_freq
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """neox-style rotation; x [..., S, heads, d], cos/sin broadcastable to [..., S, 1, d/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def q_of(self, h, cos, sin):
        q = self.q_norm(self.q_proj(h).unflatten(-1, (self.heads, self.head_dim)))
        return apply_rope(q, cos, sin)

    def kv_of(self, h, cos, sin):
        k = self.k_norm(self.k_proj(h).unflatten(-1, (self.kv_heads, self.head_dim)))
        v = self.v_proj(h).unflatten(-1, (self.kv_heads, self.head_dim))
        return apply_rope(k, cos, sin), v

    def attend(self, q, k, v, mask=None, causal=False):
        """q [B,S,H,d], k/v [B,K,Hkv,d]; mask bool [B or 1,S,K] (True = attend)."""
        rep = self.heads // self.kv_heads
        q = q.transpose(1, 2)
        k = k.repeat_interleave(rep, dim=2).transpose(1, 2)
        v = v.repeat_interleave(rep, dim=2).transpose(1, 2)
        m = None if mask is None else mask.unsqueeze(1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=m, is_causal=causal and mask is None
        )
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class DecoderLayer(nn.Module):
    def __init__(self, hidden, inter, heads, kv_heads, head_dim, eps):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, inter)


class TinyQwen3(nn.Module):
    """Qwen3ForCausalLM with tied embeddings; parameter names follow the HF/vLLM checkpoint."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg.hidden_size,
                cfg.intermediate_size,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                cfg.rms_norm_eps,
            )
            for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.apply(_init_weights)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output projection (tied: the embeddings)."""
        return self.embed_tokens.weight

    def forward(self, ids: torch.Tensor, aux_layer_ids: tuple[int, ...] = ()):
        """ids [B,T] -> (logits [B,T,V], final normed hidden, aux list of [B,T,H])."""
        cfg = self.cfg
        pos = torch.arange(ids.shape[1], device=ids.device)
        cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta)
        x = self.embed_tokens(ids)
        aux = []
        for idx, layer in enumerate(self.layers):
            if idx in aux_layer_ids:
                aux.append(x)
            h = layer.input_layernorm(x)
            q = layer.self_attn.q_of(h, cos, sin)
            k, v = layer.self_attn.kv_of(h, cos, sin)
            x = x + layer.self_attn.attend(q, k, v, causal=True)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if cfg.num_hidden_layers in aux_layer_ids:
            aux.append(x)
        hidden = self.norm(x)
        return hidden @ self.embed_tokens.weight.t(), hidden, aux

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Checkpoint names of HF Qwen3ForCausalLM (lm_head tied, so not stored)."""
        return {
            f"model.{k}": v.detach().float().contiguous().clone()
            for k, v in self.state_dict().items()
        }


class DraftHeads(nn.Module):
    """What every DSpark drafter here shares (Qwen3 and Kimi-K3): the Markov head, the confidence
    head, the frozen copy of the target's embeddings with its trainable noise-token row, and the
    aux-layer numbering. A subclass builds its context projection, layers and final norm, then
    calls ``_finish_init``, which creates these heads and initialises every weight in one fixed
    order (so a seed gives the same draft as before this class existed)."""

    def _finish_init(self, H: int, vocab_size: int, dcfg) -> None:
        self.markov_w1 = nn.Embedding(vocab_size, dcfg.markov_rank)
        self.markov_w2 = nn.Linear(dcfg.markov_rank, vocab_size, bias=False)
        conf_in = H + (dcfg.markov_rank if dcfg.confidence_head_with_markov else 0)
        self.confidence_proj = nn.Linear(conf_in, 1, bias=True)
        self.apply(_init_weights)
        nn.init.zeros_(self.markov_w2.weight)
        self.embed_tokens = nn.Embedding(vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.mask_embedding = nn.Parameter(torch.zeros(H))

    def init_from_target(self, target: nn.Module) -> None:
        with torch.no_grad():
            self.embed_tokens.weight.copy_(target.embed_tokens.weight)
            self.mask_embedding.copy_(target.embed_tokens.weight[self.dcfg.mask_token_id])

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return tuple(i + 1 for i in self.dcfg.target_layer_ids)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.embed_tokens(ids)
        return torch.where(
            (ids == self.dcfg.mask_token_id).unsqueeze(-1), self.mask_embedding.to(e.dtype), e
        )

    @staticmethod
    def block_mask(T: int, anchors: torch.Tensor, N: int) -> torch.Tensor:
        """[B, M*N, T + M*N] attention mask of M blocks of N queries: block query (m, i) sees
        context position j < a_m and every key of its own block m."""
        B, M = anchors.shape
        dev = anchors.device
        ctx_ok = torch.arange(T, device=dev).view(1, 1, 1, T) < anchors.view(B, M, 1, 1)
        ctx_ok = ctx_ok.expand(B, M, N, T).reshape(B, M * N, T)
        blk_id = torch.arange(M, device=dev).repeat_interleave(N)
        blk_ok = (blk_id.view(-1, 1) == blk_id.view(1, -1)).unsqueeze(0).expand(B, -1, -1)
        return torch.cat([ctx_ok, blk_ok], dim=-1)

    def run_layers(self, x, ctx, q_rope, ctx_rope, mask) -> torch.Tensor:
        """The block queries ``x`` through the draft layers: each layer's keys and values are the
        context's (``ctx`` at the context positions' RoPE) and the block's own."""
        for layer in self.layers:
            attn = layer.self_attn
            ck, cv = attn.kv_of(ctx, *ctx_rope)
            h = layer.input_layernorm(x)
            q = attn.q_of(h, *q_rope)
            bk, bv = attn.kv_of(h, *q_rope)
            x = x + attn.attend(q, torch.cat([ck, bk], 1), torch.cat([cv, bv], 1), mask=mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def heads(self, hidden, ids, qpos, lm_head):
        """(logits with the teacher-forced Markov bias, confidence logits, hidden) of normed
        block states ``hidden`` [B,M,N,H] at positions ``qpos`` [B,M,N]: the Markov input of
        position a+i is the token at a+i (the anchor for i = 0)."""
        T = ids.shape[1]
        prev = ids.gather(1, qpos.flatten(1).clamp(max=T - 1)).view(qpos.shape)
        memb = self.markov_w1(prev)
        logits = hidden @ lm_head.t().to(hidden.dtype) + self.markov_w2(memb)
        with_markov = self.dcfg.confidence_head_with_markov
        conf_in = torch.cat([hidden, memb], -1) if with_markov else hidden
        conf = self.confidence_proj(conf_in.float()).squeeze(-1)
        return logits, conf, hidden


class TinyDSparkDraft(DraftHeads):
    """Qwen3 DSpark draft. ``embed_tokens`` is a frozen copy of the target's except the trainable
    mask row; ``lm_head`` is the target's (shared, frozen) and is passed to ``forward``."""

    def __init__(self, tcfg: TargetConfig, dcfg: DraftConfig):
        super().__init__()
        self.tcfg, self.dcfg = tcfg, dcfg
        H = tcfg.hidden_size
        self.fc = nn.Linear(len(dcfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, tcfg.rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(
                H,
                dcfg.intermediate_size,
                dcfg.num_attention_heads,
                dcfg.num_key_value_heads,
                dcfg.head_dim,
                tcfg.rms_norm_eps,
            )
            for _ in range(dcfg.num_hidden_layers)
        )
        self.norm = RMSNorm(H, tcfg.rms_norm_eps)
        self._finish_init(H, tcfg.vocab_size, dcfg)

    def context(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """[B,T,H] context states: hidden_norm(fc(concat(aux)))."""
        return self.hidden_norm(self.fc(torch.cat(aux, dim=-1)))

    def forward(
        self, ids: torch.Tensor, ctx: torch.Tensor, anchors: torch.Tensor, lm_head: torch.Tensor
    ):
        """Draft blocks anchored at ``anchors``.

        ids [B,T] (token ids of the sequences), ctx [B,T,H] (``context(aux)``), anchors [B,M]
        (anchor positions a, with context ``< a``), lm_head [V,H]. Returns (logits [B,M,N,V]
        including the teacher-forced Markov bias, confidence logits [B,M,N], normed hidden).
        """
        tcfg, dcfg = self.tcfg, self.dcfg
        B, T = ids.shape
        M, N = anchors.shape[1], dcfg.block_size
        offs = torch.arange(N, device=ids.device)
        qpos = anchors.unsqueeze(-1) + offs  # [B,M,N]
        anchor_tok = ids.gather(1, anchors)  # [B,M]
        blk = torch.full((B, M, N), dcfg.mask_token_id, dtype=ids.dtype, device=ids.device)
        blk[:, :, 0] = anchor_tok
        x = self.embed(blk).flatten(1, 2)  # [B,M*N,H]
        qcos, qsin = rope_cos_sin(qpos.flatten(1), dcfg.head_dim, tcfg.rope_theta)
        ccos, csin = rope_cos_sin(
            torch.arange(T, device=ids.device), dcfg.head_dim, tcfg.rope_theta
        )
        mask = self.block_mask(T, anchors, N)
        x = self.run_layers(x, ctx, (qcos, qsin), (ccos, csin), mask)
        return self.heads(self.norm(x).view(B, M, N, -1), ids, qpos, lm_head)

    @torch.no_grad()
    def draft_greedy(self, target: TinyQwen3, seq: torch.Tensor, anchor: int):
        """What vLLM's DSpark speculator drafts greedily for one request whose verified tokens are
        ``seq[:anchor]`` and whose bonus (anchor) token is ``seq[anchor]``: the backbone runs once,
        then the Markov bias is applied left to right from the previously drafted token.
        Returns (draft ids [N], base logits [N,V], confidence probabilities [N])."""
        ids = seq[: anchor + 1].view(1, -1)
        lm_head = target.embed_tokens.weight
        _, _, aux = target(ids, self.aux_layer_ids)
        ctx = self.context(aux)
        padded = torch.cat([ids, ids.new_zeros(1, self.dcfg.block_size)], 1)
        ctx = torch.cat([ctx, ctx.new_zeros(1, self.dcfg.block_size, ctx.shape[-1])], 1)
        _, _, hidden = self(padded, ctx, torch.tensor([[anchor]]), lm_head)
        hidden = hidden[0, 0]
        base = hidden @ lm_head.t()
        prev = seq[anchor].view(1)
        out, membs = [], []
        for i in range(self.dcfg.block_size):
            memb = self.markov_w1(prev)
            membs.append(memb)
            tok = (base[i : i + 1] + self.markov_w2(memb)).argmax(-1)
            out.append(int(tok))
            prev = tok
        memb = torch.cat(membs, 0)
        conf_in = torch.cat([hidden, memb], -1) if self.dcfg.confidence_head_with_markov else hidden
        conf = torch.sigmoid(self.confidence_proj(conf_in.float()).squeeze(-1))
        return torch.tensor(out), base, conf

    def vllm_state_dict(self) -> dict[str, torch.Tensor]:
        """Checkpoint names read by vLLM's Qwen3DSparkForCausalLM.load_weights ("model." is
        added)."""
        sd = {}
        emb = self.embed_tokens.weight.detach().clone()
        emb[self.dcfg.mask_token_id] = self.mask_embedding.detach()
        sd["embed_tokens.weight"] = emb
        sd["fc.weight"] = self.fc.weight
        sd["hidden_norm.weight"] = self.hidden_norm.weight
        sd["norm.weight"] = self.norm.weight
        for k, v in self.layers.state_dict().items():
            sd[f"layers.{k}"] = v
        sd["markov_head.markov_w1.weight"] = self.markov_w1.weight
        sd["markov_head.markov_w2.weight"] = self.markov_w2.weight
        sd["confidence_head.proj.weight"] = self.confidence_proj.weight
        sd["confidence_head.proj.bias"] = self.confidence_proj.bias
        return {k: v.detach().float().contiguous().clone() for k, v in sd.items()}


def _init_weights(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, std=0.02)


def num_params(sd: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() for v in sd.values())


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """DSpark/DFlash within-block decay: w_i = exp(-i / gamma) for block position i = 0..N-1."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32, device=device) / gamma)


def dspark_loss(
    logits,
    conf_logits,
    labels,
    target_probs,
    valid,
    *,
    gamma: float,
    ce_weight: float = 0.1,
    tv_weight: float = 0.9,
    conf_weight: float = 1.0,
):
    """DSpark training objective (Cheng et al., "DSpark: Confidence-Scheduled Speculative Decoding
    with Semi-Autoregressive Generation", arXiv 2607.05147, Sec. 3.3), written from its description:
    position-weighted cross-entropy on the data tokens plus position-weighted total variation
    TV(p_draft, p_target) = 0.5 * ||p_draft - p_target||_1 against the frozen target's next-token
    distribution, plus a confidence BCE whose soft label is the expected acceptance probability of
    the drafted position, 1 - TV (detached). All terms are pooled means over valid positions.

    logits [B,M,N,V], conf_logits [B,M,N], labels [B,M,N], target_probs [B,M,N,V], valid [B,M,N].
    """
    N = logits.shape[2]
    w = position_weights(N, gamma, logits.device).view(1, 1, N) * valid.float()
    denom = w.sum().clamp(min=1e-6)
    logp = F.log_softmax(logits.float(), -1)
    ce = -(logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1))
    tv = 0.5 * (logp.exp() - target_probs.float()).abs().sum(-1)
    bce = F.binary_cross_entropy_with_logits(
        conf_logits.float(), (1.0 - tv).detach().clamp(0, 1), reduction="none"
    )
    ce_l, tv_l = (ce * w).sum() / denom, (tv * w).sum() / denom
    conf_l = (bce * valid.float()).sum() / valid.float().sum().clamp(min=1)
    total = ce_weight * ce_l + tv_weight * tv_l + conf_weight * conf_l
    return total, {"ce": ce_l.detach(), "tv": tv_l.detach(), "conf": conf_l.detach()}


def gpt_lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))
