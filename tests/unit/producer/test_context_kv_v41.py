"""The context-KV-only DeepSeek-V4.1 DSpark drafter (producer/deepseek_v41.py), in process on CPU.

vLLM 0.34.0's full V4.1 drafter (``deepseek_v41/nvidia/dspark.py``) constructs on CPU with its
CUDA-only constructor calls answered (tests/support/tiny_dsv41.py) and loads the synthetic
checkpoint, so the two drafters are compared directly: module trees, KV-cache layer names, specs
and backends, the attributes the insert reads, the loaded weights, and the context KV each
writes. The insert itself is a CUDA op (``torch.ops._C.fused_deepseek_v4_kv_rope_insert``, no CPU
kernel); both drafters call it through vLLM's ``_insert_context_kv``, which is recorded instead, so
what is compared is every argument the op gets (the normalized KV rows, positions, slots, the
RoPE table, the cache's block size and record kind).
"""

from __future__ import annotations

import types

import pytest
import torch
from support import tiny_dsv41 as v41

from dspark_dev import tiny_mla_drafts as tiny
from vllm_dspark_pp.producer import deepseek_v41, drafter, families, memory

CONTEXT_PARAMS = [
    "model.context_wkv_proj.weight",
    "model.layers.0.attn.kv_norm.weight",
    "model.layers.1.attn.kv_norm.weight",
    "model.main_norm.weight",
    "model.main_proj.weight",
]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory, plugin, dist_env):
    pair = v41.make_tiny_dsv41_pair(tmp_path_factory.mktemp("v41-producer"))
    return v41.engine_config(pair, pp=1)


@pytest.fixture(scope="module")
def checkpoint(cfg):
    hf = cfg.speculative_config.draft_model_config.hf_config
    return tiny.make_checkpoint(v41.checkpoint_shapes(hf), seed=4)


@pytest.fixture()
def drafters(cfg, monkeypatch):
    import copy

    from vllm.models.deepseek_v41.nvidia.dspark import DSparkDeepseekV4ForCausalLM

    fcfg, ccfg = copy.copy(cfg), copy.copy(cfg)
    for c in (fcfg, ccfg):
        c.cache_config = copy.copy(cfg.cache_config)
        c.compilation_config = copy.copy(cfg.compilation_config)
    full = v41.build_drafter(fcfg, DSparkDeepseekV4ForCausalLM, monkeypatch)
    ctx = v41.build_drafter(ccfg, deepseek_v41.DSparkDeepseekV41ContextKVForCausalLM, monkeypatch)
    return full, fcfg, ctx, ccfg


def _spec(*archs):
    return types.SimpleNamespace(
        draft_model_config=types.SimpleNamespace(architectures=list(archs))
    )


def test_the_registry_routes_v41_drafts_to_this_build():
    # vLLM's registry resolves V4.1 DSpark to the CUDA module on every platform but ROCm
    route = families.context_kv_class_for(_spec(v41.DRAFT_ARCH))
    assert route is deepseek_v41.DSparkDeepseekV41ContextKVForCausalLM
    from vllm.models.deepseek_v41.nvidia.dspark import DSparkDeepseekV4ForCausalLM as full

    assert route.precompute_and_store_context_kv is full.precompute_and_store_context_kv
    assert families.unsupported_draft_problem(_spec(v41.DRAFT_ARCH)) is None


def test_checkpoint_names_resolve_like_vllms_v41_loader(cfg):
    from vllm.models.deepseek_v41.nvidia.dspark import DSparkDeepseekV4ForCausalLM

    hf = cfg.speculative_config.draft_model_config.hf_config
    names = v41.checkpoint_shapes(hf)
    kept = {n for n in names if drafter.is_mtp_context_weight(n)}
    assert kept == tiny.DSV4_CONTEXT_NAMES
    fake = types.SimpleNamespace(model=types.SimpleNamespace(confidence_head=object()))
    for name in kept - {"mtp.0.attn.wkv.weight", "mtp.1.attn.wkv.weight"}:
        full = DSparkDeepseekV4ForCausalLM._remap_dspark_name(fake, name)
        assert drafter.mtp_context_param_name(name, 2) == (full, None), name


def test_tree_layers_specs_and_insert_attributes_equal_the_full_drafter(drafters):
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    full, fcfg, ctx, ccfg = drafters
    assert sorted(n for n, _ in ctx.named_parameters()) == CONTEXT_PARAMS
    assert set(CONTEXT_PARAMS) <= {n for n, _ in full.named_parameters()}
    assert drafter.is_context_kv_only(ctx) and not drafter.is_context_kv_only(full)
    names = full.get_draft_kv_cache_layer_names()
    assert (
        names
        == ctx.get_draft_kv_cache_layer_names()
        == [
            "model.layers.4.attn.swa_cache",
            "model.layers.5.attn.swa_cache",
        ]
    )
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
    assert c_layers[names[0]].get_kv_cache_spec(ccfg).block_size == 32
    for i in range(2):
        f_attn, c_attn = full.model.layers[i].attn, ctx.model.layers[i].attn
        assert type(f_attn).__name__ == c_attn.full_attention_class
        for attr in (
            "n_local_heads",
            "head_dim",
            "padded_heads",
            "eps",
            "window_size",
            "compress_ratio",
            "is_kv_source",
            "kv_cache_dtype",
            "kv_cache_torch_dtype",
            "kv_mxfp8",
            "swa_bytes_per_token",
            "kv_page_alignment",
            "prefix",
        ):
            assert getattr(f_attn, attr) == getattr(c_attn, attr), attr
        f_swa, c_swa = f_attn.swa_cache_layer, c_attn.swa_cache_layer
        for attr in ("block_size", "bounded_replay", "packed_bytes_per_token", "prefix"):
            assert getattr(f_swa, attr) == getattr(c_swa, attr), attr
        torch.testing.assert_close(
            c_attn.rotary_emb.cos_sin_cache, f_attn.rotary_emb.cos_sin_cache, rtol=0, atol=0
        )


def test_loads_the_context_weights_the_full_drafter_loads(drafters, checkpoint):
    full, _, ctx, _ = drafters
    f_loaded = full.load_weights(iter(checkpoint.items()))
    # the synthetic names are the full drafter's (embedding and head: aliased from the target)
    assert {n for n, _ in full.named_parameters()} - f_loaded == {
        "lm_head.weight",
        "model.embed_tokens.weight",
    }
    assert sorted(ctx.load_weights(iter(checkpoint.items()))) == CONTEXT_PARAMS
    f_params = dict(full.named_parameters())
    for name, param in ctx.named_parameters():
        assert torch.equal(param, f_params[name]), name


def test_context_kv_written_equals_the_full_drafter(drafters, checkpoint, cfg, monkeypatch):
    """Both drafters run vLLM's context-KV code (combine + precompute); the insert each calls
    gets the same arguments."""
    import vllm.models.deepseek_v41.nvidia.dspark as v41_dspark
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.linear import LinearBase

    full, fcfg, ctx, ccfg = drafters
    full.load_weights(iter(checkpoint.items()))
    ctx.load_weights(iter(checkpoint.items()))
    for model in (full, ctx):  # the CPU linear method's post-load repack its forward needs
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(module, LinearBase) and method is not None:
                method.process_weights_after_loading(module)
    calls: list[tuple] = []

    def record(attn, kv, positions, slot_mapping):
        cache = attn.swa_cache_layer
        calls.append(
            (attn.prefix, kv.clone(), positions, slot_mapping, attn.rotary_emb.cos_sin_cache,
             cache.block_size, attn.kv_mxfp8, attn.kv_cache_torch_dtype)
        )  # fmt: skip

    monkeypatch.setattr(v41_dspark, "_insert_context_kv", record)
    hf = cfg.speculative_config.draft_model_config.hf_config
    g = torch.Generator().manual_seed(1)
    n_tok = 9
    aux = torch.randn(n_tok, hf.hidden_size * len(hf.dspark_target_layer_ids), generator=g)
    positions = torch.arange(3, 3 + n_tok)
    slots = [torch.randperm(64, generator=g)[:n_tok] for _ in range(2)]
    out = []
    for model, vcfg in ((full, fcfg), (ctx, ccfg)):
        calls.clear()
        with set_current_vllm_config(vcfg):
            states = model.combine_hidden_states(aux)
            model.precompute_and_store_context_kv(states, positions, slots)
        out.append(list(calls))
    f_calls, c_calls = out
    assert len(f_calls) == len(c_calls) == 2
    for f, c in zip(f_calls, c_calls, strict=True):
        assert f[0] == c[0]
        assert f[1].abs().sum() > 0
        torch.testing.assert_close(c[1], f[1], rtol=0, atol=0)
        for a, b in zip(f[2:], c[2:], strict=True):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_memory_rule_counts_the_built_drafters(drafters, cfg):
    """``plan``'s figures are the bytes of what is built (fp32 here: every parameter 4 bytes)."""
    full, _, ctx, _ = drafters
    hf = cfg.speculative_config.draft_model_config.hf_config
    rule = memory.v41_draft_bytes(hf, 4, False, False)

    def held(model):
        return sum(p.numel() * p.element_size() for p in model.parameters())

    assert rule["context_only"] == held(ctx)
    # vLLM's full drafter holds the aliased embedding and head, and copies every layer's wkv
    # rows into context_wkv_proj (counted in 'full', the 'fused_kv_copy')
    assert rule["full"] + rule["shared_with_target"] == held(full)
    assert rule["fused_kv_copy"] == full.model.context_wkv_proj.weight.numel() * 4
    assert families.family_for([v41.DRAFT_ARCH]).draft_memory is memory.v41_draft_bytes


def test_plan_prints_the_v41_figures_per_role(cfg):
    from vllm.config import KVTransferConfig

    from vllm_dspark_pp import deployment_plan

    hf = cfg.speculative_config.draft_model_config.hf_config
    b = deployment_plan.__dict__["_draft_bytes_by_role"](
        cfg.speculative_config, KVTransferConfig(kv_connector="MooncakeConnector",
                                                 kv_role="kv_producer"), 2
    )  # fmt: skip
    rule = memory.v41_draft_bytes(hf, 2, False, False)
    mib = 1024 * 1024
    assert f"context-KV-only {rule['context_only'] / mib:.2f} MiB" in b["draft bytes"]
    assert f"full drafter {rule['full'] / mib:.2f} MiB" in b["draft bytes"]
    assert b["this role builds"] == "context-KV-only drafter (prefill-only producer)"


@pytest.mark.parametrize(
    "call", ["forward", "compute_logits", "markov_embed", "compute_confidence", "embed_input_ids"]
)
def test_drafting_raises_clearly(drafters, call):
    ctx = drafters[2]
    with pytest.raises(drafter.ContextOnlyDrafterError, match="cannot draft tokens"):
        getattr(ctx, call)(torch.zeros(1, dtype=torch.long))
    with pytest.raises(drafter.ContextOnlyDrafterError):
        ctx.model.layers[0].attn(torch.zeros(1))
