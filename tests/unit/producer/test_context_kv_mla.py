"""Context-KV-only DeepSeek-V4 and Kimi-K3 DSpark drafters, in process on CPU.

Kimi-K3: vLLM 0.34.0's full drafter constructs on CPU (its MLA layer picks the CPU MLA backend),
so the full and context-only trees, KV-cache layer names and specs, and the loaded weights are
compared directly. DeepSeek-V4: vLLM's full drafter does not construct on CPU (its attention
creates ``torch.cuda.Event``s and asserts a CUDA device for the FP8 einsum recipe); the
context-only drafter does, so its tree, layer names and specs are checked against the values
vLLM's code gives, and the full-vs-context equality runs in tests/gpu/test_context_kv_mla_gpu.py.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from vllm.config import KVTransferConfig

from dspark_dev import tiny_mla_drafts as tiny
from vllm_dspark_pp.producer import deepseek_v4, drafter, families, kimi_k3, qwen3


@pytest.fixture(scope="module")
def producer_cfg(make_vllm_config, dist_env):
    return make_vllm_config(
        KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_producer")
    )


def _repack_linears(model):
    """The linear layers' post-load step (on CPU: the repack their forward needs)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)


def _build(cfg, cls):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cfg), torch.device("cpu"):
        return cls(vllm_config=cfg, prefix="")


# --------------------------------------------------------------------------- routing
def _spec(*archs):
    return types.SimpleNamespace(
        draft_model_config=types.SimpleNamespace(architectures=list(archs))
    )


def test_architecture_routing():
    route = families.context_kv_class_for
    assert route(_spec("Qwen3DSparkModel")) is qwen3.Qwen3DSparkContextKVForCausalLM
    assert route(_spec("K3DSparkModel")) is kimi_k3.K3DSparkContextKVForCausalLM
    assert route(_spec("K3DSparkModel")).__name__ == ("K3DSparkContextKVForCausalLM")


def test_dsv4_routing_on_cpu_names_the_missing_cuda_drafter():
    # On the CPU platform vLLM's registry resolves DeepSeek-V4 DSpark to a stub
    # (deepseek_v4/cpu/dspark.py); the context-only build says so instead of guessing.
    with pytest.raises(NotImplementedError, match="CUDA implementation.*kv_both"):
        families.context_kv_class_for(_spec("DSparkDraftModel"))


# --------------------------------------------------------------------------- weight filters
def test_dsv4_weight_filter_over_checkpoint_names():
    names = tiny.dsv4_checkpoint_shapes(tiny.tiny_dsv4_config())
    kept = set(names) - set(deepseek_v4.dsv4_skipped_weight_names(names))
    assert kept == tiny.DSV4_CONTEXT_NAMES
    # block-fp8 checkpoints ship a scale next to each linear weight: wkv's is kept
    assert deepseek_v4.is_dsv4_context_kv_weight("mtp.1.attn.wkv.scale")
    assert not deepseek_v4.is_dsv4_context_kv_weight("mtp.1.attn.wq_a.scale")
    assert deepseek_v4.is_dsv4_context_kv_weight("context_wkv_proj.weight")
    for draft_only in (
        "mtp.0.attn.wq_b.weight",
        "mtp.0.attn.wo_a.weight",
        "mtp.0.attn.attn_sink",
        "mtp.0.ffn.experts.3.w2.weight",
        "mtp.1.markov_head.markov_w1.weight",
        "mtp.1.confidence_head.proj.bias",
        "mtp.1.hc_head_fn",
        "mtp.0.hc_attn_fn",
        "embed.weight",
        "layers.0.attn.wkv.weight",
    ):
        assert not deepseek_v4.is_dsv4_context_kv_weight(draft_only), draft_only


def test_dsv4_checkpoint_names_resolve_like_the_full_loader():
    """Every mtp.* name of the synthetic checkpoint goes where vLLM's own remap sends it."""
    from vllm.models.deepseek_v4.nvidia.dspark import DSparkDeepseekV4ForCausalLM

    fake = types.SimpleNamespace(model=types.SimpleNamespace(confidence_head=object()))
    remap = DSparkDeepseekV4ForCausalLM._remap_dspark_name
    for name in tiny.dsv4_checkpoint_shapes(tiny.tiny_dsv4_config()):
        full = remap(fake, name)
        if not name.startswith("mtp."):
            assert full is None
            continue
        if name in tiny.DSV4_CONTEXT_NAMES and ".wkv." not in name:
            assert deepseek_v4._dsv4_param_name(name, 2) == (full, None)
    assert deepseek_v4._dsv4_param_name("mtp.1.attn.wkv.weight", 2) == (
        "model.context_wkv_proj.weight",
        1,
    )
    assert deepseek_v4._dsv4_param_name("mtp.0.attn.wkv.scale", 2) == (
        "model.context_wkv_proj.weight_scale_inv",
        0,
    )


def test_k3_weight_filter_over_checkpoint_names():
    names = tiny.k3_checkpoint_shapes(tiny.tiny_k3_config())
    kept = set(names) - set(kimi_k3.k3_skipped_weight_names(names))
    assert kept == tiny.K3_CONTEXT_NAMES
    assert kimi_k3.is_k3_context_kv_weight("model.context_proj.weight")
    assert kimi_k3.is_k3_context_kv_weight("layers.0.self_attn.k_scale")
    for draft_only in (
        "layers.0.self_attn.q_a_proj.weight",
        "layers.0.self_attn.kv_b_proj.weight",
        "layers.1.self_attn.o_proj.weight",
        "layers.1.mlp.gate_proj.weight",
        "final_norm.weight",
        "markov_head.markov_w2.weight",
        "lm_head.weight",
        "embed_tokens.weight",
        "confidence_head.proj.weight",
    ):
        assert not kimi_k3.is_k3_context_kv_weight(draft_only), draft_only


# --------------------------------------------------------------------------- Kimi-K3
K3_PARAMS = [
    "model.context_kv_proj.weight",
    "model.context_norm.weight",
    "model.context_proj.weight",
    "model.layers.0.self_attn.kv_a_layernorm.weight",
    "model.layers.1.self_attn.kv_a_layernorm.weight",
]


@pytest.fixture(scope="module")
def k3_checkpoint():
    return tiny.make_checkpoint(tiny.k3_checkpoint_shapes(tiny.tiny_k3_config()), seed=3)


@pytest.fixture()
def k3_pair(producer_cfg):
    from vllm.models.kimi_k3.nvidia.dspark_mla import K3DSparkForCausalLM

    draft = tiny.tiny_k3_config()
    target = producer_cfg.model_config.hf_config
    fcfg = tiny.shim_vllm_config(producer_cfg, target_hf=target, draft_hf=draft)
    ccfg = tiny.shim_vllm_config(producer_cfg, target_hf=target, draft_hf=draft)
    full = _build(fcfg, K3DSparkForCausalLM)
    ctx = _build(ccfg, kimi_k3.K3DSparkContextKVForCausalLM)
    return full, fcfg, ctx, ccfg


def test_k3_context_only_module_tree(k3_pair):
    full, _, ctx, _ = k3_pair
    assert sorted(n for n, _ in ctx.named_parameters()) == K3_PARAMS
    assert set(K3_PARAMS) <= {n for n, _ in full.named_parameters()}
    modules = {n for n, _ in ctx.named_modules()}
    for absent in (
        "lm_head",
        "model.embed_tokens",
        "model.markov_head",
        "model.final_norm",
        "model.layers.0.mlp",
        "model.layers.0.input_layernorm",
        "model.layers.0.self_attn.fused_qkv_a_proj",
        "model.layers.0.self_attn.q_b_proj",
        "model.layers.0.self_attn.kv_b_proj",
        "model.layers.0.self_attn.o_proj",
    ):
        assert absent not in modules, absent
    assert ctx.model.confidence_head is None
    assert drafter.is_context_kv_only(ctx) and not drafter.is_context_kv_only(full)
    f_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    c_bytes = sum(p.numel() * p.element_size() for p in ctx.parameters())
    assert c_bytes < f_bytes / 3


def test_k3_kv_cache_layer_names_and_specs_equal(k3_pair):
    full, fcfg, ctx, ccfg = k3_pair
    names = full.get_draft_kv_cache_layer_names()
    assert (
        names
        == ctx.get_draft_kv_cache_layer_names()
        == ["model.layers.6.self_attn", "model.layers.7.self_attn"]
    )
    f_layers = fcfg.compilation_config.static_forward_context
    c_layers = ccfg.compilation_config.static_forward_context
    assert sorted(f_layers) == sorted(c_layers) == names
    for n in names:
        f_spec, c_spec = f_layers[n].get_kv_cache_spec(fcfg), c_layers[n].get_kv_cache_spec(ccfg)
        assert f_spec is not None and f_spec == c_spec
        assert f_layers[n].get_attn_backend() is c_layers[n].get_attn_backend()
        assert type(f_layers[n].impl) is type(c_layers[n].impl)
        for attr in (
            "kv_cache_dtype",
            "head_size",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "q_lora_rank",
            "num_local_heads",
            "scale",
            "layer_name",
        ):
            assert getattr(f_layers[n], attr) == getattr(c_layers[n], attr), attr
        torch.testing.assert_close(
            c_layers[n].rotary_emb.cos_sin_cache,
            f_layers[n].rotary_emb.cos_sin_cache,
            rtol=0,
            atol=0,
        )
        assert torch.equal(c_layers[n]._k_scale, f_layers[n]._k_scale)
        assert (
            c_layers[n].kv_a_layernorm.variance_epsilon
            == f_layers[n].kv_a_layernorm.variance_epsilon
        )


def test_k3_mla_metadata_builder_constructs_for_the_context_only_group(k3_pair, monkeypatch):
    """vLLM's Triton MLA metadata builder (the class the H200 engine picked for this group; it
    extends MLACommonMetadataBuilder) is constructed on CPU for the draft KV group of each
    drafter, as init_attn_backend does. Before the context-only layer had a prefill backend
    this raised the H200 run's AttributeError (mla_attention.py: ``prefill_backend.clone()``).
    """
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLAMetadataBuilder
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    # the builder reserves its decode workspace when a workspace manager exists; growing it
    # empties the accelerator cache, which CPU-only torch lacks
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    if not is_workspace_manager_initialized():
        init_workspace_manager(torch.device("cpu"))
    full, fcfg, ctx, ccfg = k3_pair
    built = []
    for model, cfg in ((full, fcfg), (ctx, ccfg)):
        names = model.get_draft_kv_cache_layer_names()
        layers = cfg.compilation_config.static_forward_context
        spec = layers[names[0]].get_kv_cache_spec(cfg)
        with set_current_vllm_config(cfg):
            built.append(TritonMLAMetadataBuilder(spec, names, cfg, torch.device("cpu")))
    f_b, c_b = built
    assert type(c_b._prefill_backend) is type(f_b._prefill_backend)
    for attr in ("num_heads", "scale", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        assert getattr(c_b._prefill_backend, attr) == getattr(f_b._prefill_backend, attr), attr
    # a clone per builder, not the layer's own object (DBO micro-batches keep state on it)
    assert (
        c_b._prefill_backend
        is not ccfg.compilation_config.static_forward_context[
            ctx.get_draft_kv_cache_layer_names()[0]
        ].prefill_backend
    )
    for attr in (
        "mla_dims",
        "num_heads",
        "non_causal_multi_token_decode",
        "dcp_world_size",
        "reorder_batch_threshold",
    ):
        assert getattr(c_b, attr) == getattr(f_b, attr), attr
    assert c_b.non_causal_multi_token_decode and c_b.dcp_manager is None
    assert c_b.chunked_prefill_workspace.shape == f_b.chunked_prefill_workspace.shape


def test_k3_context_only_refuses_decode_context_parallel(producer_cfg):
    """DCP > 1 would make the builder read a DCP manager this layer cannot build (it has no
    kv_b_proj): refused at construction, naming the setting."""
    cfg = tiny.shim_vllm_config(
        producer_cfg, target_hf=producer_cfg.model_config.hf_config, draft_hf=tiny.tiny_k3_config()
    )
    cfg.parallel_config = copy.copy(cfg.parallel_config)
    cfg.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(ValueError, match="decode_context_parallel_size=2"):
        _build(cfg, kimi_k3.K3DSparkContextKVForCausalLM)


def test_k3_loads_only_context_weights_equal_to_the_full_drafter(k3_pair, k3_checkpoint):
    full, _, ctx, _ = k3_pair
    full_loaded = full.load_weights(iter(k3_checkpoint.items()))
    # the synthetic names are the full drafter's: it loads every one of its parameters
    assert full_loaded == {n for n, _ in full.named_parameters()}
    loaded = ctx.load_weights(iter(k3_checkpoint.items()))
    assert sorted(loaded) == K3_PARAMS
    assert torch.equal(ctx.model.context_kv_proj.weight, full.model.context_kv_proj.weight)
    assert torch.equal(ctx.model.context_proj.weight, full.model.context_proj.weight)
    for i in range(2):
        assert torch.equal(
            ctx.model.layers[i].self_attn.kv_a_layernorm.weight,
            full.model.layers[i].self_attn.kv_a_layernorm.weight,
        )
    rows = k3_checkpoint["layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    assert torch.equal(ctx.model.context_kv_proj.weight[rows.shape[0] :], rows)


def test_k3_context_kv_written_equals_the_full_drafter(k3_pair, k3_checkpoint, monkeypatch):
    """Both drafters run vLLM's context-KV code into their own caches; the caches match."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    # Two CUDA queries on vLLM's path have no CPU-only-torch answer: the workspace manager
    # empties the accelerator cache when it grows, and the layout check asserts no CUDA-graph
    # capture is running. Neither exists on CPU; answer them as a CUDA build would here.
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    if not is_workspace_manager_initialized():
        init_workspace_manager(torch.device("cpu"))
    full, fcfg, ctx, ccfg = k3_pair
    full.load_weights(iter(k3_checkpoint.items()))
    ctx.load_weights(iter(k3_checkpoint.items()))
    # The linear quant methods and the drafters' own hook (the cross-layer norm weights / KV scales
    # the context path
    # reads): vLLM's full post-load pass fails on CPU for K3, because the CPU linear method
    # repacks kv_b_proj out of `.weight` before MultiHeadLatentAttention splits it
    # (kimi_k3/nvidia/mla.py:455 -> mla_attention.py:426).
    for model in (full, ctx):
        # the CPU MLA cache insert (amx_mla.py) supports bf16 only, and the CPU rotary op
        # wants its cos/sin table in the key's dtype (K3 keeps it fp32 for the CUDA op)
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
        for layer in model.model.layers:
            # a private copy: get_rope hands every layer one cached, shared module
            rope = copy.deepcopy(layer.self_attn.rotary_emb)
            rope.cos_sin_cache = rope.cos_sin_cache.to(torch.bfloat16)
            layer.self_attn.rotary_emb = rope
        _repack_linears(model)
        model.process_weights_after_loading()
    # each weight held once: vLLM's stacked kv_a_layernorm copy holds the per-layer norms, and
    # the K/V rows live only in context_kv_proj (the full drafter holds both)
    ctx_params = sum(p.numel() * p.element_size() for p in ctx.parameters())
    assert drafter.held_weight_bytes(ctx) == ctx_params
    assert ctx.model._context_kv_norm_weights.numel() > 0

    cfg = tiny.tiny_k3_config()
    n_tok, n_blocks, block = 11, 4, 16
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(n_tok, cfg.target_hidden_size * cfg.num_target_layers, generator=g).to(
        torch.bfloat16
    )
    positions = torch.arange(5, 5 + n_tok)
    slots = torch.randperm(n_blocks * block, generator=g)[:n_tok]

    def written(model, vcfg):
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        caches = []
        for layer in model.model.layers:
            layer.self_attn.kv_cache = torch.zeros(n_blocks, block, width, dtype=torch.bfloat16)
            caches.append(layer.self_attn.kv_cache)
        with set_current_vllm_config(vcfg):
            states = model.combine_hidden_states(aux)
            # one layer per call: the per-layer insert path (the grouped CUDA op has no CPU
            # kernel in vLLM 0.34.0); a None entry writes nothing for that layer
            for i in range(len(caches)):
                per_layer = [slots if j == i else None for j in range(len(caches))]
                model.precompute_and_store_context_kv(states, positions, per_layer)
        return caches

    try:
        f_caches = written(full, fcfg)
    except (RuntimeError, AssertionError, NotImplementedError) as e:  # pragma: no cover
        pytest.fail(f"vLLM's full K3 drafter cannot write context KV on CPU: {e!r}")
    c_caches = written(ctx, ccfg)
    for f, c in zip(f_caches, c_caches, strict=True):
        assert f.abs().sum() > 0
        torch.testing.assert_close(c, f, rtol=0, atol=0)


@pytest.mark.parametrize(
    "call",
    [
        "forward",
        "compute_logits",
        "compute_draft_logits",
        "compute_draft_logits_local",
        "markov_embed",
        "markov_bias",
        "compute_confidence",
        "embed_input_ids",
        "map_draft_to_target",
    ],
)
def test_k3_drafting_raises_clearly(k3_pair, call):
    ctx = k3_pair[2]
    with pytest.raises(drafter.ContextOnlyDrafterError, match="prefill-only KV producer"):
        getattr(ctx, call)(torch.zeros(1, dtype=torch.long))
    with pytest.raises(drafter.ContextOnlyDrafterError):
        ctx.model(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))


# --------------------------------------------------------------------------- DeepSeek-V4
DSV4_PARAMS = [
    "model.context_wkv_proj.weight",
    "model.layers.0.attn.kv_norm.weight",
    "model.layers.1.attn.kv_norm.weight",
    "model.main_norm.weight",
    "model.main_proj.weight",
]


@pytest.fixture()
def dsv4_ctx(producer_cfg):
    ds = tiny.tiny_dsv4_config()
    cfg = tiny.shim_vllm_config(producer_cfg, target_hf=ds, draft_hf=ds)
    cls = deepseek_v4.DSparkDeepseekV4ContextKVForCausalLM
    return _build(cfg, cls), cfg


def test_dsv4_context_only_module_tree(dsv4_ctx):
    ctx, _ = dsv4_ctx
    assert sorted(n for n, _ in ctx.named_parameters()) == DSV4_PARAMS
    modules = {n for n, _ in ctx.named_modules()}
    for absent in (
        "lm_head",
        "model.embed_tokens",
        "model.markov_head",
        "model.norm",
        "model.layers.0.ffn",
        "model.layers.0.attn_norm",
        "model.layers.0.attn.fused_wqa_wkv",
        "model.layers.0.attn.wq_b",
        "model.layers.0.attn.wo_a",
        "model.layers.0.attn.wo_b",
        "model.layers.0.attn.q_norm",
        "model.layers.0.attn.indexer",
    ):
        assert absent not in modules, absent
    assert drafter.is_context_kv_only(ctx)
    ds = tiny.tiny_dsv4_config()
    assert ctx.model.context_wkv_proj.weight.shape == (
        ds.n_mtp_layers * ds.head_dim,
        ds.hidden_size,
    )
    attn = ctx.model.layers[0].attn
    # what the insert reads, at the values vLLM's FlashMLA attention class gives them
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention as flashmla

    assert attn.full_attention_class == "DeepseekV4FlashMLAAttention"
    assert attn.padded_heads == flashmla.get_padded_num_q_heads(ds.num_attention_heads) == 64
    assert attn.n_local_heads == ds.num_attention_heads and attn.head_dim == ds.head_dim
    assert attn.eps == ds.rms_norm_eps
    assert attn.rotary_emb.cos_sin_cache.shape[-1] == ds.qk_rope_head_dim


def test_dsv4_kv_cache_layers_and_specs(dsv4_ctx):
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention as flashmla
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

    ctx, cfg = dsv4_ctx
    ds = tiny.tiny_dsv4_config()
    names = ["model.layers.2.attn.swa_cache", "model.layers.3.attn.swa_cache"]
    assert ctx.get_draft_kv_cache_layer_names() == names
    layers = cfg.compilation_config.static_forward_context
    assert sorted(layers) == [
        "model.layers.2.attn",
        "model.layers.2.attn.swa_cache",
        "model.layers.3.attn",
        "model.layers.3.attn.swa_cache",
    ]
    # the FlashMLA layout: fp8_ds_mla (written back to the cache config, as vLLM does)
    assert cfg.cache_config.cache_dtype == "fp8_ds_mla"
    for n in names:
        spec = layers[n].get_kv_cache_spec(cfg)
        assert isinstance(spec, SlidingWindowMLASpec)
        assert (spec.head_size, spec.sliding_window, spec.dtype, spec.block_size) == (
            ds.head_dim,
            ds.sliding_window,
            torch.uint8,
            64,
        )
        assert spec.cache_dtype_str == "fp8_ds_mla" and spec.model_version == "deepseek_v4"
        assert layers[n].get_attn_backend() is flashmla.swa_backend_cls
        attn = layers[n.removesuffix(".swa_cache")]
        assert attn.get_kv_cache_spec(cfg) is None
        assert attn.get_attn_backend() is flashmla.backend_cls


def test_dsv4_loads_only_context_weights(dsv4_ctx):
    ctx, _ = dsv4_ctx
    ckpt = tiny.make_checkpoint(tiny.dsv4_checkpoint_shapes(tiny.tiny_dsv4_config()), seed=4)
    loaded = ctx.load_weights(iter(ckpt.items()))
    assert sorted(loaded) == DSV4_PARAMS
    hd = tiny.tiny_dsv4_config().head_dim
    w = ctx.model.context_wkv_proj.weight
    assert torch.equal(w[:hd], ckpt["mtp.0.attn.wkv.weight"])
    assert torch.equal(w[hd:], ckpt["mtp.1.attn.wkv.weight"])
    assert torch.equal(ctx.model.layers[1].attn.kv_norm.weight, ckpt["mtp.1.attn.kv_norm.weight"])
    assert torch.equal(ctx.model.main_proj.weight, ckpt["mtp.0.main_proj.weight"])


def test_dsv4_context_projection_path_on_cpu(dsv4_ctx):
    """combine_hidden_states and the pre-insert part of vLLM's precompute run on CPU (no slot
    mapping: projection + kv_norm only, nothing written, as in vLLM's profiling call)."""
    from vllm.config import set_current_vllm_config

    ctx, cfg = dsv4_ctx
    ckpt = tiny.make_checkpoint(tiny.dsv4_checkpoint_shapes(tiny.tiny_dsv4_config()), seed=4)
    ctx.load_weights(iter(ckpt.items()))
    _repack_linears(ctx)
    ds = tiny.tiny_dsv4_config()
    aux = torch.randn(5, ds.hidden_size * 2)
    with set_current_vllm_config(cfg):
        states = ctx.combine_hidden_states(aux)
        assert states.shape == (5, ds.hidden_size)
        ctx.precompute_and_store_context_kv(states, torch.arange(5), None)


@pytest.mark.parametrize(
    "call", ["forward", "compute_logits", "markov_embed", "compute_confidence", "embed_input_ids"]
)
def test_dsv4_drafting_raises_clearly(dsv4_ctx, call):
    ctx, _ = dsv4_ctx
    with pytest.raises(drafter.ContextOnlyDrafterError, match="cannot draft tokens"):
        getattr(ctx, call)(torch.zeros(1, dtype=torch.long))
    with pytest.raises(drafter.ContextOnlyDrafterError):
        ctx.model.layers[0].attn(torch.zeros(1))


# --------------------------------------------------------------------------- DeepSeek-V4 full
class _NoEvent:
    """Stands in for torch.cuda.Event, which DeepseekV4Attention creates at construction
    (attention.py:329) and a CPU-only torch cannot instantiate; nothing here records events."""

    def __init__(self, *args, **kwargs) -> None:
        pass


@pytest.fixture()
def dsv4_full_and_ctx(producer_cfg):
    """vLLM's full DeepSeek-V4 drafter built on CPU next to ours, with its two CUDA-only
    constructor calls answered (torch.cuda.Event; the FP8 einsum recipe, which asserts a CUDA
    device: nvidia/ops/o_proj.py:33, nothing runs it here) and a one-rank EP group for its MoE."""
    from vllm.distributed import get_world_group
    from vllm.distributed import parallel_state as ps
    from vllm.models.deepseek_v4.nvidia import flashmla
    from vllm.models.deepseek_v4.nvidia.dspark import DSparkDeepseekV4ForCausalLM

    ds = tiny.tiny_dsv4_config()
    fcfg = tiny.shim_vllm_config(producer_cfg, target_hf=ds, draft_hf=ds)
    ccfg = tiny.shim_vllm_config(producer_cfg, target_hf=ds, draft_hf=ds)
    saved_ep = ps._EP
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "Event", _NoEvent)
        mp.setattr(flashmla, "compute_fp8_einsum_recipe", lambda: (None, None))
        if ps._EP is None:
            ps._EP = ps.init_model_parallel_group(
                [[0]], get_world_group().local_rank, "gloo", group_name="ep"
            )
        try:
            full = _build(fcfg, DSparkDeepseekV4ForCausalLM)
        finally:
            ps._EP = saved_ep
    ctx = _build(ccfg, deepseek_v4.DSparkDeepseekV4ContextKVForCausalLM)
    return full, fcfg, ctx, ccfg


def test_dsv4_tree_names_and_specs_equal_the_full_drafter(dsv4_full_and_ctx):
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    full, fcfg, ctx, ccfg = dsv4_full_and_ctx
    full_params = {n for n, _ in full.named_parameters()}
    assert set(DSV4_PARAMS) <= full_params and len(full_params) > 4 * len(DSV4_PARAMS)
    names = full.get_draft_kv_cache_layer_names()
    assert names == ctx.get_draft_kv_cache_layer_names()
    f_layers = {
        n: m
        for n, m in fcfg.compilation_config.static_forward_context.items()
        if isinstance(m, AttentionLayerBase)
    }  # (the MoE experts register too)
    c_layers = ccfg.compilation_config.static_forward_context
    assert sorted(f_layers) == sorted(c_layers)
    assert fcfg.cache_config.cache_dtype == ccfg.cache_config.cache_dtype == "fp8_ds_mla"
    for n in sorted(f_layers):
        assert f_layers[n].get_kv_cache_spec(fcfg) == c_layers[n].get_kv_cache_spec(ccfg), n
        assert f_layers[n].get_attn_backend() is c_layers[n].get_attn_backend(), n
    for i in range(2):
        f_attn, c_attn = full.model.layers[i].attn, ctx.model.layers[i].attn
        for attr in (
            "n_local_heads",
            "head_dim",
            "padded_heads",
            "eps",
            "window_size",
            "compress_ratio",
            "kv_cache_dtype",
            "kv_cache_torch_dtype",
            "prefix",
        ):
            assert getattr(f_attn, attr) == getattr(c_attn, attr), attr
        assert type(f_attn).backend_cls is c_attn.backend_cls
        torch.testing.assert_close(
            c_attn.rotary_emb.cos_sin_cache, f_attn.rotary_emb.cos_sin_cache, rtol=0, atol=0
        )
        assert f_attn.swa_cache_layer.block_size == c_attn.swa_cache_layer.block_size


def test_dsv4_swa_metadata_builder_constructs_for_both_drafters(dsv4_full_and_ctx):
    """The DeepSeek-V4 draft KV group's metadata builder (vLLM's FlashMLA SWA builder, the
    backend's own class) constructs on CPU for both drafters, as init_attn_backend does. Unlike
    the MLA builders it reads only the KV spec and the configs, never the layer, and the group's
    layers are vLLM's own DeepseekV4SWACache objects in both: the K3 ``prefill_backend`` gap has
    no DeepSeek-V4 counterpart (checked against vllm 0.34.0 sparse_swa.py / nvidia/flashmla.py).
    """
    from vllm.config import set_current_vllm_config

    full, fcfg, ctx, ccfg = dsv4_full_and_ctx
    built = []
    for model, cfg in ((full, fcfg), (ctx, ccfg)):
        names = model.get_draft_kv_cache_layer_names()
        layer = cfg.compilation_config.static_forward_context[names[0]]
        assert type(layer).__name__ == "DeepseekV4SWACache"
        builder_cls = layer.get_attn_backend().get_builder_cls()
        with set_current_vllm_config(cfg):
            built.append(builder_cls(layer.get_kv_cache_spec(cfg), names, cfg, torch.device("cpu")))
    f_b, c_b = built
    assert type(f_b) is type(c_b)
    for attr in ("window_size", "block_size", "decode_threshold", "compress_ratio", "head_size"):
        assert getattr(c_b, attr) == getattr(f_b, attr), attr


def test_dsv4_loaded_context_weights_equal_the_full_drafter(dsv4_full_and_ctx):
    from vllm.config import set_current_vllm_config

    full, fcfg, ctx, ccfg = dsv4_full_and_ctx
    names = tiny.dsv4_checkpoint_shapes(tiny.tiny_dsv4_config())
    ckpt = tiny.make_checkpoint(
        {n: s for n, s in names.items() if n in tiny.DSV4_CONTEXT_NAMES}, seed=5
    )
    full.load_weights(iter(ckpt.items()))
    assert sorted(ctx.load_weights(iter(ckpt.items()))) == DSV4_PARAMS
    for p in ("context_wkv_proj", "main_proj", "main_norm"):
        assert torch.equal(getattr(ctx.model, p).weight, getattr(full.model, p).weight), p
    for i in range(2):
        assert torch.equal(
            ctx.model.layers[i].attn.kv_norm.weight, full.model.layers[i].attn.kv_norm.weight
        )
    # the projection + kv_norm the insert is fed (everything before the CUDA insert op)
    _repack_linears(full.model.main_proj)
    _repack_linears(full.model.context_wkv_proj)
    _repack_linears(ctx)
    aux = torch.randn(7, 64 * 2, generator=torch.Generator().manual_seed(2))
    outs = []
    for model, cfg in ((full, fcfg), (ctx, ccfg)):
        with set_current_vllm_config(cfg):
            states = model.combine_hidden_states(aux)
            kv = model.model.context_wkv_proj(states).view(7, 2, -1)
            outs.append([model.model.layers[i].attn.kv_norm(kv[:, i]) for i in range(2)])
    for f, c in zip(*outs, strict=True):
        assert f.abs().sum() > 0
        torch.testing.assert_close(c, f, rtol=0, atol=0)


@pytest.mark.parametrize("fam", ["k3", "dsv4"])
def test_nan_norm_draft_config_makes_the_context_states_nan(producer_cfg, fam):
    """The premise of the GPU PD control: with the draft config's ``rms_norm_eps`` set to -1e30 the
    context-KV-only drafter's context states (``combine_hidden_states``: what every layer's context
    key and value is projected from) are all NaN; with the real eps they are finite."""
    from support.draft_controls import NAN_NORM_EPS
    from vllm.config import set_current_vllm_config

    def states(eps):
        if fam == "k3":
            draft = tiny.tiny_k3_config()
            target = producer_cfg.model_config.hf_config
            cls = kimi_k3.K3DSparkContextKVForCausalLM
            shapes = tiny.k3_checkpoint_shapes(tiny.tiny_k3_config())
            width = draft.target_hidden_size * draft.num_target_layers
        else:
            draft = target = tiny.tiny_dsv4_config()
            cls = deepseek_v4.DSparkDeepseekV4ContextKVForCausalLM
            shapes = tiny.dsv4_checkpoint_shapes(tiny.tiny_dsv4_config())
            width = draft.hidden_size * 2
        draft.rms_norm_eps = eps
        cfg = tiny.shim_vllm_config(producer_cfg, target_hf=target, draft_hf=draft)
        ctx = _build(cfg, cls)
        ctx.load_weights(iter(tiny.make_checkpoint(shapes, seed=5).items()))
        _repack_linears(ctx)
        if fam == "k3":  # vLLM's post-load step, which compares the layers' norm eps
            ctx.process_weights_after_loading()
        aux = torch.randn(5, width, generator=torch.Generator().manual_seed(0))
        with set_current_vllm_config(cfg):
            return ctx.combine_hidden_states(aux)

    ok, bad = states(1e-6), states(NAN_NORM_EPS)
    assert torch.isfinite(ok).all()
    assert torch.isnan(bad).all()
    if fam == "k3":  # why not eps = NaN: vLLM's eps equality check (dspark_mla.py:244) refuses it
        with pytest.raises(AssertionError, match="share their latent KV geometry"):
            states(float("nan"))
