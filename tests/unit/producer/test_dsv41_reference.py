"""The pure-torch DeepSeek-V4.1 reference (dspark_dev/training/dsv41_models.py) against vLLM
0.34.0's own V4.1 classes built on CPU (tests/support/tiny_dsv41.py), float32, seeded weights:

* the exported checkpoint fills every parameter of vLLM's ``DeepseekV41ForCausalLM`` (the text
  model and the vision stand-in, ``dsv41_train.vision_tensors``) and of its DSpark drafter with
  the intended values (``dsv41_check``);
* vLLM's real model forward and drafter forward (its ``DeepseekV4DecoderLayer.forward``, layer
  loop, taps and final collapse) with the mHC kernels answered by vLLM's own torch references
  (``mhc_pre_delayed_torch``, ``mhc_post_torch``) and each layer's attention and MoE answered by
  the reference's module, equal the reference's target logits, taps and draft hidden: the V4.1
  wiring (delayed pre-mix, tap = stream entering the layer, collapse with the last FFN pre) is
  vLLM's, not ours;
* the drafter's context path (``combine_hidden_states``, the per-stage context KV before RoPE).

Controls: each comparison fails with the V4 wiring put back into the reference (the current
sublayer's pre instead of the carried one; taps after the layer), and with a checkpoint tensor
dropped. Here (not under tests/unit/dspark_dev/training): the models need this directory's
``dist_env``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import tiny_dsv41 as v41

REPO = Path(__file__).resolve().parents[3]
TOKENIZER = REPO / "models" / "tiny-pair" / "target" / "tokenizer.json"
T = 24  # tokens of the compared sequence


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """A seeded float32 reference pair and its exported directory (float32 safetensors)."""
    from dspark_dev.training import dsv41_train as D
    from dspark_dev.training.export import write_model_dir

    torch.manual_seed(0)
    cfg, view = D.build_dsv41_configs(448, 4, 8, 2)
    target, draft = D.DSV41TrainTarget(cfg, seed=0), D.DSV41TrainDraft(cfg, view, seed=1)
    draft.init_from_target(target)
    with torch.no_grad():  # a distinct noise row and non-trivial mixes / sinks
        draft.mask_embedding.normal_()
        for m in (target, draft):
            for n, p in m.named_parameters():
                if n.endswith(("base", "attn_sink", "gate_bias")):
                    p.normal_(0, 0.5)
    sd = D.M.vllm_checkpoint(target, draft.core)
    sd["embed.weight"] = draft.target_embed_with_mask(target)
    sd.update(D.vision_tensors(cfg.hidden_size))  # the vision stand-in the exported config names
    sd = {k: v.float().contiguous() for k, v in sd.items()}
    out = tmp_path_factory.mktemp("dsv41-ref")
    path = write_model_dir(str(out / "dsv41"), D.dsv41_hf_config(cfg), sd, str(TOKENIZER))
    return target, draft, sd, Path(path).parent


@pytest.fixture(scope="module")
def vcfg(ref, plugin, dist_env):
    pair = v41.t.TinyPair(str(ref[3]), str(ref[3]), "dsv41-ref")
    return v41.engine_config(pair, pp=1, dtype="float32")


def _loaded(cfg, ref, monkeypatch, drafter: bool):
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v41.nvidia.dspark import DSparkDeepseekV4ForCausalLM

    from dspark_dev.training import dsv41_check as C

    if drafter:
        model = v41.build_drafter(cfg, DSparkDeepseekV4ForCausalLM, monkeypatch)
    else:
        model = v41.build_stage(cfg, 0, 1, monkeypatch)
    with set_current_vllm_config(cfg):
        problems = C.load_problems(model, ref[2], drafter=drafter, n_layers=2)
    return model, problems


@pytest.mark.parametrize("drafter", [False, True], ids=["target", "drafter"])
def test_checkpoint_fills_every_vllm_parameter(vcfg, ref, drafter, monkeypatch):
    _, problems = _loaded(vcfg, ref, monkeypatch, drafter)
    assert problems == []


@pytest.mark.parametrize(
    "dropped, param",
    [
        ("layers.1.attn.indexer.wk.weight", "language_model.model.layers.1.attn.indexer.wk.weight"),
        ("image_start", "image_start"),  # the vision stand-in, named as vLLM's loader checks it
        ("aligner.w1.weight", "aligner.w1.weight"),  # one vLLM's loader does not check
    ],
)
def test_a_dropped_tensor_is_reported(vcfg, ref, dropped, param, monkeypatch):
    """Control: the check sees a checkpoint tensor the loader never got."""
    from vllm.config import set_current_vllm_config

    from dspark_dev.training import dsv41_check as C

    sd = dict(ref[2])
    del sd[dropped]
    model = v41.build_stage(vcfg, 0, 1, monkeypatch)
    with set_current_vllm_config(vcfg):
        problems = C.load_problems(model, sd, drafter=False, n_layers=2)
    assert f"vLLM parameter {param} has no exported value" in problems
    assert f"load_weights did not load {param}" in problems


# ------------------------------------------------------------- vLLM's forward, kernels stood in
def _rms(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def _pre(residual, fn, scale, base, rms_eps, pre_eps, sk_eps, alpha, iters, pre_mix=None,
         x=None, norm_weight=None, norm_eps=1e-6):  # fmt: skip
    """``mhc_pre_delayed_tilelang`` by vLLM's reference, plus the documented input RMSNorm."""
    from vllm.model_executor.kernels.mhc.torch import mhc_pre_delayed_torch

    post, comb, inp, nxt = mhc_pre_delayed_torch(
        residual, fn, scale, base, rms_eps, pre_eps, sk_eps, alpha, iters, pre_mix=pre_mix, x=x
    )
    return post, comb, inp if norm_weight is None else _rms(inp, norm_weight, norm_eps), nxt


def _shifted(x, residual, post, comb, fn, scale, base, rms_eps, pre_eps, sk_eps, alpha, iters,
             pre_mix=None, norm_weight=None, norm_eps=1e-6, capture_aux=False, **_):  # fmt: skip
    """``mhc_shifted_post_pre``: the previous sublayer's post (vLLM's ``mhc_post_torch``), then
    the next pre; ``aux`` is the posted streams' mean."""
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch

    residual = mhc_post_torch(x, residual, post, comb)
    post, comb, inp, nxt = _pre(
        residual, fn, scale, base, rms_eps, pre_eps, sk_eps, alpha, iters,
        pre_mix=pre_mix, norm_weight=norm_weight, norm_eps=norm_eps,
    )  # fmt: skip
    return residual, post, comb, inp, nxt, residual.mean(dim=1) if capture_aux else None


def _stand_in_kernels(monkeypatch):
    import vllm.models.deepseek_v41.nvidia.dspark as d
    import vllm.models.deepseek_v41.nvidia.model as m
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch

    def collapse(x, pre_mix):
        return (pre_mix.unsqueeze(-1) * x.float()).sum(1).to(x.dtype)

    for mod in (m, d):
        monkeypatch.setattr(mod, "mhc_post_tilelang", mhc_post_torch)
        monkeypatch.setattr(mod, "hc_collapse_triton", collapse)
    monkeypatch.setattr(m, "mhc_pre_delayed_tilelang", _pre)
    monkeypatch.setattr(m, "mhc_shifted_post_pre", _shifted)
    monkeypatch.setattr(m, "hc_expand", lambda x, hc: x.unsqueeze(1).expand(-1, hc, -1).clone())


def _answer_sublayers(vllm_layers, ref_layers, attn_fns, ids, monkeypatch):
    """Each vLLM layer's attention and MoE answered by the reference layer's (one sequence)."""
    for lay, rl, fn in zip(vllm_layers, ref_layers, attn_fns, strict=True):
        monkeypatch.setattr(lay.attn, "forward", lambda pos, x, _o, fn=fn: fn(x[None])[0])
        monkeypatch.setattr(lay.ffn, "forward",
                            lambda x, _ids, *a, rl=rl: rl.ffn(x[None], ids[None])[0])  # fmt: skip


def _head(model, hidden):
    """vLLM's lm_head weight applied to the final hidden (its logits processor is a matmul)."""
    return torch.nn.functional.linear(hidden, model.get_language_model().lm_head.weight)


def _ref(target, ids, taps):
    """The reference target's (logits, taps) of one sequence (not the training view's triple)."""
    from dspark_dev.training.dsv41_models import TinyDSV41

    return TinyDSV41.forward(target, ids[None], taps)


def _sequence():
    g = torch.Generator().manual_seed(3)
    return torch.randint(3, 400, (T,), generator=g)


@pytest.fixture(scope="module")
def vllm_target(vcfg, ref):
    mp = pytest.MonkeyPatch()
    try:
        model, problems = _loaded(vcfg, ref, mp, drafter=False)
    finally:
        mp.undo()
    assert problems == []
    return model


def _vllm_target_forward(model, vcfg, ref_target, ids, monkeypatch):
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        set_eagle3_aux_hidden_state_layers,
    )

    _stand_in_kernels(monkeypatch)
    model.get_language_model().process_weights_after_loading()  # the first layer's broadcast fn
    inner = model.get_language_model().model
    fns = [lambda h, a=rl.attn: a(h) for rl in ref_target.layers]
    _answer_sublayers(inner.layers, ref_target.layers, fns, ids, monkeypatch)
    with set_current_vllm_config(vcfg), torch.no_grad():
        set_eagle3_aux_hidden_state_layers(model, vcfg.speculative_config, use_pp=False)
        hidden, taps = model(ids, torch.arange(len(ids)), None)
    return hidden, taps


def test_vllm_target_forward_equals_the_reference(vllm_target, vcfg, ref, monkeypatch):
    target = ref[0]
    ids = _sequence()
    hidden, taps = _vllm_target_forward(vllm_target, vcfg, target, ids, monkeypatch)
    with torch.no_grad():
        logits, aux = _ref(target, ids, (1, 2))
        mine = _head(vllm_target, hidden)
    assert len(taps) == 2
    for a, b in zip(aux, taps, strict=True):
        torch.testing.assert_close(b, a[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine, logits[0], atol=1e-4, rtol=1e-4)


def test_v4_wiring_in_the_reference_is_caught(vllm_target, vcfg, ref, monkeypatch):
    """Control: V4's mixing (each sublayer collapsed with its own pre) in the reference makes the
    comparison fail."""
    from dspark_dev.training import dsv41_models as M

    target = ref[0]
    ids = _sequence()
    hidden, _ = _vllm_target_forward(vllm_target, vcfg, target, ids, monkeypatch)

    def v4_forward(self, streams, pre_in, ids_, attn_fn):
        s = self.mixed(streams, self.hc_attn, self.attn_norm, attn_fn)
        pre_f, post_f, comb_f = self.hc_ffn.weights(s, self.cfg)
        s = M.HyperMix.expand(self.ffn(self.ffn_norm(M.HyperMix.collapse(s, pre_f)), ids_), s,
                              post_f, comb_f)  # fmt: skip
        return s, pre_f

    monkeypatch.setattr(M.DecoderLayer41, "forward", v4_forward)
    with torch.no_grad():
        logits, _ = _ref(target, ids, (1, 2))
        mine = _head(vllm_target, hidden)
    assert not torch.allclose(mine, logits[0], atol=1e-3, rtol=1e-3)


def test_vllm_drafter_forward_and_context_equal_the_reference(vcfg, ref, monkeypatch):
    import vllm.models.deepseek_v41.nvidia.dspark as d
    from vllm.config import set_current_vllm_config

    target, draft, _, _ = ref
    core = draft.core
    mp = pytest.MonkeyPatch()
    try:
        model, problems = _loaded(vcfg, ref, mp, drafter=True)
    finally:
        mp.undo()
    assert problems == []
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with set_current_vllm_config(vcfg):  # the CPU linear methods' post-load step
        process_weights_after_loading(model, vcfg.model_config, torch.device("cpu"))
    ids = _sequence()
    n, anchor = 4, 15
    with torch.no_grad():
        _, aux = _ref(target, ids, core.aux_layers)
        ctx = core.context(aux)
        # the context path: main_norm(main_proj(concat taps)), then each stage's kv before RoPE
        main_x = model.model.combine_hidden_states(torch.cat([a[0] for a in aux], -1))
        torch.testing.assert_close(main_x, ctx[0], atol=1e-5, rtol=1e-5)
        seen = []
        monkeypatch.setattr(d, "_insert_context_kv", lambda attn, kv, pos, slots: seen.append(kv))
        with set_current_vllm_config(vcfg):
            model.model.precompute_and_store_context_kv(
                main_x, torch.arange(T), [torch.arange(T)] * len(core.layers)
            )
        for kv, layer in zip(seen, core.layers, strict=True):
            torch.testing.assert_close(kv, layer.attn.kv_norm(layer.attn.wkv(ctx[0])),
                                       atol=1e-5, rtol=1e-5)  # fmt: skip
        # the stages: vLLM's drafter forward over one block, sublayers answered by ours
        anchors = torch.tensor([[anchor]])
        _, _, ref_hidden = core(_view(draft), ids[None], ctx, anchors, block_size=n)
        fns, qpos = core.stage_attention(ctx, anchors, n)
        blk = torch.full((n,), core.cfg.dspark_noise_token_id)
        blk[0] = ids[anchor]
        _stand_in_kernels(monkeypatch)
        _answer_sublayers(model.model.layers, core.layers, fns, blk, monkeypatch)
        embeds = _view(draft).embed(blk)
        with set_current_vllm_config(vcfg):
            hidden = model.model(blk, qpos[0], inputs_embeds=embeds)
    torch.testing.assert_close(hidden, ref_hidden[0, 0], atol=1e-5, rtol=1e-5)


def _view(draft):
    from dspark_dev.training.dsv4_train import _TargetView

    t = draft._target[0]
    return _TargetView(t.embed.weight, draft.mask_embedding, draft.dcfg.noise_token_id,
                       t.head.weight)  # fmt: skip


@pytest.mark.parametrize("layer", [0, 1], ids=["window-only", "ratio-1"])
def test_rope_of_each_layer_is_the_vllm_layers(vllm_target, ref, layer):
    """The reference's RoPE (and inverse) per layer against the rotary embedding vLLM's V4.1
    attention built for that layer (``rope_theta`` at ratio 0, ``compress_rope_theta`` above)."""
    attn = ref[0].layers[layer].attn
    rot = vllm_target.get_language_model().model.layers[layer].attn.rotary_emb
    g = torch.Generator().manual_seed(layer)
    pos = torch.randint(0, 200, (T,), generator=g)
    q = torch.randn(T, 3, attn.cfg.head_dim, generator=g)
    k = torch.randn(T, 1, attn.cfg.head_dim, generator=g)
    q_v, k_v = rot.forward_native(pos, q.clone(), k.clone())
    torch.testing.assert_close(attn.rope(q[None], pos)[0], q_v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attn.rope(k[:, 0][None], pos)[0], k_v[:, 0], rtol=1e-5, atol=1e-5)
    inv_v, _ = rot.forward_native(pos, q.clone(), None, inverse=True)
    torch.testing.assert_close(attn.rope(q[None], pos, inverse=True)[0], inv_v, rtol=1e-5,
                               atol=1e-5)  # fmt: skip
    other = ref[0].layers[1 - layer].attn  # control: the other layer's theta does not match
    assert not torch.allclose(other.rope(q[None], pos)[0], q_v, atol=1e-3)


def test_vllm_drafts_the_exported_block_by_default(ref, plugin, dist_env):
    """vLLM's DSpark config takes ``num_speculative_tokens`` from the exported
    ``dspark_block_size`` when the speculative config names none, with V4.1's drafter."""
    from dspark_dev import tiny_dsv4_cpu

    pair = v41.t.TinyPair(str(ref[3]), str(ref[3]), "dsv41-ref")
    cfg = tiny_dsv4_cpu.engine_config(
        pair, speculative_config={"method": "dspark", "model": pair.draft}, dtype="float32"
    )
    spec = cfg.speculative_config
    assert spec.draft_model_config.architectures == [v41.DRAFT_ARCH]
    assert spec.num_speculative_tokens == ref[0].cfg.dspark_block_size == 4


BUNDLED = REPO / "models" / "dsv41-pair" / "dsv41"


@pytest.mark.skipif(not BUNDLED.is_dir(), reason="models/dsv41-pair not bundled in this checkout")
@pytest.mark.parametrize("drafter", [False, True], ids=["target", "drafter"])
def test_bundled_pair_fills_every_vllm_parameter(plugin, dist_env, drafter, monkeypatch):
    """The bundled trained pair (bfloat16) loads into vLLM's V4.1 target and drafter on CPU."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v41.nvidia.dspark import DSparkDeepseekV4ForCausalLM

    from dspark_dev.training import dsv41_check as C

    pair = v41.t.TinyPair(str(BUNDLED), str(BUNDLED), "dsv41-pair")
    cfg = v41.engine_config(pair, pp=1)
    assert cfg.speculative_config.draft_model_config.architectures == [v41.DRAFT_ARCH]
    if drafter:
        model = v41.build_drafter(cfg, DSparkDeepseekV4ForCausalLM, monkeypatch)
    else:
        model = v41.build_stage(cfg, 0, 1, monkeypatch)
    sd = load_file(str(BUNDLED / "model.safetensors"))
    n_layers = cfg.model_config.hf_config.num_hidden_layers
    with set_current_vllm_config(cfg):
        assert C.load_problems(model, sd, drafter=drafter, n_layers=n_layers) == []
