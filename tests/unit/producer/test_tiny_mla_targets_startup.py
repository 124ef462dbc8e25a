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
"""

from __future__ import annotations

import json

import pytest
import torch

from vllm_dspark_pp.dev import tiny_mla_targets as t


def _engine_config(pair, **kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=pair.target,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=8,
        enforce_eager=True,
        **kw,
    ).create_engine_config()


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


def _build_on_cpu(cfg, cls, monkeypatch, *, cuda_router=False):
    """Construct a DeepSeek-V4 model class of vLLM's CUDA implementation on CPU (a fresh layer
    registry). ``cuda_router``: vLLM's MoE router factory answers as on a CUDA platform (its only
    platform question is ``is_cpu``, which on CPU picks the all-schemes CPURouter)."""
    import vllm.model_executor.layers.fused_moe.router.router_factory as router_factory
    import vllm.models.deepseek_v4.nvidia.flashmla as flashmla
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    cfg.compilation_config.static_forward_context = {}
    with monkeypatch.context() as m, set_current_vllm_config(cfg), torch.device("cpu"):
        if parallel_state._EP is None:  # dist_env's world was set up for a dense model
            m.setattr(parallel_state, "_EP", parallel_state.get_tp_group())  # one rank: same
        # Construction only: an aux stream and events (used to overlap work at run time) and the
        # fp8 einsum recipe (reads the CUDA capability) are the constructor's CUDA calls.
        m.setattr(torch.cuda, "Stream", lambda *a, **k: None)
        m.setattr(torch.cuda, "Event", lambda *a, **k: None)
        m.setattr(flashmla, "compute_fp8_einsum_recipe", lambda: (None, False))
        if cuda_router:
            m.setattr(router_factory, "current_platform", _NotCpu(router_factory.current_platform))
        return cls(vllm_config=cfg, prefix="")


class _NotCpu:
    """The platform with ``is_cpu()`` answering False; every other answer is the real one's."""

    def __init__(self, real):
        self._real = real

    def is_cpu(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._real, name)


def _dsv4_groups(pair, monkeypatch):
    """(resolved layout name, {layer: block size after planning}) for the DSV4 target."""
    import vllm.models.deepseek_v4.nvidia.model as dsv4
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups

    # The GPU run's cache dtype: DeepSeek-V4's CUDA attention picks fp8_ds_mla by itself there.
    cfg = _engine_config(pair, kv_cache_dtype="fp8_ds_mla")
    assert cfg.cache_config.block_size == 256
    _build_on_cpu(cfg, dsv4.DeepseekV4ForCausalLM, monkeypatch)
    ctx = cfg.compilation_config.static_forward_context
    with set_current_vllm_config(cfg):
        specs = {
            n: s
            for n, layer in ctx.items()
            if hasattr(layer, "get_kv_cache_spec")
            and (s := layer.get_kv_cache_spec(cfg)) is not None
        }
    backends = {ctx[n].get_attn_backend() for n in specs}
    supported = [x.name for x in get_supported_kv_cache_layouts(backends)]
    layout = resolve_kv_cache_layout(cfg, [supported], specs.values())
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


def test_dsv4_state_caches_keep_their_blocks(tmp_path, plugin, dist_env, monkeypatch):
    pair = t.make_tiny_dsv4_pair(tmp_path, gpu=True)
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
        model = _build_on_cpu(cfg, cls, monkeypatch, cuda_router=True)
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
