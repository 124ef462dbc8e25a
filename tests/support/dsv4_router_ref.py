"""DeepSeek-V4 MoE router at a real expert count (issue 26, part 4): inputs, a pure-torch reference
and the checks shared by tests/gpu/test_dsv4_router_256.py and
tests/unit/support/test_dsv4_router_ref.py.

vLLM 0.34.0's DSV4 MoE layer (``models/deepseek_v4/nvidia/model.py``) computes the router logits
in float32 (its ``GateLinear`` has ``out_dtype=torch.float32``) and, on a non-hash layer with
``topk_method == "noaux_tc"``, a float32 ``e_score_correction_bias`` of one value per routed expert.
``fused_topk_bias`` (``fused_moe/router/fused_topk_bias_router.py``) takes vLLM's Triton
``dsv4_topk`` fast path when the scoring is ``sqrtsoftplus``, there is no hash table and
``can_use_dsv4_topk`` holds: CUDA, float32 2-D contiguous logits with 256 or 384 experts, a float32
contiguous bias of that length, top-6, renormalize, int32 or int64 ids. Its padding mask
(``get_moe_padding_mask``) marks the CUDA-graph padding rows of the batch (rows past num_tokens,
filled by the GPU model runner); those rows get id -1 and weight 0.

The DSV4 rule this reference implements (read from vLLM, written here independently): weight =
sqrt(softplus(logit)) (softplus is the identity above 20); the selection score is weight + bias
(a NaN score counts as -1e30); the 6 best scores win, ties to the lower expert id; the selected
*unbiased* weights are renormalized to sum to ``routed_scaling_factor``.

Everything is built on the CPU from a seeded generator and then moved, so the CPU dry run checks
the exact tensors the GPU test uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOPK = 6
SCALE = 1.5  # DSV4's routed_scaling_factor
MIN_MARGIN = 1e-3  # real rows: consecutive scores of the best 7 differ by at least this much
GARBAGE = ("nan", "inf", "huge", "zeros", "random")
# (real rows R, CUDA-graph size P): decode batches padded up to a captured size
BATCHES = ((1, 4), (3, 4), (5, 8), (7, 8), (13, 16))


@dataclass
class Case:
    logits: torch.Tensor  # [R, E] float32, the real rows
    bias: torch.Tensor  # [E] float32
    num_experts: int
    seed: int


def make_case(num_experts: int, num_rows: int, seed: int, device: str = "cpu") -> Case:
    """R real rows of router logits whose top-6 is unambiguous (margin >= MIN_MARGIN)."""
    g = torch.Generator().manual_seed(seed)
    bias = (torch.randn(num_experts, generator=g) * 0.3).float()
    rows = []
    while len(rows) < num_rows:
        row = (torch.randn(num_experts, generator=g) * 2.0).float()
        if score_margin(row[None], bias)[0] >= MIN_MARGIN:
            rows.append(row)
    logits = torch.stack(rows).contiguous()
    return Case(logits.to(device), bias.to(device).contiguous(), num_experts, seed)


def garbage_rows(kind: str, num_rows: int, num_experts: int, seed: int) -> torch.Tensor:
    """Padding rows' contents: what a stale or poisoned graph buffer may hold."""
    g = torch.Generator().manual_seed(10_000 + seed)
    if kind == "nan":
        return torch.full((num_rows, num_experts), float("nan"))
    if kind == "inf":
        t = torch.full((num_rows, num_experts), float("inf"))
        t[:, ::2] = float("-inf")
        return t
    if kind == "huge":
        t = torch.randn(num_rows, num_experts, generator=g).sign() * 1e30
        return t.float()
    if kind == "zeros":
        return torch.zeros(num_rows, num_experts)
    if kind == "random":
        return (torch.randn(num_rows, num_experts, generator=g) * 50.0).float()
    raise ValueError(f"unknown garbage kind {kind!r}")


def padded(case: Case, total_rows: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The real rows followed by ``total_rows - R`` garbage rows, and the padding mask."""
    r = case.logits.shape[0]
    assert total_rows >= r
    dev = case.logits.device
    junk = garbage_rows(kind, total_rows - r, case.num_experts, case.seed).to(dev)
    logits = torch.cat([case.logits, junk]).contiguous()
    mask = torch.zeros(total_rows, dtype=torch.bool, device=dev)
    mask[r:] = True
    return logits, mask


def _weights(logits: torch.Tensor) -> torch.Tensor:
    x = logits.double()
    return torch.sqrt(torch.where(x > 20.0, x, torch.log1p(torch.exp(x))))


def _scores(logits: torch.Tensor, bias: torch.Tensor, use_bias: bool = True) -> torch.Tensor:
    s = _weights(logits) + (bias.double() if use_bias else 0.0)
    return torch.where(torch.isnan(s), torch.full_like(s, -1e30), s)


def score_margin(logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Per row: the smallest gap between consecutive scores of the best 7 (how far the top-6, and
    its order, is from a tie that float32 rounding could break either way)."""
    top = torch.topk(_scores(logits.cpu(), bias.cpu()), TOPK + 1, dim=-1).values
    return (top[:, :-1] - top[:, 1:]).min(-1).values


def reference_topk(
    logits: torch.Tensor,
    bias: torch.Tensor,
    scale: float = SCALE,
    *,
    use_bias: bool = True,
    scoring: str = "sqrtsoftplus",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch DSV4 top-6 on the CPU in float64: (weights float64 [N, 6], ids int64 [N, 6]).
    ``use_bias=False`` / ``scoring="sigmoid"`` are the deliberately wrong references of the
    controls."""
    lg = logits.detach().cpu()
    if scoring == "sqrtsoftplus":
        w = _weights(lg)
    elif scoring == "sigmoid":
        w = torch.sigmoid(lg.double())
    else:
        raise ValueError(scoring)
    s = w + (bias.detach().cpu().double() if use_bias else 0.0)
    s = torch.where(torch.isnan(s), torch.full_like(s, -1e30), s)
    # descending, ties to the lower index: a stable sort of the negated scores
    ids = torch.sort(-s, dim=-1, stable=True).indices[:, :TOPK]
    sel = torch.gather(w, 1, ids)
    total = sel.sum(-1, keepdim=True)
    sel = sel * scale / torch.where(total > 0, total, torch.ones_like(total))
    return sel, ids


def bits(t: torch.Tensor) -> torch.Tensor:
    """A float32 tensor's bit patterns (bitwise comparison that treats NaN like any value)."""
    assert t.dtype == torch.float32, t.dtype
    return t.contiguous().view(torch.int32)


def rows_differ(w_a, ids_a, w_b, ids_b) -> list[int]:
    """Rows whose ids or weight bits differ (both pairs over the same rows)."""
    assert w_a.shape == w_b.shape and ids_a.shape == ids_b.shape, (w_a.shape, w_b.shape)
    same_ids = (ids_a.long() == ids_b.long()).all(-1)
    same_w = (bits(w_a) == bits(w_b)).all(-1)
    return torch.nonzero(~(same_ids & same_w)).flatten().tolist()


def reference_problems(w, ids, logits, bias, scale: float = SCALE, **ref_kw) -> list[str]:
    """Real rows vs the reference: ids exactly (in order), weights within 1e-4 relative (the
    kernel computes in float32, the reference in float64)."""
    rw, rids = reference_topk(logits, bias, scale, **ref_kw)
    out = []
    got_ids = ids.detach().cpu().long()
    got_w = w.detach().cpu().double()
    for r in range(rids.shape[0]):
        if not torch.equal(got_ids[r], rids[r]):
            out.append(f"row {r}: ids {got_ids[r].tolist()} != reference {rids[r].tolist()}")
        elif not torch.allclose(got_w[r], rw[r], rtol=1e-4, atol=1e-6):
            out.append(f"row {r}: weights {got_w[r].tolist()} != reference {rw[r].tolist()}")
    return out


def padding_problems(w, ids, mask) -> list[str]:
    """Padding rows must come out as id -1 and weight 0."""
    rows = torch.nonzero(mask.cpu()).flatten().tolist()
    out = []
    for r in rows:
        if not bool((ids[r].cpu() == -1).all()) or not bool((w[r].cpu() == 0).all()):
            out.append(f"padding row {r}: ids {ids[r].tolist()} weights {w[r].tolist()}")
    return out


def perturb_row(case: Case, row: int) -> torch.Tensor:
    """A copy of the real logits where ``row`` sends a huge logit to an expert outside its top-6
    (the control: that row's routing must change, and only that row's)."""
    _, ids = reference_topk(case.logits, case.bias)
    chosen = set(ids[row].tolist())
    victim = next(e for e in range(case.num_experts) if e not in chosen)
    out = case.logits.clone()
    out[row, victim] = 400.0
    return out


def runner_padding_buffer(num_tokens: int, max_tokens: int = 32, device: str = "cpu"):
    """The GPU model runner's ``is_padding`` input buffer as it publishes it in the forward
    context: False for the batch's real tokens, True for the rest (``get_moe_padding_mask``
    slices it to the padded batch)."""
    buf = torch.ones(max_tokens, dtype=torch.bool, device=device)
    buf[:num_tokens] = False
    return buf


def call_fused_topk_bias(router, hidden, logits, bias):
    """vLLM's DSV4 router entry (``fused_topk_bias``) as the DSV4 MoE layer calls it."""
    return router.fused_topk_bias(
        hidden_states=hidden,
        gating_output=logits,
        scoring_func="sqrtsoftplus",
        e_score_correction_bias=bias,
        topk=TOPK,
        renormalize=True,
        indices_type=None,
        routed_scaling_factor=SCALE,
    )
