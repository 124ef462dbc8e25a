"""The verdicts of ``dspark_dev/training/dsv4_check.py`` on CPU (pure torch, the small CPU config
with a 128-wide head, about 3 s each): what the first GPU run (docs/dsv4-pure-torch.md, "First GPU
run") showed they must tell apart.

* ``judge``: DSpark tokens that leave the no-spec ones at a near-tie of the reference pass with a
  note, at a confident token they fail, and after a near-tie a confident wrong DSpark token fails;
* ``judge_drafts``: our own drafts pass; a draft step computed with the draft's closest routing
  near-tie resolved the other way is explained below the tie threshold and flagged above it;
  drafts and confidences after vLLM's chain departed from ours are judged on vLLM's chain;
* ``MoE.margin`` / ``MoE.swap``: the routing diagnostics those verdicts use.
"""

from __future__ import annotations

import pytest
import torch

from dspark_dev.training import dsv4_check as C
from dspark_dev.training import dsv4_models as M


@pytest.fixture(scope="module")
def pair():
    from dspark_dev import tiny_mla_drafts

    fields = tiny_mla_drafts.tiny_dsv4_config(gpu=False).to_dict()
    fields = {k: v for k, v in fields.items() if v is not None}
    fields.update(head_dim=128, qk_rope_head_dim=64)  # one 64-channel fp8 block + RoPE
    cfg = M.DSV4Config.from_dict(fields)
    target, draft = M.TinyDSV4(cfg), M.TinyDSV4Draft(cfg)
    M.init_pair(target, draft, seed=0)
    with torch.no_grad():
        target.head.weight.mul_(C.HEAD_GAIN)
    return target.eval(), draft.eval()


def test_judge_tells_a_near_tie_divergence_from_a_wrong_token(pair):
    target, _ = pair
    assert C.self_test_judge(target, C.DEFAULT_MARGIN, C.DEFAULT_LP_TOL) == []


def test_judge_drafts_explains_routing_near_ties_only(pair):
    target, draft = pair
    assert C.self_test_drafts(target, draft, C.DEFAULT_MARGIN, C.DEFAULT_LP_TOL) == []


def test_moe_margin_and_swap():
    """``margin`` = biased score of the last chosen expert minus the runner-up's; ``swap`` puts the
    runner-up in the last chosen expert's place on the masked tokens only."""
    cfg = M.DSV4Config(hidden_size=32, n_routed_experts=4, num_experts_per_tok=2)
    moe = M.MoE(cfg, layer=1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    x, ids = torch.randn(1, 6, 32, generator=g), torch.zeros(1, 6, dtype=torch.long)
    w, sel = moe.route(x, ids)
    biased = torch.sqrt(torch.nn.functional.softplus(x @ moe.gate.weight.t())) + moe.gate_bias
    ranked = torch.sort(biased, -1, descending=True)
    torch.testing.assert_close(moe.margin, ranked.values[..., 1] - ranked.values[..., 2])
    mask = torch.zeros(1, 6, dtype=torch.bool)
    mask[0, 4] = True
    moe.swap = mask
    w2, sel2 = moe.route(x, ids)
    assert torch.equal(sel2[~mask], sel[~mask])
    assert set(sel2[0, 4].tolist()) == {int(ranked.indices[0, 4, 0]), int(ranked.indices[0, 4, 2])}
    out_swapped = moe(x, ids)
    moe.swap = None
    out = moe(x, ids)
    assert torch.equal(out_swapped[~mask], out[~mask])
    assert not torch.allclose(out_swapped[0, 4], out[0, 4])
