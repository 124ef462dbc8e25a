"""Kimi-K3 DSpark: the draft's non-causal MLA layers get KV-cache groups of their own (issue 16).

Real objects throughout: the VllmConfig comes from ``EngineArgs.create_engine_config()`` for a
generated tiny Kimi-K3 target (``KimiLinearForCausalLM``: KDA + NoPE MLA, MoE) with a tiny
``K3DSparkModel`` draft; vLLM's target model class and vLLM's full drafter (or our context-KV-only
one) are constructed on CPU into one layer registry, vLLM's worker code collects their
``KVCacheSpec``s (``v1/worker/gpu/attn_utils.get_kv_cache_spec``, draft layers marked as the
speculator marks them) and vLLM's planner groups them (``v1/core/kv_cache_planning.
get_kv_cache_groups``).

On stock vLLM 0.34.0 the draft layers land in the target's MLA group and that group's spec says
``non_causal_multi_token_decode=True`` (``MLAAttentionSpec.merge`` ORs the flag);
``test_stock_vllm_merges_the_draft_into_the_target_group`` shows it with the patch taken off.
With patches/v1_kv_cache_interface.py the groups are apart.
"""

from __future__ import annotations

import pytest
import torch
from support.mla_cpu_config import k3_engine_config

from dspark_dev import tiny_mla_targets
from vllm_dspark_pp.patches import v1_kv_cache_interface as split_patch


@pytest.fixture(scope="module")
def k3_pair(tmp_path_factory):
    return tiny_mla_targets.make_tiny_k3_pair(tmp_path_factory.mktemp("k3-pair"))


def _engine_config(pair, kv_transfer_config=None):
    """The same GPU-deployment config on every CPU (support/mla_cpu_config.py, issue 24)."""
    return k3_engine_config(
        pair,
        speculative_config=pair.speculative_config(),
        kv_transfer_config=kv_transfer_config,
        max_num_seqs=4,
    )


def _specs_of(pair, drafter: str, monkeypatch, connector: str | None = None):
    """Build target + drafter into one fresh layer registry; return (vllm_config, specs,
    draft layer names)."""
    import vllm.models.kimi_k3.nvidia.model as k3_model  # import before the Stream stand-in
    import vllm.v1.worker.gpu.attn_utils as attn_utils
    from vllm.config import KVTransferConfig, set_current_vllm_config
    from vllm.models.kimi_k3.nvidia.dspark_mla import K3DSparkForCausalLM

    from vllm_dspark_pp.producer import kimi_k3

    connector = "MooncakeConnector" if drafter == "context_only" else connector
    kv = KVTransferConfig(kv_connector=connector, kv_role="kv_producer") if connector else None
    cfg = _engine_config(pair, kv)
    cfg.compilation_config.static_forward_context = {}
    cls = K3DSparkForCausalLM if drafter == "full" else kimi_k3.K3DSparkContextKVForCausalLM
    # Construction on CPU: the target creates an aux CUDA stream (only used to overlap a GEMM
    # at run time) and, by default, a CUTLASS GEMM-AR kernel (not in the CPU build).
    monkeypatch.setenv("VLLM_KIMI_K3_GEMM_AR", "0")
    with monkeypatch.context() as m, set_current_vllm_config(cfg), torch.device("cpu"):
        m.setattr(torch.cuda, "Stream", lambda *a, **k: None)
        k3_model.KimiLinearForCausalLM(vllm_config=cfg, prefix="")
        target_layers = set(cfg.compilation_config.static_forward_context)
        draft = cls(vllm_config=cfg, prefix="")
    draft_layers = set(draft.get_draft_kv_cache_layer_names())
    ctx = cfg.compilation_config.static_forward_context
    assert draft_layers == set(ctx) - target_layers
    for name in draft_layers:  # as DSparkSpeculator.load_model marks them (speculator.py:305)
        ctx[name].is_draft_layer = True
    with set_current_vllm_config(cfg):
        specs = attn_utils.get_kv_cache_spec(cfg)
    return cfg, specs, draft_layers


def _groups(cfg, specs, layout):
    """vLLM's grouping under a KV-cache layout (the engine core resolves it from the workers'
    backends; on CPU both kinds are given explicitly: layer-outermost takes the uniform /
    hybrid-bucketing paths, block-outermost the packed one)."""
    from vllm.v1.attention.backends.utils import record_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups

    cfg.cache_config.kv_cache_layout = None
    record_kv_cache_layout(cfg.cache_config, layout)
    return get_kv_cache_groups(cfg, dict(specs))


def _layer_flags(group):
    from vllm.v1.kv_cache_interface import iter_layer_specs

    return {
        bool(getattr(s, "non_causal_multi_token_decode", False))
        for s in iter_layer_specs(group.kv_cache_spec)
    }


def _describe(groups):
    return [
        (type(g.kv_cache_spec).__name__, sorted(g.layer_names), sorted(_layer_flags(g)))
        for g in groups
    ]


def _check_geometry(specs, draft_layers):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    target_mla = {
        n: s for n, s in specs.items() if isinstance(s, MLAAttentionSpec) and n not in draft_layers
    }
    assert target_mla, specs
    # The real K3 geometry: same latent width, heads, block size and dtype on both sides, so
    # the only thing keeping them apart is the non-causal flag.
    for name in draft_layers:
        d = specs[name]
        assert isinstance(d, MLAAttentionSpec) and d.non_causal_multi_token_decode and d.is_draft
        for t in target_mla.values():
            assert not t.non_causal_multi_token_decode
            assert (d.head_size, d.num_kv_heads, d.block_size, d.dtype, d.page_size_bytes) == (
                t.head_size,
                t.num_kv_heads,
                t.block_size,
                t.dtype,
                t.page_size_bytes,
            )
    return target_mla


def _assert_apart(groups, target_mla, draft_layers):
    desc = _describe(groups)
    print(*desc, sep="\n")
    for g in groups:
        names = set(g.layer_names)
        if names & draft_layers:
            assert names <= draft_layers, f"draft layers share a group: {desc}"
            assert _layer_flags(g) == {True}
        if names & set(target_mla):
            assert _layer_flags(g) == {False}, f"target MLA group flagged non-causal: {desc}"
            assert not getattr(g.kv_cache_spec, "non_causal_multi_token_decode", False)


# (layers, layout): ``hybrid`` is the real K3 stack (KDA + MLA); vLLM plans it block-outermost
# (packed path). With layer-outermost pages the tiny KDA state page cannot be padded to the MLA
# page (vLLM raises NotImplementedError with or without the patch), so that pair is not listed.
# ``mla_only`` (target MLA + draft layers only) takes the uniform-spec path under LBNHC and the
# uniform-type path under BLNHC.
CASES = [("hybrid", "BLNHC"), ("mla_only", "LBNHC"), ("mla_only", "BLNHC")]


@pytest.mark.parametrize("drafter", ["full", "context_only"])
@pytest.mark.parametrize("layers,layout", CASES)
def test_k3_draft_mla_layers_keep_their_own_kv_group(
    k3_pair, drafter, layers, layout, plugin, dist_env, monkeypatch
):
    cfg, specs, draft_layers = _specs_of(k3_pair, drafter, monkeypatch)
    target_mla = _check_geometry(specs, draft_layers)
    if layers == "mla_only":
        specs = {n: s for n, s in specs.items() if n in target_mla or n in draft_layers}
    _assert_apart(_groups(cfg, specs, layout), target_mla, draft_layers)


@pytest.mark.parametrize("layers,layout", CASES)
def test_stock_vllm_merges_the_draft_into_the_target_group(
    k3_pair, layers, layout, plugin, dist_env, monkeypatch
):
    """Without the patch (vLLM 0.34.0 as shipped) the geometry above does merge: proof that the
    patch is needed for this K3 geometry, and that the assertion above can fail."""
    cfg, specs, draft_layers = _specs_of(k3_pair, "full", monkeypatch)
    target_mla = _check_geometry(specs, draft_layers)
    if layers == "mla_only":
        specs = {n: s for n, s in specs.items() if n in target_mla or n in draft_layers}
    split_patch.remove()
    try:
        groups = _groups(cfg, specs, layout)
    finally:
        split_patch.apply()
    print(*_describe(groups), sep="\n")
    shared = [
        g
        for g in groups
        if set(g.layer_names) & draft_layers and set(g.layer_names) & set(target_mla)
    ]
    assert shared, _describe(groups)
    if layout == "LBNHC":  # one merged MLAAttentionSpec for target + draft: flagged non-causal
        assert shared[0].kv_cache_spec.non_causal_multi_token_decode
    with pytest.raises(AssertionError):
        _assert_apart(groups, target_mla, draft_layers)


def test_patch_leaves_agreeing_specs_alone(plugin):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, UniformTypeKVCacheSpecs

    def spec(flag, bs=64):
        return MLAAttentionSpec(
            block_size=bs,
            num_kv_heads=1,
            head_size=48,
            dtype=torch.bfloat16,
            non_causal_multi_token_decode=flag,
        )

    for flag in (False, True):
        merged = MLAAttentionSpec.merge([spec(flag), spec(flag)])
        assert merged.non_causal_multi_token_decode is flag
        assert UniformTypeKVCacheSpecs.is_uniform_type({"a": spec(flag), "b": spec(flag)})
    with pytest.raises(AssertionError, match="PR #56952"):
        MLAAttentionSpec.merge([spec(False), spec(True)])
    assert not UniformTypeKVCacheSpecs.is_uniform_type({"a": spec(False), "b": spec(True)})
    assert split_patch.mixes_non_causal_mla([spec(False), spec(True)])


def test_single_group_plan_is_refused_with_the_fix_named(k3_pair, plugin, dist_env, monkeypatch):
    """A connector without HMA support disables the hybrid manager (one KV group for all): the
    split is impossible, so start-up stops naming the fix instead of merging."""
    from vllm_dspark_pp.patches.v1_core_kv_cache_planning import MESSAGE

    cfg, specs, draft_layers = _specs_of(k3_pair, "full", monkeypatch, connector="ExampleConnector")
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager
    target_mla = _check_geometry(specs, draft_layers)
    specs = {n: s for n, s in specs.items() if n in target_mla or n in draft_layers}
    with pytest.raises(ValueError) as err:
        _groups(cfg, specs, "LBNHC")
    assert str(err.value) == MESSAGE and "MooncakeConnector" in MESSAGE


@pytest.mark.parametrize("drafter", ["full", "context_only"])
def test_k3_plan_keeps_mooncakes_configured_block_size(
    k3_pair, drafter, plugin, dist_env, monkeypatch
):
    """The Mooncake block-size patch (mooncake_blocks.transfer_block_size) leaves Kimi-K3 alone:
    its real hybrid plan (KDA + target MLA + split draft MLA groups, block-outermost) has one
    block size, so the configured value passes through unchanged."""
    import types

    from vllm_dspark_pp.connectors.mooncake_blocks import group_block_sizes, transfer_block_size

    cfg, specs, _ = _specs_of(k3_pair, drafter, monkeypatch)
    groups = _groups(cfg, specs, "BLNHC")
    plan = types.SimpleNamespace(transfer_groups=tuple(groups))
    sizes = group_block_sizes(plan)
    assert len(sizes) >= 3 and len(set(sizes)) == 1, sizes
    configured = cfg.cache_config.block_size
    assert transfer_block_size(plan, configured) == configured
    assert transfer_block_size(plan, configured + 1) == configured + 1  # vLLM's value, untouched


def test_bundled_k3_pair_merges_without_the_patch(plugin, dist_env, monkeypatch):
    """The bundled trained pair (models/k3-pair) has the geometry that merges: on the H200
    (2026-12-05) its DSpark run with the patch skipped therefore served a merged group, and its
    output, acceptance and logprobs equalled the split run's (docs/results/gpu-dsv4-k3.md, run 5).
    Hybrid KDA + MLA stack, block-outermost layout: the plan the GPU engine makes."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3] / "models" / "k3-pair"
    pair = tiny_mla_targets.TinyPair(str(root / "k3-target"), str(root / "k3-dspark"), "kimi-k3")
    cfg, specs, draft_layers = _specs_of(pair, "full", monkeypatch)
    target_mla = _check_geometry(specs, draft_layers)
    _assert_apart(_groups(cfg, specs, "BLNHC"), target_mla, draft_layers)
    split_patch.remove()
    try:
        merged = _groups(cfg, specs, "BLNHC")
    finally:
        split_patch.apply()
    print(*_describe(merged), sep="\n")
    with pytest.raises(AssertionError):
        _assert_apart(merged, target_mla, draft_layers)
