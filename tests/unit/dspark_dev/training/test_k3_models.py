"""Fast checks of the Kimi-K3 training modules (the vLLM comparison is test_k3_equivalence.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark_dev.training.k3_models import (
    K3DraftConfig,
    K3TargetConfig,
    TinyK3,
    TinyK3DSpark,
    kda_chunked,
    kda_recurrent,
)


def _kda_inputs(B=2, T=37, H=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, d, generator=g), dim=-1) * d**-0.5
    k = F.normalize(torch.randn(B, T, H, d, generator=g), dim=-1)
    v = torch.randn(B, T, H, d, generator=g) * 3
    # log decays from about -0.01 (slow: long memory) to about -3 per step
    gate = -F.softplus(torch.randn(B, T, H, d, generator=g) - 2) * 2
    beta = torch.rand(B, T, H, generator=g)
    return [x.requires_grad_() for x in (q, k, v, gate, beta)]


def test_chunked_kda_equals_the_recurrence_with_gradients():
    """T = 37 is not a multiple of the chunk (16): the padding path is covered."""
    xs = _kda_inputs()
    ref = kda_recurrent(*xs)
    got = kda_chunked(*xs)
    assert float(ref.detach().abs().max()) > 0.5
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    g_ref = torch.autograd.grad(ref.square().sum(), xs)
    g_got = torch.autograd.grad(got.square().sum(), xs)
    for a, b in zip(g_got, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_hf_state_dict_round_trip_and_sizes():
    torch.manual_seed(0)
    tcfg, dcfg = K3TargetConfig(vocab_size=448), K3DraftConfig()
    t, d = TinyK3(tcfg), TinyK3DSpark(tcfg, dcfg)
    sd = t.hf_state_dict()
    t2 = TinyK3(tcfg)
    t2.load_hf_state_dict(sd)
    for k, v in t2.hf_state_dict().items():
        assert torch.equal(v, sd[k]), k
    ids = torch.randint(3, 448, (1, 12))
    torch.testing.assert_close(t2(ids)[0], t(ids)[0])
    # bundled small: target + drafter well under 8 MB in bfloat16
    n = sum(v.numel() for v in sd.values()) + sum(v.numel() for v in d.vllm_state_dict().values())
    assert 2 * n < 6 * 2**20, n
