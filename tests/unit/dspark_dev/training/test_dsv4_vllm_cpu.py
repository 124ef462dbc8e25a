"""The pure-torch tiny DeepSeek-V4 against vLLM 0.34.0's own model classes built on the CPU
(opt-in: ``DSPARK_DSV4_CPU_CHECKS=1``, about 30 s; each needs a VllmConfig):

* the checkpoint ``vllm_checkpoint(target, draft)`` writes loads into vLLM's CUDA
  ``DeepseekV4ForCausalLM`` and ``DSparkDeepseekV4ForCausalLM`` (constructed on the CPU with the
  H200's fp8_ds_mla cache): every parameter but the drafter's aliased embedding / head is loaded
  and holds the value the export meant (``dsv4_check.load_problems``); a missing tensor, a
  misshapen one and a wrong fused order are each flagged;
* the drafter's pieces that run on the CPU (context combiner, context keys before RoPE, Markov
  head, confidence) against ``TinyDSV4Draft`` on the same loaded weights;
* the MoE: vLLM's ``DeepseekV4MoE`` on its CPU route (``CPURouter`` + CPU experts) at 256 routed
  experts / top-6 (the CPU hash top-k kernel takes no smaller expert count), hash-routed layer 0 and
  biased layer 1, against ``dsv4_models.MoE`` with the same weights, float32; a reference without
  ``routed_scaling_factor`` and one that ignores the hash table are each flagged.
"""

from __future__ import annotations

import os

import pytest
import torch

from dspark_dev.training import dsv4_check as C
from dspark_dev.training import dsv4_models as M

pytestmark = pytest.mark.skipif(
    os.environ.get("DSPARK_DSV4_CPU_CHECKS") != "1",
    reason="opt-in (about 30 s): DSPARK_DSV4_CPU_CHECKS=1; vLLM's DeepSeek-V4 classes on the CPU",
)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    _, target, draft = C.build(seed=0)
    d = C.export(tmp_path_factory.mktemp("dsv4"), target, draft)
    return d, M.vllm_checkpoint(target, draft), draft


@pytest.fixture(scope="module")
def loaded(exported):
    d, sd, _ = exported
    keep: dict = {}
    return C.load_problems(d, sd, keep), keep


def test_checkpoint_fills_every_vllm_parameter(loaded):
    report, _ = loaded
    assert report == {"target": [], "drafter": []}


def test_draft_heads_match_vllm_drafter(exported, loaded):
    """What of vLLM's drafter runs on the CPU, loaded from our checkpoint: the context combiner
    (``combine_hidden_states``), every stage's context key before RoPE (``context_wkv_proj`` then
    that stage's ``kv_norm``, as ``precompute_and_store_context_kv`` computes it), the Markov head
    (``markov_embed`` / ``markov_bias``) and the confidence (``compute_confidence``)."""
    from vllm.config import set_current_vllm_config

    _, _, draft = exported
    vd, cfg = loaded[1]["drafter"], loaded[1]["config"]
    g = torch.Generator().manual_seed(7)
    h = draft.cfg.hidden_size
    aux = [torch.randn(6, h, generator=g) for _ in draft.aux_layers]
    ids = torch.randint(4, draft.cfg.vocab_size, (6,), generator=g)
    hidden = torch.randn(6, h, generator=g)
    tol = {"rtol": 1e-5, "atol": 1e-5}
    with set_current_vllm_config(cfg), torch.no_grad():
        main_x = vd.combine_hidden_states(torch.cat(aux, -1))
        torch.testing.assert_close(draft.context(aux), main_x, **tol)
        n = len(draft.layers)
        stacked = vd.model.context_wkv_proj(main_x).view(6, n, -1)
        for i, (ours, theirs) in enumerate(zip(draft.layers, vd.model.layers, strict=True)):
            mine = ours.attn.kv_norm(ours.attn.wkv(main_x))
            torch.testing.assert_close(mine, theirs.attn.kv_norm(stacked[:, i]), **tol)
        memb = vd.markov_embed(ids)
        bias, conf = draft.heads(hidden, ids)
        their_bias = vd.markov_bias(memb)  # computed in the model dtype (bf16) by vLLM
        assert their_bias.dtype == torch.bfloat16
        torch.testing.assert_close(bias, their_bias.float(), rtol=2e-2, atol=2e-2)
        assert conf is not None
        torch.testing.assert_close(torch.sigmoid(conf), vd.compute_confidence(hidden, memb), **tol)


def test_load_check_flags_missing_misshapen_and_misordered_tensors(exported, monkeypatch):
    d, sd, _ = exported
    missing = {k: v for k, v in sd.items() if k != "layers.0.attn.indexer.weights_proj.weight"}
    rep = C.load_problems(d, missing)
    assert any("weights_proj" in p for p in rep["target"]), rep
    misshapen = dict(sd)
    misshapen["mtp.1.attn.wo_a.weight"] = sd["mtp.1.attn.wo_a.weight"].reshape(-1, 128)
    with pytest.raises((AssertionError, RuntimeError, ValueError)):
        C.load_problems(d, misshapen)
    real = C.vllm_layer_params

    def swapped(sd_, src, dst):  # what the export would mean if wkv came before wq_a
        out = real(sd_, src, dst)
        out[dst + "attn.fused_wqa_wkv.weight"] = torch.cat(
            [sd_[src + "attn.wkv.weight"], sd_[src + "attn.wq_a.weight"]]
        )
        return out

    monkeypatch.setattr(C, "vllm_layer_params", swapped)
    rep = C.load_problems(d, sd)
    assert any("fused_wqa_wkv.weight: loaded values differ" in p for p in rep["target"]), rep
    assert any("fused_wqa_wkv.weight: loaded values differ" in p for p in rep["drafter"]), rep


def _moe_pair(cfgv, layer_idx: int, seed: int):
    """vLLM's DeepseekV4MoE and ours for one layer, same weights."""
    import vllm.models.deepseek_v4.nvidia.model as dsv4
    from support import dsv4_moe_layer as L
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    cfg = M.DSV4Config.from_dict(L.layer_config_fields(L.NUM_EXPERTS))
    layer = M.DecoderLayer(cfg, layer_idx)
    mine = layer.ffn
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(mine.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 3))
        if mine.is_hash:
            e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
            mine.tid2eid.copy_(
                torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(cfg.vocab_size)])
            )
    hf = cfgv.model_config.hf_config
    cfgv.compilation_config.static_forward_context = {}
    with set_current_vllm_config(cfgv), torch.device("cpu"):
        theirs = dsv4.DeepseekV4MoE(
            cfgv,
            prefix=f"model.layers.{layer_idx}.ffn",
            num_hash_layers=hf.mlp_layer_types.count("hash_moe"),
        )
    # our export path: checkpoint names, then the vLLM parameter values they mean
    params = C.vllm_layer_params(M._layer_state(layer, ""), "", "")
    want = {k.removeprefix("ffn."): v for k, v in params.items() if k.startswith("ffn.")}
    have = dict(theirs.named_parameters())
    assert set(have) == set(want), set(have) ^ set(want)
    with torch.no_grad():
        for k, v in want.items():
            have[k].copy_(v.to(have[k].dtype))
    with set_current_vllm_config(cfgv):
        process_weights_after_loading(theirs, cfgv.model_config, torch.device("cpu"))
    return cfg, mine, theirs


@pytest.fixture(scope="module")
def moe_config(tmp_path_factory):
    from support import dsv4_moe_layer as L

    cfgv = L.vllm_config(L.NUM_EXPERTS, str(tmp_path_factory.mktemp("dsv4-moe")))
    L.init_one_rank_world(cfgv, torch.device("cpu"))
    return cfgv


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["hash", "biased"])
def test_moe_matches_vllm_deepseek_v4_moe(moe_config, layer_idx):
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    cfg, mine, theirs = _moe_pair(moe_config, layer_idx, seed=layer_idx)
    assert mine.is_hash == (layer_idx == 0) == (theirs.gate.tid2eid is not None)
    g = torch.Generator().manual_seed(10 + layer_idx)
    x = torch.randn(9, cfg.hidden_size, generator=g)
    ids = torch.randint(4, cfg.vocab_size, (9,), generator=g)
    with (
        set_current_vllm_config(moe_config),
        set_forward_context(None, moe_config, num_tokens=9),
        torch.no_grad(),
    ):
        got = theirs(x, ids)
    assert type(theirs.experts.router).__name__ == "CPURouter"
    with torch.no_grad():
        ref = mine(x, ids)
        torch.testing.assert_close(ref, got, rtol=1e-5, atol=1e-5)
        # controls: the comparison sees the routed scale and, on the hash layer, the table
        cfg.routed_scaling_factor = 1.0
        assert not torch.allclose(mine(x, ids), got, rtol=1e-3, atol=1e-3)
        cfg.routed_scaling_factor = 1.5
        if mine.is_hash:
            mine.tid2eid.copy_(mine.tid2eid.roll(1, dims=0))
            assert not torch.allclose(mine(x, ids), got, rtol=1e-3, atol=1e-3)


def test_training_geometry_fills_every_vllm_parameter(tmp_path):
    """The training geometry (``dsv4_fields(train=True)``: 8 query heads in one ``wo_a`` group,
    q-LoRA 32) loads into the same CUDA classes with every parameter filled; FlashMLA allocates
    the sink at 64 heads, so its 56 padding slots must hold -inf and the 8 real ones ours."""
    from pathlib import Path

    from safetensors.torch import save_file

    from dspark_dev import tiny_mla_targets as t

    pair = t.make_tiny_dsv4_pair(tmp_path, gpu=True, train=True)
    cfg = M.DSV4Config.from_dict(t.dsv4_fields(gpu=True, train=True))
    assert (cfg.num_attention_heads, cfg.o_groups, cfg.q_lora_rank) == (8, 1, 32)
    target, draft = M.TinyDSV4(cfg), M.TinyDSV4Draft(cfg)
    M.init_pair(target, draft, seed=0)
    sd = M.vllm_checkpoint(target, draft)
    save_file(sd, str(Path(pair.target) / "model.safetensors"), metadata={"format": "pt"})
    keep: dict = {}
    assert C.load_problems(Path(pair.target), sd, keep) == {"target": [], "drafter": []}
    for model, src in ((keep["target"], "layers.0."), (keep["drafter"], "mtp.1.")):
        attn = dict(model.named_modules())[f"model.layers.{src.split('.')[1]}.attn"]
        assert (attn.n_local_heads, attn.padded_heads, attn.n_local_groups) == (8, 64, 1)
        assert torch.equal(attn.attn_sink[:8], sd[src + "attn.attn_sink"].float())
        assert torch.isneginf(attn.attn_sink[8:]).all()
