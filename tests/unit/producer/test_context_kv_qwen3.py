"""The Qwen3 context-KV-only drafter, built in process on CPU next to vLLM's full drafter."""

from __future__ import annotations

import pytest
import torch
from support.vllm_configs import build_model
from vllm.config import KVTransferConfig

from vllm_dspark_pp.producer import drafter, memory, qwen3

CONTEXT_PARAMS = [
    "model.fc.weight",
    "model.hidden_norm.weight",
    "model.layers.0.self_attn.k_norm.weight",
    "model.layers.0.self_attn.qkv_proj.weight",
]


@pytest.fixture(scope="module")
def producer_cfg(make_vllm_config, dist_env):
    return make_vllm_config(
        KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_producer")
    )


@pytest.fixture(scope="module")
def pair(producer_cfg):
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    full, full_cfg = build_model(producer_cfg, Qwen3DSparkForCausalLM)
    ctx, ctx_cfg = build_model(producer_cfg, qwen3.Qwen3DSparkContextKVForCausalLM)
    return full, full_cfg, ctx, ctx_cfg


@pytest.fixture(scope="module")
def checkpoint(tiny_pair):
    from safetensors.torch import load_file

    return load_file(f"{tiny_pair.draft}/model.safetensors")


def test_context_only_module_tree(pair):
    full, _, ctx, _ = pair
    assert sorted(n for n, _ in ctx.named_parameters()) == CONTEXT_PARAMS
    full_names = {n for n, _ in full.named_parameters()}
    assert set(CONTEXT_PARAMS) <= full_names
    modules = {n for n, _ in ctx.named_modules()}
    for absent in (
        "lm_head",
        "model.embed_tokens",
        "model.markov_head",
        "model.confidence_head",
        "model.norm",
        "model.layers.0.mlp",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
    ):
        assert absent not in modules
    attn = ctx.model.layers[0].self_attn
    full_attn = full.model.layers[0].self_attn
    assert attn.q_size == 0
    assert attn.qkv_proj.weight.shape == (2 * full_attn.kv_size, full_attn.hidden_size)
    assert not list(attn.q_norm.parameters())
    assert drafter.is_context_kv_only(ctx) and not drafter.is_context_kv_only(full)


def test_kv_cache_layer_names_and_specs_equal(pair):
    full, full_cfg, ctx, ctx_cfg = pair
    names = full.get_draft_kv_cache_layer_names()
    assert names == ctx.get_draft_kv_cache_layer_names() == ["model.layers.6.self_attn.attn"]
    assert full.get_draft_attn_causal() == ctx.get_draft_attn_causal()
    f_layers = full_cfg.compilation_config.static_forward_context
    c_layers = ctx_cfg.compilation_config.static_forward_context
    assert sorted(f_layers) == sorted(c_layers) == names
    for n in names:
        f_spec = f_layers[n].get_kv_cache_spec(full_cfg)
        c_spec = c_layers[n].get_kv_cache_spec(ctx_cfg)
        assert f_spec == c_spec
        assert type(f_layers[n].impl) is type(c_layers[n].impl)
        assert f_layers[n].attn_backend is c_layers[n].attn_backend


def test_skipped_weight_names(checkpoint):
    skipped = set(qwen3.skipped_weight_names(checkpoint))
    assert skipped == {
        "embed_tokens.weight",
        "lm_head.weight",
        "norm.weight",
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
        "confidence_head.proj.bias",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.o_proj.weight",
        "layers.0.self_attn.q_norm.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.post_attention_layernorm.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.0.mlp.up_proj.weight",
        "layers.0.mlp.down_proj.weight",
    }
    kept = set(checkpoint) - skipped
    assert kept == {
        "fc.weight",
        "hidden_norm.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.0.self_attn.v_proj.weight",
        "layers.0.self_attn.k_norm.weight",
    }


def _loaded(model, checkpoint, cfg):
    """Load and post-process as vLLM's loader does (quant methods, then the model hook)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    loaded = model.load_weights(iter(checkpoint.items()))
    with set_current_vllm_config(cfg):
        process_weights_after_loading(
            model, cfg.speculative_config.draft_model_config, torch.device("cpu")
        )
    return loaded


def test_loads_only_kv_rows_and_they_match_the_full_drafter(producer_cfg, checkpoint):
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    full, _ = build_model(producer_cfg, Qwen3DSparkForCausalLM)
    ctx, _ = build_model(producer_cfg, qwen3.Qwen3DSparkContextKVForCausalLM)
    # Compared before post-processing: on CPU it repacks linear weights out of `.weight`.
    loaded = ctx.load_weights(iter(checkpoint.items()))
    assert sorted(loaded) == CONTEXT_PARAMS
    full.load_weights(iter(checkpoint.items()))
    fa, ca = full.model.layers[0].self_attn, ctx.model.layers[0].self_attn
    assert torch.equal(ca.qkv_proj.weight, fa.qkv_proj.weight[fa.q_size :])
    assert torch.equal(ca.k_norm.weight, fa.k_norm.weight)
    assert torch.equal(ctx.model.fc.weight, full.model.fc.weight)
    assert torch.equal(ctx.model.hidden_norm.weight, full.model.hidden_norm.weight)
    kv = checkpoint["layers.0.self_attn.k_proj.weight"]
    assert torch.equal(ca.qkv_proj.weight[: kv.shape[0]], kv)


def test_context_kv_computation_equals_full_drafter(producer_cfg, checkpoint):
    """The K (normed, rotated) and V the context path computes, both drafters, same inputs."""
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    full, fcfg = build_model(producer_cfg, Qwen3DSparkForCausalLM)
    ctx, ccfg = build_model(producer_cfg, qwen3.Qwen3DSparkContextKVForCausalLM)
    _loaded(ctx, checkpoint, ccfg)
    _loaded(full, checkpoint, fcfg)

    g = torch.Generator().manual_seed(0)
    n_tok, aux = 13, full.model.fc.input_size
    aux_states = torch.randn(n_tok, aux, generator=g)
    positions = torch.arange(3, 3 + n_tok)

    fk, fv = _context_kv(full, fcfg, aux_states, positions)
    ck, cv = _context_kv(ctx, ccfg, aux_states, positions)
    assert fk.abs().sum() > 0 and fv.abs().sum() > 0
    torch.testing.assert_close(ck, fk, rtol=0, atol=0)
    torch.testing.assert_close(cv, fv, rtol=0, atol=0)


@pytest.mark.parametrize(
    "call",
    [
        "forward",
        "compute_logits",
        "compute_draft_logits",
        "markov_embed",
        "markov_bias",
        "compute_confidence",
        "embed_input_ids",
        "map_draft_to_target",
    ],
)
def test_drafting_raises_clearly(pair, call):
    ctx = pair[2]
    with pytest.raises(drafter.ContextOnlyDrafterError, match="prefill-only KV producer"):
        getattr(ctx, call)(torch.zeros(1, dtype=torch.long))


def test_backbone_forward_raises(pair):
    ctx = pair[2]
    with pytest.raises(drafter.ContextOnlyDrafterError, match="cannot draft tokens"):
        ctx.model(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))


def test_draft_param_bytes_matches_the_built_modules(pair, tiny_pair):
    import json

    full, _, ctx, _ = pair
    hf = json.load(open(f"{tiny_pair.draft}/config.json"))
    sizes = memory.draft_param_bytes(hf, "kv_producer", dtype_bytes=4)
    # The analytic count includes the draft-owned embedding and LM head; the built full model
    # allocates both (they are replaced by the target's when vLLM shares them).
    full_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    ctx_bytes = sum(p.numel() * p.element_size() for p in ctx.parameters())
    assert sizes["context_only_bytes"] == ctx_bytes
    assert sizes["full_bytes"] == full_bytes
    assert sizes["builds"] == "context_only" and sizes["built_bytes"] == ctx_bytes
    both = memory.draft_param_bytes(hf, "kv_both", dtype_bytes=4)
    assert both["builds"] == "full"


# --------------------------------------------------------------------------- one K/V copy
# On a GPU the unquantized projections keep their raw ``.weight`` after loading, so vLLM's
# ``_build_fused_kv_buffers`` concatenates every layer's K/V rows into ``_fused_kv_weight`` (a
# copy) and the context path runs one GEMM over it. vLLM's CPU platform repacks the weights
# instead and builds no fused buffer; ``_gpu_weight_layout`` gives the CPU the GPU's layout:
# vLLM's own plain-``F.linear`` CPU fallback (``_cpu_skip_gemm_dispatch``) and the GPU's answer
# to ``_reads_raw_weights`` for unquantized weights.
@pytest.fixture
def gpu_weight_layout(monkeypatch):
    import importlib

    qd = importlib.import_module(qwen3.QWEN3_DRAFTER_MODULE)
    monkeypatch.setattr(qd, "_reads_raw_weights", lambda projs: True)

    def load(model, checkpoint, cfg):
        from vllm.model_executor.layers.linear import LinearBase

        for m in model.modules():
            if isinstance(m, LinearBase):
                m._cpu_skip_gemm_dispatch = True
        return _loaded(model, checkpoint, cfg)

    return load


def _context_kv(model, cfg, aux_states, positions):
    """The K (normed, rotated) and V of vLLM's context path (the code both drafters run)."""
    from vllm.config import set_current_vllm_config

    m, n_tok = model.model, aux_states.shape[0]
    with set_current_vllm_config(cfg):
        states = model.combine_hidden_states(aux_states)
        k, v = m._project_context_kv(
            states, n_tok, m._num_attn_layers, m._num_kv_heads, m._head_dim
        )
        k = m._normalize_context_k(k)
        m._apply_context_rope(k, positions)
    return k, v


def _storages(tensors):
    return {t.untyped_storage().data_ptr() for t in tensors}


@pytest.mark.parametrize("keep_copy", [False, True], ids=["as-built", "control-copy-kept"])
def test_context_only_drafter_holds_one_kv_copy(
    producer_cfg, checkpoint, tiny_pair, gpu_weight_layout, monkeypatch, keep_copy
):
    """The built drafter's weight storages add up to the family's ``draft_memory`` rule for
    the context-only role, which has no fused K/V copy; the control keeps vLLM's copy (the
    drafter before the fix) and must hold exactly ``fused_kv_copy`` more."""
    import json

    cls = qwen3.Qwen3DSparkContextKVForCausalLM
    if keep_copy:
        monkeypatch.setattr(cls.model_cls, "keep_one_kv_copy", lambda self: None)
    ctx, ccfg = build_model(producer_cfg, cls)
    gpu_weight_layout(ctx, checkpoint, ccfg)
    m = ctx.model
    assert m._fused_kv_weight is not None  # the GPU path: vLLM built its fused buffer

    hf = json.load(open(f"{tiny_pair.draft}/config.json"))
    rule = memory.draft_load_bytes(hf, 4, own_embed=True, own_head=True)
    assert rule["fused_kv_copy"] > 0
    held = drafter.held_weight_bytes(ctx)
    expected = rule["context_only"] + (rule["fused_kv_copy"] if keep_copy else 0)
    assert held == expected, (held, rule)
    # and what holds it: the per-layer parameters are views of vLLM's derived buffers
    attn = m.layers[0].self_attn
    shared = _storages([attn.qkv_proj.weight]) == _storages([m._fused_kv_weight])
    shared &= _storages([attn.k_norm.weight]) == _storages([m._k_norm_weights])
    assert shared != keep_copy


def test_context_kv_with_the_gpu_layout_equals_full_drafter_and_reads_the_parameters(
    producer_cfg, checkpoint, gpu_weight_layout
):
    """With the GPU's fused path (one GEMM over ``_fused_kv_weight``) the context KV is the
    full drafter's, bit for bit, after the first load and after a weight reload (which writes
    through the per-layer views); a change to a layer's K/V parameter reaches the context KV
    (with a kept copy it would not: the path would read the stale copy)."""
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    full, fcfg = build_model(producer_cfg, Qwen3DSparkForCausalLM)
    ctx, ccfg = build_model(producer_cfg, qwen3.Qwen3DSparkContextKVForCausalLM)
    gpu_weight_layout(ctx, checkpoint, ccfg)
    gpu_weight_layout(full, checkpoint, fcfg)

    g = torch.Generator().manual_seed(1)
    aux_states = torch.randn(11, full.model.fc.input_size, generator=g)
    positions = torch.arange(5, 16)

    def equal_to_full(ck, cv):
        fk, fv = _context_kv(full, fcfg, aux_states, positions)
        assert fk.abs().sum() > 0 and fv.abs().sum() > 0
        return torch.equal(ck, fk) and torch.equal(cv, fv)

    assert equal_to_full(*_context_kv(ctx, ccfg, aux_states, positions))

    # a reload of other weights (both drafters), through vLLM's loader and post-processing
    reloaded = {
        n: (t * 1.5 if ".self_attn." in n or n.startswith("fc.") else t)
        for n, t in checkpoint.items()
    }
    gpu_weight_layout(ctx, reloaded, ccfg)
    gpu_weight_layout(full, reloaded, fcfg)
    ck, cv = _context_kv(ctx, ccfg, aux_states, positions)
    assert equal_to_full(ck, cv)

    # the context path reads the parameters themselves: perturb one V row of the layer
    attn = ctx.model.layers[0].self_attn
    with torch.no_grad():
        attn.qkv_proj.weight[attn.kv_size] += 1.0
    ck2, cv2 = _context_kv(ctx, ccfg, aux_states, positions)
    assert torch.equal(ck2, ck) and not torch.equal(cv2, cv)
    assert not equal_to_full(ck2, cv2)


def test_hold_as_views_shares_storage_and_refuses_another_layout():
    def params():
        return [
            torch.nn.Parameter(torch.arange(6.0).view(2, 3), requires_grad=False),
            torch.nn.Parameter(torch.arange(6.0, 9.0), requires_grad=False),
        ]

    stacked = torch.cat([p.data.reshape(-1) for p in params()])
    last_differs = stacked.clone()
    last_differs[-1] += 1
    for wrong in (stacked.flip(0), stacked[:-1], last_differs):  # order; size; contents
        ps, buf = params(), wrong.clone()
        with pytest.raises(RuntimeError, match="0.34.0"):
            drafter.hold_as_views(buf, ps)
        assert not _storages(ps) & _storages([buf])  # all or nothing: none became a view
    ps = params()
    drafter.hold_as_views(stacked, ps)
    assert _storages(ps) == _storages([stacked])
    assert ps[0].shape == (2, 3) and torch.equal(ps[1], torch.arange(6.0, 9.0))
    stacked[-1] = 42.0  # a write to the buffer is a write to the parameter, and back
    ps[0].data[0, 0] = -1.0
    assert ps[1][-1] == 42.0 and stacked[0] == -1.0
