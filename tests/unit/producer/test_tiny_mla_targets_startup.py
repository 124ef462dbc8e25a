"""The tiny Kimi-K3 / DeepSeek-V4 GPU targets pass the two start-up checks that stopped every
engine of the first H200 run of tests/gpu/test_dsv4_k3_engine.py (2026-12-03, issue 16).

1. vLLM's DSpark speculator resolves the noise (mask) token of the draft config
   (``v1/worker/gpu/spec_decode/utils.get_parallel_drafting_token_id``, called from the DFlash
   speculator's ``__init__``); the tiny drafts had none ("Model config must specify ...").
2. DeepSeek-V4's compressor state caches keep their 4 / 8-token blocks through vLLM's KV-cache
   planning: the target is constructed on CPU (vLLM's CUDA model class, its two CUDA-only
   constructor calls stood in for), the KV-cache layout is resolved from its layers' backends as
   the engine core does (``resolve_kv_cache_layout``), and vLLM's planner groups the specs. With
   the old tiny config (ratio-128 layers only) the layout is LBNHC, the page sizes do not unify and
   the fallback gives the C128 state cache the 256-token block, the block the CuTe DSL compressor
   refused on the H200 ("requires state-cache block_size=8, got 256");
   ``test_old_dsv4_config_reproduces_the_state_block_256`` keeps that failure visible.
3. (the second H200 run) Every MoE layer of the DeepSeek-V4 target and of its DSpark draft gets a
   CUDA router that scores sqrt-softplus: the models are built with vLLM's router factory
   answering as on CUDA. The old config (no ``topk_method: noaux_tc``) gave the draft's layers
   FusedTopKRouter ("Unsupported scoring function: sqrtsoftplus");
   ``test_old_dsv4_config_reproduces_unsupported_sqrtsoftplus`` keeps that failure visible.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.mla_cpu_config import k3_engine_config

from dspark_dev import tiny_mla_targets as t
from dspark_dev.tiny_dsv4_cpu import (
    build_dsv4_target,
    construct_on_cpu,
    engine_config,
    resolve_layout,
)


def _engine_config(pair, **kw):
    if pair.family == "kimi-k3":  # the same on every CPU (support/mla_cpu_config.py, issue 24)
        return k3_engine_config(pair, **kw)
    return engine_config(pair, **kw)


@pytest.mark.parametrize("fam", ["k3", "dsv4"])
def test_draft_config_names_the_noise_token(fam, tmp_path):
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    make = t.make_tiny_k3_pair if fam == "k3" else t.make_tiny_dsv4_pair
    pair = make(tmp_path, gpu=True)
    cfg = _engine_config(pair, speculative_config=pair.speculative_config(4))
    draft = cfg.speculative_config.draft_model_config
    assert draft.architectures == (["K3DSparkModel"] if fam == "k3" else ["DSparkDraftModel"])
    assert get_parallel_drafting_token_id(draft.hf_config) == t.NOISE_TOKEN_ID
    vocab = json.loads(
        (tmp_path / ("k3-target" if fam == "k3" else "dsv4") / "tokenizer.json").read_text()
    )["model"]["vocab"]
    assert vocab["<|mask|>"] == t.NOISE_TOKEN_ID


def _dsv4_groups(pair, monkeypatch):
    """(resolved layout name, {layer: block size after planning}) for the DSV4 target."""
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups

    # The GPU run's cache dtype: DeepSeek-V4's CUDA attention picks fp8_ds_mla by itself there.
    cfg = _engine_config(pair, kv_cache_dtype="fp8_ds_mla")
    assert cfg.cache_config.block_size == 256
    specs = build_dsv4_target(cfg, monkeypatch)
    layout = resolve_layout(cfg, specs)
    groups = get_kv_cache_groups(cfg, dict(specs))
    blocks = {}
    for g in groups:
        inner = getattr(g.kv_cache_spec, "kv_cache_specs", None) or {
            n: g.kv_cache_spec for n in g.layer_names
        }
        blocks.update({n: s.block_size for n, s in inner.items()})
    return layout, blocks


def _state_blocks(blocks):
    return {n: b for n, b in blocks.items() if n.endswith("compressor.state_cache")}


@pytest.mark.parametrize("train", [False, True], ids=["gpu-geometry", "train-geometry"])
def test_dsv4_state_caches_keep_their_blocks(train, tmp_path, plugin, dist_env, monkeypatch):
    """Also for the training geometry (``dsv4_fields(train=True)``: 8 query heads, one output
    group, q-LoRA 32), whose trained pair must plan the same way on the H200."""
    pair = t.make_tiny_dsv4_pair(tmp_path, gpu=True, train=train)
    layout, blocks = _dsv4_groups(pair, monkeypatch)
    assert layout.is_block_outermost, layout
    states = _state_blocks(blocks)
    # layer 0: ratio 4 (its compressor and the indexer's); layer 1: ratio 128 (CuTe C128: 8)
    assert states == {
        "model.layers.0.attn.compressor.state_cache": 4,
        "model.layers.0.attn.indexer.compressor.state_cache": 4,
        "model.layers.1.attn.compressor.state_cache": 8,
    }, states


def test_old_dsv4_config_reproduces_the_state_block_256(tmp_path, plugin, dist_env, monkeypatch):
    pair = t.make_tiny_dsv4_pair(tmp_path, gpu=True)
    path = tmp_path / "dsv4" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["layer_types"] = ["heavily_compressed_attention"] * 2  # the first run's tiny config
    path.write_text(json.dumps(cfg))
    layout, blocks = _dsv4_groups(pair, monkeypatch)
    assert layout.name == "LBNHC"
    assert set(_state_blocks(blocks).values()) == {256}, blocks


# --------------------------------------------------------------------------- MoE routers
def _cuda_moe_layers(pair, monkeypatch):
    """{"<model class>:<layer prefix>": DeepseekV4MoE} of the DeepSeek-V4 target and its DSpark
    draft, each built with the router vLLM's factory picks on CUDA."""
    from vllm.models.deepseek_v4.nvidia.dspark import DSparkDeepseekV4ForCausalLM
    from vllm.models.deepseek_v4.nvidia.model import DeepseekV4ForCausalLM, DeepseekV4MoE

    cfg = _engine_config(
        pair, kv_cache_dtype="fp8_ds_mla", speculative_config=pair.speculative_config(4)
    )
    layers = {}
    for cls in (DeepseekV4ForCausalLM, DSparkDeepseekV4ForCausalLM):
        model = construct_on_cpu(cfg, cls, monkeypatch, cuda_router=True)
        for mod in model.modules():
            if isinstance(mod, DeepseekV4MoE):  # its prefix: the layer index vLLM routes by
                layers[f"{cls.__name__}:{mod.prefix}"] = mod
    return layers


def _routing(moe):
    """(router class, has a correction bias, has a hash table)."""
    return (
        type(moe.experts.router).__name__,
        moe.gate.e_score_correction_bias is not None,
        moe.gate.tid2eid is not None,
    )


def test_dsv4_every_moe_layer_gets_a_cuda_router_with_sqrtsoftplus(
    tmp_path, plugin, dist_env, monkeypatch
):
    """The GPU tiny target's layer 0 is hash-routed, its layer 1 and the draft's two stages are
    biased (noaux_tc): on CUDA all four get FusedTopKBiasRouter, which scores sqrt-softplus.
    With the first GPU config the draft's stages got FusedTopKRouter (see the next test)."""
    pair = t.make_tiny_dsv4_pair(tmp_path, gpu=True)
    layers = _cuda_moe_layers(pair, monkeypatch)
    routing = {name: _routing(moe) for name, moe in layers.items()}
    assert routing == {
        "DeepseekV4ForCausalLM:model.layers.0.ffn": ("FusedTopKBiasRouter", False, True),
        "DeepseekV4ForCausalLM:model.layers.1.ffn": ("FusedTopKBiasRouter", True, False),
        "DSparkDeepseekV4ForCausalLM:model.layers.2.ffn": ("FusedTopKBiasRouter", True, False),
        "DSparkDeepseekV4ForCausalLM:model.layers.3.ffn": ("FusedTopKBiasRouter", True, False),
    }, routing
    assert {moe.experts.router.scoring_func for moe in layers.values()} == {"sqrtsoftplus"}


def test_old_dsv4_config_reproduces_unsupported_sqrtsoftplus(
    tmp_path, plugin, dist_env, monkeypatch
):
    """The config of the 2026-12-03 H200 run (no topk_method; both target layers hash-routed by
    the config class's default): the draft's stages get no bias, the CUDA factory falls back to
    FusedTopKRouter, and the draft's router raises the run's error (before any kernel is called,
    so on CPU too)."""
    pair = t.make_tiny_dsv4_pair(tmp_path, gpu=True)
    path = tmp_path / "dsv4" / "config.json"
    cfg = json.loads(path.read_text())
    for key in ("topk_method", "mlp_layer_types"):
        del cfg[key]
    path.write_text(json.dumps(cfg))
    layers = _cuda_moe_layers(pair, monkeypatch)
    draft = {n: moe for n, moe in layers.items() if n.startswith("DSpark")}
    assert len(draft) == 2
    assert {_routing(moe) for moe in draft.values()} == {("FusedTopKRouter", False, False)}
    router = next(iter(draft.values())).experts.router
    n_experts = router.global_num_experts
    with pytest.raises(ValueError, match="Unsupported scoring function: sqrtsoftplus"):
        router._compute_routing(torch.zeros(3, 8), torch.zeros(3, n_experts), None)


@pytest.mark.parametrize("fam", ["k3", "dsv4"])
def test_pd_control_draft_is_nan_only_in_the_draft(fam, tmp_path):
    """The GPU PD control (tests/gpu/test_dsv4_k3_engine.py) hands the prefiller a copy of the
    draft with ``rms_norm_eps = -1e30``. vLLM must read that copy as the same draft architecture
    with that eps, and leave the target's eps alone (for DeepSeek-V4 the copy is the whole target
    directory, used only as the draft)."""
    from support.draft_controls import NAN_NORM_EPS, nan_norm_draft

    make = t.make_tiny_k3_pair if fam == "k3" else t.make_tiny_dsv4_pair
    pair = make(tmp_path, gpu=True)
    good = _engine_config(pair, speculative_config=pair.speculative_config(4))
    bad_dir = nan_norm_draft(pair.draft, str(tmp_path / "control"))
    bad = _engine_config(pair, speculative_config={**pair.speculative_config(4), "model": bad_dir})
    g, b = good.speculative_config.draft_model_config, bad.speculative_config.draft_model_config
    assert b.architectures == g.architectures
    assert b.hf_config.rms_norm_eps == NAN_NORM_EPS and g.hf_config.rms_norm_eps == 1e-6
    assert bad.model_config.hf_config.rms_norm_eps == 1e-6
    assert good.model_config.hf_config.rms_norm_eps == 1e-6


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("fam", ["k3", "dsv4"])
def test_aux_taps_resolve_to_the_drafts_target_layers(fam, pp, tmp_path):
    """What a -pp N DeepSeek-V4 / Kimi-K3 DSpark deployment relies on in vLLM 0.34.0 (issue 16):
    the target layers whose outputs feed the draft come from the draft config through vLLM's
    EAGLE-3 fallback chain (``eagle3_utils.get_eagle3_aux_layers_from_config``: Kimi-K3 via
    ``target_layer_ids``, DeepSeek-V4 via ``dspark_target_layer_ids``, both with the +1 of
    "output of layer i" semantics), every tap names a real target layer, and both CUDA target
    models declare that their aux hidden states cross pipeline stages (otherwise vLLM refuses
    such methods under PP: ``verify_supports_aux_hidden_states_over_pp``)."""
    from vllm.models.deepseek_v4.nvidia.model import DeepseekV4Model
    from vllm.models.kimi_k3.nvidia.model import KimiLinearModel
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    make = t.make_tiny_k3_pair if fam == "k3" else t.make_tiny_dsv4_pair
    pair = make(tmp_path, gpu=True)
    cfg = _engine_config(
        pair, speculative_config=pair.speculative_config(4), pipeline_parallel_size=pp
    )
    assert cfg.parallel_config.pipeline_parallel_size == pp
    draft = json.loads(
        (tmp_path / ("k3-dspark" if fam == "k3" else "dsv4") / "config.json").read_text()
    )
    ids = draft["target_layer_ids"] if fam == "k3" else draft["dspark_target_layer_ids"]
    taps = get_eagle3_aux_layers_from_config(cfg.speculative_config)
    assert taps == tuple(i + 1 for i in ids)
    n = cfg.model_config.hf_config.num_hidden_layers
    assert all(1 <= tap <= n for tap in taps), (taps, n)
    inner = KimiLinearModel if fam == "k3" else DeepseekV4Model
    assert inner.supports_aux_hidden_states_over_pp is True
