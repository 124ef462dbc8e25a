"""The pure-torch DeepSeek-V4 pieces (dspark_dev/training/dsv4_models.py) against the vLLM 0.34.0
code that runs on the CPU, same weights, float32 unless vLLM fixes the dtype:

* hyper-connections: ``HyperMix`` against vLLM's eager references ``mhc_pre_torch`` /
  ``mhc_post_torch`` (model_executor/kernels/mhc/torch.py, what its TileLang kernels are tested
  against) and against vLLM's CPU kernels ``mhc_pre_cpu`` / ``mhc_post_cpu``; ``HyperHead``
  against ``hc_head_fused_cpu`` (model_executor/kernels/mhc/cpu.py);
* RoPE: ``Attention.rope`` (and its inverse) against the rotary embedding vLLM builds for a
  DeepSeek-V4 layer (``build_deepseek_v4_rope`` -> ``DeepseekV4ScalingRotaryEmbedding``,
  ``forward_native``), main and compressed theta;
* RMSNorm against vLLM's ``RMSNorm.forward_native``.

The MoE layer and the checkpoint names need a VllmConfig (tens of seconds):
tests/unit/dspark_dev/training/test_dsv4_vllm_cpu.py, opt-in.
"""

from __future__ import annotations

import pytest
import torch

from dspark_dev.training import dsv4_models as M

HC, H, N = 2, 64, 11
EPS, HC_EPS, ITERS = 1e-6, 1e-6, 2


def _cfg(**kw) -> M.DSV4Config:
    return M.DSV4Config(hidden_size=H, hc_mult=HC, hc_sinkhorn_iters=ITERS, **kw)


@pytest.fixture
def vllm_default_config():
    """vLLM's custom ops (RoPE, RMSNorm) read the current config when built."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def _mix(seed: int = 0) -> tuple[M.HyperMix, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mix = M.HyperMix(HC, H)
    with torch.no_grad():
        mix.fn.copy_(torch.randn(mix.fn.shape, generator=g) * 0.3)
        mix.base.copy_(torch.randn(mix.base.shape, generator=g) * 0.5)
        mix.scale.copy_(torch.rand(3, generator=g) + 0.5)
    streams = torch.randn(N, HC, H, generator=g) * 2.0
    return mix, streams


def _vllm_args(mix: M.HyperMix):
    return (mix.fn.detach(), mix.scale.detach(), mix.base.detach(), EPS, HC_EPS, HC_EPS, 2.0, ITERS)


def test_hyper_mix_matches_vllm_eager_reference():
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch, mhc_pre_torch

    mix, streams = _mix()
    res = streams.bfloat16()  # vLLM's reference takes the bf16 residual streams
    post_v, comb_v, inp_v = mhc_pre_torch(res, *_vllm_args(mix))
    with torch.no_grad():
        pre, post, comb = mix.weights(res, _cfg())
        inp = M.HyperMix.collapse(res, pre)
    torch.testing.assert_close(post, post_v.squeeze(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, comb_v, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(inp, inp_v)  # bf16, same rounding
    out = torch.randn(N, H).bfloat16()
    torch.testing.assert_close(
        M.HyperMix.expand(out, res, post, comb), mhc_post_torch(out, res, post_v, comb_v)
    )


def _cpu_kernels():
    try:
        from vllm.model_executor.kernels.mhc import cpu
    except Exception as e:  # noqa: BLE001 - no CPU kernel library in this install
        pytest.skip(f"vLLM's CPU mHC kernels are not importable: {e}")
    # vLLM 0.34.0 loads one CPU kernel library by the CPU's instruction set; only its default
    # _C.abi3.so has the mHC ops, the _C_AVX2 / _C_AVX512 ones do not (an AVX2-only AMD EPYC,
    # 2026-12-07, got _C_AVX2)
    if not all(hasattr(torch.ops._C, op) for op in ("hc_pre_fused_cpu", "hc_head_fused_cpu")):
        pytest.skip("vLLM's CPU kernel library loaded for this CPU has no mHC ops")
    return cpu


def test_hyper_mix_and_head_match_vllm_cpu_kernels():
    """vLLM's CPU kernels take bf16 streams only."""
    cpu = _cpu_kernels()
    dtype = torch.bfloat16
    mix, streams = _mix(1)
    res = streams.to(dtype)
    post_v, comb_v, inp_v = cpu.mhc_pre_cpu(res, *_vllm_args(mix))
    with torch.no_grad():
        pre, post, comb = mix.weights(res, _cfg())
        inp = M.HyperMix.collapse(res, pre)
    tol = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(post, post_v.reshape(N, HC).float(), **tol)
    torch.testing.assert_close(comb, comb_v.float(), **tol)
    torch.testing.assert_close(inp, inp_v)
    out = torch.randn(N, H).to(dtype)
    got = M.HyperMix.expand(out, res, post, comb)
    torch.testing.assert_close(got, cpu.mhc_post_cpu(out, res, post_v, comb_v))

    head = M.HyperHead(HC, H)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        head.fn.copy_(torch.randn(head.fn.shape, generator=g) * 0.3)
        head.base.copy_(torch.randn(HC, generator=g))
        head.scale.fill_(0.7)
        mine = head(res, _cfg())
    ref = cpu.hc_head_fused_cpu(
        res, head.fn.detach(), head.scale.detach(), head.base.detach(), EPS, HC_EPS
    )
    torch.testing.assert_close(mine, ref)


@pytest.mark.parametrize("ratio", [1, 4])
def test_rope_matches_vllm_deepseek_v4_rotary_embedding(ratio, vllm_default_config):
    from vllm.models.deepseek_v4.common.rope import build_deepseek_v4_rope

    from dspark_dev import tiny_mla_drafts

    hf = tiny_mla_drafts.tiny_dsv4_config(gpu=False)  # head_dim 64, RoPE on the last 64
    hf.qk_rope_head_dim = 16
    cfg = M.DSV4Config.from_dict(hf.to_dict())
    cfg.qk_rope_head_dim = 16
    layer = 0 if ratio > 1 else cfg.num_hidden_layers  # a compressed layer / an MTP stage
    cfg.compress_rates = {cfg.layer_types[0]: ratio}
    attn = M.Attention(cfg, layer)
    assert attn.ratio == ratio
    rope = build_deepseek_v4_rope(
        hf,
        head_dim=cfg.head_dim,
        rope_head_dim=16,
        max_position_embeddings=hf.max_position_embeddings,
        compress_ratio=ratio,
    )
    g = torch.Generator().manual_seed(ratio)
    pos = torch.randint(0, 200, (N,), generator=g)
    q = torch.randn(N, 3, cfg.head_dim, generator=g)
    k = torch.randn(N, 1, cfg.head_dim, generator=g)
    q_v, k_v = rope.forward_native(pos, q.clone(), k.clone())
    torch.testing.assert_close(attn.rope(q.unsqueeze(0), pos)[0], q_v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        attn.rope(k[:, 0].unsqueeze(0), pos)[0], k_v[:, 0], rtol=1e-5, atol=1e-5
    )
    inv_v, _ = rope.forward_native(pos, q.clone(), None, inverse=True)
    torch.testing.assert_close(
        attn.rope(q.unsqueeze(0), pos, inverse=True)[0], inv_v, rtol=1e-5, atol=1e-5
    )


def test_rms_norm_matches_vllm(vllm_default_config):
    from vllm.model_executor.layers.layernorm import RMSNorm

    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, H, generator=g) * 3
    w = torch.randn(H, generator=g)
    ref = RMSNorm(H, eps=EPS)
    mine = M.RMSNorm(H, EPS)
    with torch.no_grad():
        ref.weight.copy_(w)
        mine.weight.copy_(w)
    torch.testing.assert_close(mine(x), ref.forward_native(x), rtol=1e-5, atol=1e-5)


def test_draft_sees_the_block_anchored_context_window():
    """vLLM's non-causal DSpark indices (v1/attention/backends/mla/sparse_swa.py:1303-1305):
    every query of a block anchored at a sees context a - window .. a - 1 and its whole block,
    nothing else of the context (pure torch, the CPU tiny config, window 16)."""
    from dspark_dev import tiny_mla_drafts

    cfg = M.DSV4Config.from_dict(tiny_mla_drafts.tiny_dsv4_config(gpu=False).to_dict())
    target, draft = M.TinyDSV4(cfg), M.TinyDSV4Draft(cfg)
    M.init_pair(target, draft, seed=1)
    g = torch.Generator().manual_seed(0)
    T, a, w = 40, 30, cfg.sliding_window
    ids = torch.randint(4, cfg.vocab_size, (1, T), generator=g)
    ctx = torch.randn(1, T, cfg.hidden_size, generator=g)
    anchors = torch.tensor([[a]])

    def hidden(c):
        with torch.no_grad():
            return draft(target, ids, c, anchors)[2]

    base = hidden(ctx)
    for pos, seen in ((a - w - 1, False), (a - w, True), (a - 1, True), (a, False)):
        c = ctx.clone()
        c[:, pos] += 1.0
        changed = not torch.equal(hidden(c), base)
        assert changed == seen, f"context position {pos} (anchor {a}): changed={changed}"
