"""DeepSeek-V4 and V4.1 PD over MooncakeConnector, walked on CPU past start-up: the pre-flight
for tests/gpu/test_dsv4_k3_engine.py::test_pd_over_mooncake[dsv4] (issue 16) and for
tests/gpu/test_pd_pp_producer.py with a PP=2 producer (``DSPARK_GPU_PD_PP_PAIR=dsv4`` / ``dsv41``,
issue 42).

Cases (``CASES``): the tiny DeepSeek-V4 GPU target (``make_tiny_dsv4_pair(gpu=True)``) with a
PP=1 and with a PP=2 producer, and the bundled DeepSeek-V4.1 pair (models/dsv41-pair, what the
H100 served on 2026-12-06) with a PP=2 producer; the decoder is PP=1. ``K3_CASES``: the bundled
Kimi-K3 pair (models/k3-pair: KDA + MLA, layer-outermost LBNHC), a PP=1 and a PP=2 producer, for
its registration and a pulled request page for page; ``QWEN3_CASES`` the same for the trained tiny
Qwen3 pair (models/tiny-pair, float32 as on the GPU; not MLA: MooncakeConnector's LBHNC; vLLM's
``Qwen3ForCausalLM``, the one class on every platform). Each side is built on CPU with a DSpark
speculative config: the prefiller (kv_producer) with our context-KV-only drafter, the decoder
(kv_consumer) with vLLM's full DSpark drafter, each PP stage as that stage (vLLM's CUDA model
class with a stand-in PP group; the drafter on the last stage). Each side's plans come from
vLLM's planner over its stages (the layout resolved from every stage's backends, as the engine
core does: block-outermost for V4 / V4.1, vLLM's default LBNHC for K3, the connector's LBHNC for
Qwen3),
``cache_config.block_size`` is rewritten as EngineCore rewrites it, each stage's KV cache is
allocated by vLLM's ``allocate_kv_cache`` (kernel blocks from ``prepare_kernel_block_sizes``), and
each ``MooncakeConnectorWorker`` / ``MooncakeConnectorScheduler`` is vLLM's (patched) class built
by its own ``__init__``. V4.1's MLA block and its sparse-MLA and indexer kernel blocks are the
H100's (64), which the CPU platform would not pick. Block ids come from vLLM's
``KVCacheManager`` called as the scheduler calls it (prefill with the config's lookahead on the
prefiller; an async remote load without lookahead on the decoder), and the request goes through
both schedulers' ``get_num_new_matched_tokens`` / ``update_state_after_alloc`` /
``build_connector_meta`` and the prefiller's ``request_finished``; the pull through the decoder's
``_build_pull_metadata`` and every prefiller stage's ``record_send_reqs`` /
``send_kv_to_decode`` (regions, block pairing, transfer descriptors, response).

Stood in for: the Mooncake ``TransferEngine`` object (not installed here; a write is a byte copy
between the two CPU buffers), the CUDA device index the worker records, the prefiller's ZMQ
side-channel listener (network only; ``register_kv_caches`` waits for it after the layout is
computed) and the ZMQ socket ``send_kv_to_decode`` answers on. A ``bootstrap_server_address`` in
the producer's extra config keeps its bootstrap server off.

Not covered (GPU only): the transfer engine itself (TCP, registration of CUDA memory), the
bootstrap / side-channel handshake, the decoder's receive loop and its timing in the engine, and
the kernels reading the pulled pages.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch
from support import mla_pairs, tiny_pair
from support import tiny_dsv41 as v41
from support.mla_cpu_config import k3_engine_config

from dspark_dev import tiny_mla_targets as t
from dspark_dev.tiny_dsv4_cpu import construct_on_cpu, engine_config
from vllm_dspark_pp.connectors import mooncake_blocks as mb
from vllm_dspark_pp.connectors import mooncake_regions

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"
PROMPT_LEN = 100
KV_BYTES = 1 << 24  # ~350 blocks of the tiny plan's 47808-byte rows


class FakeTransferEngine:
    """Stands in for ``mooncake.engine.TransferEngine``: registrations are recorded, a write is
    a byte copy (both "engines" live in this process)."""

    def __init__(self):
        self.registered: list[tuple[int, int]] = []
        self.writes: list[tuple[str, list[int], list[int], list[int]]] = []

    def initialize(self, hostname, metadata, protocol, device_name):
        self.hostname = hostname
        self.port = 17000 + len(_ENGINES)
        return 0

    def get_rpc_port(self):
        return self.port

    def batch_register_memory(self, ptrs, lens):
        self.registered.extend(zip(ptrs, lens, strict=True))
        return 0

    def batch_unregister_memory(self, ptrs):
        return 0

    def batch_transfer_sync_write(self, session, src, dst, lengths):
        self.writes.append((session, list(src), list(dst), list(lengths)))
        peer = next(e for e in _ENGINES if f"{e.hostname}:{e.get_rpc_port()}" == session)
        for s, d, n in zip(src, dst, lengths, strict=True):
            # as the real engine, only between registered memory (and never out of bounds here)
            assert self._inside(s, n) and peer._inside(d, n), (s, d, n)
            ctypes.memmove(d, s, n)
        return 0

    def _inside(self, ptr, n):
        return any(b <= ptr and ptr + n <= b + size for b, size in self.registered)


_ENGINES: list[FakeTransferEngine] = []


def _new_engine():
    e = FakeTransferEngine()
    _ENGINES.append(e)
    return e


@pytest.fixture(scope="module")
def mc(plugin):
    import importlib

    return importlib.import_module(MODULE)


def _layer_specs(cfg, ctx):
    """{layer: KV-cache spec} of the KV-cache layers in ``ctx``, as the worker collects them (a
    layer the speculator marks as a draft layer gets a draft spec, v1/worker/gpu/attn_utils.py)."""
    from dataclasses import replace

    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cfg):
        return {
            n: replace(s, is_draft=True) if getattr(layer, "is_draft_layer", False) else s
            for n, layer in ctx.items()
            if hasattr(layer, "get_kv_cache_spec") and (s := layer.get_kv_cache_spec(cfg))
        }


def _build_dsv4(cfg, cls, rank, pp, monkeypatch):
    import vllm.models.deepseek_v4.nvidia.model as dsv4

    with v41.as_stage(monkeypatch, rank, pp):
        construct_on_cpu(cfg, cls or dsv4.DeepseekV4ForCausalLM, monkeypatch)


class _Hopper:
    """The platform as an H100 answers V4.1's sparse MLA and indexer backends: capability family
    9.x (their kernel block is 64 there, 128 elsewhere: deepseek_v41/sparse_mla.py,
    v1/attention/backends/mla/indexer.py); every other answer is the real one's."""

    def __init__(self, real):
        self._real = real

    def is_device_capability_family(self, capability, device_id=0):
        return capability // 10 == 9

    def __getattr__(self, name):
        return getattr(self._real, name)


#: the KV-cache block of V4.1's MLA layers on the H100 (pd_decode.log of 2026-12-06: "kv cache
#: group sizes (32, 32, 32, 32, 64)"); the CPU platform would force its own MLA kernel's 16
DSV41_H100_BLOCK = 64


def _as_h100(fam, monkeypatch):
    if fam == "dsv41":
        import vllm.models.deepseek_v41.sparse_mla as sparse_mla
        import vllm.v1.attention.backends.mla.indexer as indexer

        for module in (sparse_mla, indexer):
            monkeypatch.setattr(module, "current_platform", _Hopper(module.current_platform))


def _build_dsv41(cfg, cls, rank, pp, monkeypatch):
    if cls is None:
        v41.build_stage(cfg, rank, pp, monkeypatch)
    else:
        v41.build_drafter(cfg, cls, monkeypatch)


def _build_k3(cfg, cls, rank, pp, monkeypatch):
    """vLLM's Kimi-K3 target (``KimiLinearForCausalLM``: KDA + MLA) as PP stage ``rank``, or a
    DSpark drafter with its layers marked as the speculator marks them (speculator.py); the
    constructor's CUDA stream and GEMM-AR kernel stood in for as in
    tests/unit/producer/test_k3_kv_group_split.py."""
    import vllm.models.kimi_k3.nvidia.model as k3_model
    from vllm.config import set_current_vllm_config

    cfg.compilation_config.static_forward_context = {}
    monkeypatch.setenv("VLLM_KIMI_K3_GEMM_AR", "0")
    with monkeypatch.context() as m, set_current_vllm_config(cfg), torch.device("cpu"):
        m.setattr(torch.cuda, "Stream", lambda *a, **k: None)
        with v41.as_stage(monkeypatch, rank, pp):
            model = (cls or k3_model.KimiLinearForCausalLM)(vllm_config=cfg, prefix="")
    if cls is not None:
        ctx = cfg.compilation_config.static_forward_context
        for name in model.get_draft_kv_cache_layer_names():
            ctx[name].is_draft_layer = True


def _build_qwen3(cfg, cls, rank, pp, monkeypatch):
    """vLLM's ``Qwen3ForCausalLM`` (the tiny pair's target) as PP stage ``rank``, or a Qwen3
    DSpark drafter with its layers marked as the speculator marks them (speculator.py)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

    cfg.compilation_config.static_forward_context = {}
    with set_current_vllm_config(cfg), torch.device("cpu"), v41.as_stage(monkeypatch, rank, pp):
        model = (cls or Qwen3ForCausalLM)(vllm_config=cfg, prefix="")
    if cls is not None:
        ctx = cfg.compilation_config.static_forward_context
        for name in model.get_draft_kv_cache_layer_names():
            ctx[name].is_draft_layer = True


def _families():
    """family -> (builder, the decoder's drafter class, the producer's context-KV-only class,
    engine arguments)."""
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM as qwen3_full
    from vllm.models.deepseek_v4.nvidia.dspark import DSparkDeepseekV4ForCausalLM as v4_full
    from vllm.models.deepseek_v41.nvidia.dspark import DSparkDeepseekV4ForCausalLM as v41_full
    from vllm.models.kimi_k3.nvidia.dspark_mla import K3DSparkForCausalLM as k3_full

    from vllm_dspark_pp.producer import deepseek_v4, deepseek_v41, kimi_k3, qwen3

    return {
        "dsv4": (_build_dsv4, v4_full, deepseek_v4.DSparkDeepseekV4ContextKVForCausalLM, {}),
        "dsv41": (
            _build_dsv41,
            v41_full,
            deepseek_v41.DSparkDeepseekV41ContextKVForCausalLM,
            mla_pairs.engine_kwargs("dsv41"),
        ),
        "k3": (_build_k3, k3_full, kimi_k3.K3DSparkContextKVForCausalLM, {}),
        "qwen3": (_build_qwen3, qwen3_full, qwen3.Qwen3DSparkContextKVForCausalLM, {}),
    }


def _side(pair, fam, role, pp, monkeypatch, force_layout=None):
    """One PD side at PP=``pp`` as its engine core plans it: each stage's model built as that
    stage (vLLM's CUDA classes on CPU; the drafter on the last stage), the layout resolved from
    every stage's backends (or ``force_layout``, a control's), vLLM's planner over the stages,
    the block-size rewrite. Returns (config, [(stage plan, stage layers' specs, stage drafter's
    specs)], scheduler plan)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )

    build, full_cls, context_cls, engine_kw = _families()[fam]
    drafter_cls = context_cls if role == "kv_producer" else full_cls
    extra = {"bootstrap_server_address": "127.0.0.1:1"} if role == "kv_producer" else {}
    common = dict(
        pipeline_parallel_size=pp,
        distributed_executor_backend="mp",
        kv_transfer_config={
            "kv_connector": "MooncakeConnector",
            "kv_role": role,
            "kv_connector_extra_config": extra,
        },
        **engine_kw,
    )
    if fam == "k3":  # the GPU deployment's config on every CPU; the trained block, bf16 KV
        k = mla_pairs.block_size(pair, fam)
        cfg = k3_engine_config(pair, speculative_config=pair.speculative_config(k), **common)
    elif fam == "qwen3":  # the GPU runs' dtype (tests/gpu/gpu_common.py PAIR_DTYPE)
        cfg = engine_config(pair, dtype="float32", speculative_config=pair.spec, **common)
    else:
        cfg = engine_config(
            pair,
            kv_cache_dtype="fp8_ds_mla",
            speculative_config=pair.speculative_config(4),
            **common,
        )
    if fam == "dsv41":
        cfg.cache_config.block_size = DSV41_H100_BLOCK
    ctx_all: dict = {}
    stages = []
    for rank in range(pp):
        build(cfg, None, rank, pp, monkeypatch)
        ctx = dict(cfg.compilation_config.static_forward_context)
        draft_specs = {}
        if rank == pp - 1:
            build(cfg, drafter_cls, rank, pp, monkeypatch)
            draft_ctx = cfg.compilation_config.static_forward_context
            draft_specs = _layer_specs(cfg, draft_ctx)
            ctx.update(draft_ctx)
        ctx_all.update(ctx)
        stages.append(({**_layer_specs(cfg, ctx)}, draft_specs))
    cfg.compilation_config.static_forward_context = ctx_all
    # MLA: MooncakeConnector leaves the layout to the backends; otherwise it asks for LBHNC
    assert cfg.model_config.use_mla == (fam != "qwen3")
    specs = [s for s, _ in stages]
    supported = [
        [x.name for x in get_supported_kv_cache_layouts({ctx_all[n].get_attn_backend() for n in s})]
        for s in specs
    ]
    # None of K3's CUDA backends (MLA, KDA) declares a layout, nor does Qwen3's (TRITON_ATTN for
    # the float32 pair on the H100, FLASH_ATTN in bfloat16); the CPU's do
    if fam in ("k3", "qwen3"):
        supported = [[x.name for x in get_supported_kv_cache_layouts(())]] * pp
    if force_layout is not None:
        cfg.cache_config.kv_cache_layout = force_layout  # resolution then keeps it
    layout = resolve_kv_cache_layout(cfg, supported, [x for s in specs for x in s.values()])
    # K3: vLLM's default LBNHC; Qwen3: the connector's LBHNC (the CPU backend's only one too)
    expected = {"k3": "LBNHC", "qwen3": "LBHNC"}.get(fam)
    if force_layout is not None:
        assert layout.name == force_layout
    else:
        assert layout.name == expected if expected else layout.is_block_outermost, layout
    with set_current_vllm_config(cfg):
        groups = get_global_kv_cache_groups(cfg, specs)
        plans = get_kv_cache_configs(cfg, specs, [KV_BYTES] * pp, groups)
    sched_cfg = generate_scheduler_kv_cache_config(plans)
    # the engine core's rewrite: the smallest prefix-cacheable group block
    cfg.cache_config.block_size = min(
        g.kv_cache_spec.block_size
        for g in sched_cfg.kv_cache_groups
        if g.kv_cache_spec.prefix_cacheable
    )
    # then the hash block and the cache-hit alignment, into every plan (vllm/v1/engine/core.py)
    sched_block, hash_block = resolve_kv_cache_block_sizes(sched_cfg, cfg)
    align = resolve_cache_hit_alignment_tokens(sched_cfg, cfg, sched_block, hash_block)
    for plan in (*plans, sched_cfg):
        plan.hash_block_size, plan.cache_hit_alignment_tokens = hash_block, align
    return cfg, [(plan, s, d) for plan, (s, d) in zip(plans, stages, strict=True)], sched_cfg


def _kernel_block_sizes(cfg, kv_cfg):
    """vLLM's ``prepare_kernel_block_sizes`` with each group's layers' backends."""
    from types import SimpleNamespace

    from vllm.v1.worker.utils import prepare_kernel_block_sizes

    ctx = cfg.compilation_config.static_forward_context
    attn_groups = [
        [
            SimpleNamespace(backend=ctx[n].get_attn_backend(), kv_cache_spec=g.kv_cache_spec)
            for n in g.layer_names[:1]
        ]
        for g in kv_cfg.kv_cache_groups
    ]
    return prepare_kernel_block_sizes(kv_cfg, attn_groups)


def _allocate(cfg, kv_cfg):
    from vllm.v1.worker.utils import allocate_kv_cache

    return allocate_kv_cache(
        kv_cfg,
        torch.device("cpu"),
        cfg.cache_config.get_resolved_kv_cache_layout(),
        _kernel_block_sizes(cfg, kv_cfg),
    )


def _worker(mc, cfg, kv_cfg, monkeypatch, engine_id, rank=0, pp=1):
    from vllm.config import set_current_vllm_config

    monkeypatch.setattr(mc, "TransferEngine", _new_engine)
    # the worker records its CUDA device for the sender threads; CPU has none
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(mc.current_platform, "set_device", lambda *a: None, raising=False)
    with set_current_vllm_config(cfg), v41.as_stage(monkeypatch, rank, pp):
        w = mc.MooncakeConnectorWorker(cfg, engine_id, kv_cfg)
    assert (w.pp_rank, w.pp_size) == (rank, pp)
    return w


def _register(w, caches):
    """vLLM's register_kv_caches; on the prefiller the side-channel listener (ZMQ, network only)
    is replaced by one that reports ready."""
    if not w.is_kv_consumer:

        async def listener(ready_event):
            ready_event.set()

        w._mooncake_sender_listener = listener
    w.register_kv_caches(caches)


#: case -> (family, producer PP size). The decoder is PP=1. ``dsv41-pp2`` is the H100 failure of
#: 2026-12-06 (group pd_pp_dsv41): the bundled V4.1 pair, a PP=2 producer.
CASES = {"dsv4-pp1": ("dsv4", 1), "dsv4-pp2": ("dsv4", 2), "dsv41-pp2": ("dsv41", 2)}
#: Kimi-K3 (the bundled pair, models/k3-pair; KDA + MLA): the PD pairs of the H100 run that
#: passed before the split, a PP=1 and a PP=2 producer into a PP=1 decoder. On CPU its MLA groups'
#: 64-token blocks are four 16-token kernel blocks each (the CPU MLA kernel's block)
K3_CASES = {"k3-pp1": ("k3", 1), "k3-pp2": ("k3", 2)}
#: the trained tiny Qwen3 pair (models/tiny-pair): the shapes of its GPU PD runs made before the
#: region patch, a PP=1 producer (group pd_mooncake) and a PP=2 one (pd_pp), into a PP=1 decoder
QWEN3_CASES = {"qwen3-pp1": ("qwen3", 1), "qwen3-pp2": ("qwen3", 2)}
ALL_CASES = {**CASES, **K3_CASES, **QWEN3_CASES}


def _pair(fam, tmp_path_factory):
    if fam == "dsv4":
        return t.make_tiny_dsv4_pair(tmp_path_factory.mktemp("mc-dsv4-pd"), gpu=True)
    if fam == "qwen3":
        ok, why = tiny_pair.available()
        if not ok:
            pytest.skip(why)
        return SimpleNamespace(target=tiny_pair.TARGET, spec=tiny_pair.spec_config())
    pair, why = mla_pairs.trained_pair(fam)
    if pair is None:
        pytest.skip(why)
    return pair


def _build_pd(mc, fam, pp, tmp_path_factory, monkeypatch, force_layout=None):
    """Both sides, built, planned, allocated, their (patched) workers registered: the producer
    ``p`` with a stage per PP rank, the decoder ``d`` with one (``force_layout``: ``_side``)."""
    import vllm.model_executor.models.utils as vllm_utils

    # vLLM caches each model's PP-missing layers by id(model): a stage built here could get the
    # id of an earlier (freed) stage and inherit its missing layers
    monkeypatch.setattr(vllm_utils, "_model_to_pp_missing_layer_names", {})
    pair = _pair(fam, tmp_path_factory)
    _as_h100(fam, monkeypatch)
    out = {}
    for name, role, size in (("p", "kv_producer", pp), ("d", "kv_consumer", 1)):
        cfg, stages, sched_cfg = _side(pair, fam, role, size, monkeypatch, force_layout)
        built = []
        for rank, (kv_cfg, specs, draft) in enumerate(stages):
            caches = _allocate(cfg, kv_cfg)
            w = _worker(mc, cfg, kv_cfg, monkeypatch, f"engine-{name}", rank, size)
            _register(w, caches)
            built.append(dict(kv=kv_cfg, caches=caches, w=w, specs=specs, draft=draft))
        s = mc.MooncakeConnectorScheduler(cfg, f"engine-{name}", sched_cfg)
        out[name] = dict(cfg=cfg, stages=built, sched_kv=sched_cfg, s=s)
    return out


@pytest.fixture(scope="module", params=list(CASES))
def pd(request, mc, tmp_path_factory, plugin, dist_env):
    fam, pp = ALL_CASES[request.param]
    with pytest.MonkeyPatch.context() as m:
        out = _build_pd(mc, fam, pp, tmp_path_factory, m)
        out["case"] = request.param
        yield out
        for side in ("p", "d"):
            for stage in out[side]["stages"]:
                stage["w"].shutdown()


def _only(side):
    (stage,) = side["stages"]
    return stage


@pytest.mark.parametrize("pd", ["dsv4-pp1"], indirect=True)
def test_both_sides_plan_the_same_groups_with_the_draft_groups(pd):
    p, d = _only(pd["p"]), _only(pd["d"])
    assert (
        sorted(p["draft"])
        == sorted(d["draft"])
        == [
            "model.layers.2.attn.swa_cache",
            "model.layers.3.attn.swa_cache",
        ]
    )
    assert p["draft"] == d["draft"]  # the context-only drafter's specs are vLLM's
    assert [g.layer_names for g in p["kv"].kv_cache_groups] == [
        g.layer_names for g in d["kv"].kv_cache_groups
    ]
    assert [g.kv_cache_spec for g in p["kv"].kv_cache_groups] == [
        g.kv_cache_spec for g in d["kv"].kv_cache_groups
    ]
    # the draft groups are SWA 64: the transfer block stays the compressed MLA block
    assert sorted(set(mb.group_block_sizes(p["kv"]))) == [4, 8, 64, 256]
    assert pd["p"]["cfg"].cache_config.block_size == 4  # the engine core's rewrite
    for side in (pd["p"], pd["d"]):
        w = _only(side)["w"]
        assert mb.transfer_block_size(_only(side)["kv"], 4) == 256
        assert (w.block_size, w._physical_blocks_per_logical_kv_block) == (256, 1)
        assert side["s"].block_size == 256


def _regions(w):
    return list(
        zip(
            w.kv_caches_base_addr,
            w.block_len_per_layer,
            w.kv_block_len_per_layer,
            w.registered_layer_names,
            w.registered_group_indices,
            w.region_shared_groups,
            strict=True,
        )
    )


def test_registration_names_every_layer_view_once_by_its_own_layer(pd):
    """Every layer of every transfer group has exactly one registered region: its page (address,
    row, page bytes), named by that layer, with that layer's group alone. Several groups' views
    of one page share its address (the block-outermost packing overlays the groups), each still
    a region of its own (the patch; vLLM registers them once under the first layer's name). Each
    region is block-major over the stage's one backing allocation."""
    for side in (pd["p"], pd["d"]):
        for stage in side["stages"]:
            w, kv = stage["w"], stage["kv"]
            buf = next(iter(stage["caches"].values())).untyped_storage()
            assert w.seen_base_addresses == [buf.data_ptr()]  # one allocation, registered whole
            assert w._kv_data_lens == [buf.nbytes()]
            regions = _regions(w)
            assert sorted(r[3] for r in regions) == sorted(w._layer_specs)
            for name, spec in w._layer_specs.items():
                tensor = next(tt for tt in kv.kv_cache_tensors if name in tt.layers)
                # the transfer length is the view's bytes per block (the page without padding)
                page = stage["caches"][name][0]
                assert page.is_contiguous() and page.nbytes <= spec.page_size_bytes, name
                gid = kv.transfer_group_index_by_layer[name]
                key = (buf.data_ptr() + tensor.offset, tensor.block_stride, page.nbytes)
                (hit,) = [r for r in regions if r[3] == name]
                assert hit == (*key, name, gid, (gid,)), (hit, key, gid)
                assert spec.page_size_bytes <= tensor.block_stride


def _pull_meta(mc, d, pulls, include_layout=True):
    """The decoder's pull metadata as it crosses the side channel."""
    meta = _only(d)["w"]._build_pull_metadata(pulls, include_layout=include_layout)
    return mc.msgspec.msgpack.Decoder(mc.MooncakeXferMetadata).decode(
        mc.msgspec.msgpack.Encoder().encode(meta)
    )


def _views(stage):
    """The stage's layer views (address, row, page, group), as registered."""
    w = stage["w"]
    return mooncake_regions.page_views(
        {n: c for n, c in stage["caches"].items() if n in w._layer_specs},
        w.kv_cache_config.transfer_group_index_by_layer,
    )


def _covered(views, regions):
    """The layers whose view lies inside one of ``regions`` (a region of the view's group, or a
    shared one listing it): what a transfer of those regions moves."""
    return {
        v.layer
        for v in views
        for r in regions
        if r.block_len == v.row_bytes
        and r.base_addr <= v.address
        and v.address + v.page_bytes <= r.base_addr + r.kv_block_len
        and (v.group == r.group_index or v.group in r.shared_group_ids)
    }


def _stage_pairs(mc, pd):
    """What each producer stage makes of the decoder's layout (vLLM's
    ``_prepare_transfer_regions``: pairing by layer name, PP sizes that differ included):
    [(stage, local regions, remote regions, error)]."""
    meta = _pull_meta(mc, pd["d"], {})
    out = []
    for stage in pd["p"]["stages"]:
        local, remote, err = stage["w"]._prepare_transfer_regions(meta)
        out.append((stage, local, remote, err))
    return out


def test_producer_stages_pair_every_decoder_view_exactly_once(mc, pd):
    """No producer stage refuses the decoder's layout, each stage sends every view of its own
    layers into the decoder view of the same layer and group, and the stages together fill every
    decoder view (the decoder gets each layer's KV from the stage that computed it)."""
    d_views = _views(_only(pd["d"]))
    filled: list[str] = []
    for rank, (stage, local, remote, err) in enumerate(_stage_pairs(mc, pd)):
        assert err is None, f"stage {rank}: {err}"
        for lr, rr in zip(local, remote, strict=True):
            assert (lr.layer_name, lr.group_index) == (rr.layer_name, rr.group_index), rank
        held = set(stage["specs"])
        assert _covered(_views(stage), local) == held, rank
        assert _covered(d_views, remote) == held, rank
        filled += sorted(held)
    assert sorted(filled) == sorted(v.layer for v in d_views)  # each layer once


@pytest.mark.parametrize("case", ["dsv4-pp2", "dsv41-pp2"])
def test_control_without_the_split_stage_0_is_refused_and_stage_1_drops_views(
    mc, case, tmp_path_factory, plugin, dist_env
):
    """Control, vLLM's registration alone (the split turned off): stage 0 is refused with the
    H100's message (pd_decode.log, 2026-12-06, V4.1), and stage 1 pairs without complaint but
    leaves out the views it registered under a shared region the decoder has no name for."""
    fam, pp = CASES[case]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(mooncake_regions, "split_shared_regions", lambda *a, **k: 0)
        pd = _build_pd(mc, fam, pp, tmp_path_factory, m)
        try:
            (s0, _, _, err0), (s1, local1, _, err1) = _stage_pairs(mc, pd)
        finally:
            for side in ("p", "d"):
                for stage in pd[side]["stages"]:
                    stage["w"].shutdown()
    prefix = "language_model." if fam == "dsv41" else ""
    swa0 = f"{prefix}model.layers.0.attn.swa_cache"
    g0 = s0["kv"].transfer_group_index_by_layer[swa0]
    assert err0 == (
        f"Mooncake registered group index mismatch for {swa0}: producer={g0}, consumer=-1."
    )
    assert err1 is None
    dropped = set(s1["specs"]) - _covered(_views(s1), local1)
    assert dropped == {
        f"{prefix}model.layers.1.attn.swa_cache",
        "model.layers.2.attn.swa_cache",
        "model.layers.3.attn.swa_cache",
    }


def _request(rid, params):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    r = Request(rid, list(range(10, 10 + PROMPT_LEN)), SamplingParams(max_tokens=1), None)
    r.kv_transfer_params = params
    return r


def _kv_manager(side):
    """vLLM's scheduler-side KV-cache manager for this side's plan, built as the scheduler
    builds it (vllm/v1/core/sched/scheduler.py)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    cfg = side["cfg"]
    sched_cfg = side["sched_kv"]  # generate_scheduler_kv_cache_config over the stages' plans
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(sched_cfg, cfg)
    return KVCacheManager(
        kv_cache_config=sched_cfg,
        max_model_len=cfg.model_config.max_model_len,
        enable_caching=cfg.cache_config.enable_prefix_caching,
        scheduler_block_size=scheduler_block,
        hash_block_size=hash_block,
    )


def _prefill_on_p(p, preq):
    """The prefiller's scheduler for a fresh prompt: the prefill step's allocation (with the
    config's lookahead, as for any new request), the step's computed tokens, then what
    ``_connector_finished`` hands to ``request_finished``."""
    kvm = _kv_manager(p)
    new = kvm.allocate_slots(
        preq,
        preq.num_prompt_tokens,
        num_lookahead_tokens=p["cfg"].num_lookahead_tokens,
    )
    assert new is not None
    p["s"].update_state_after_alloc(preq, kvm.get_blocks(preq.request_id), 0)
    preq.num_computed_tokens = preq.num_prompt_tokens
    kvm.remove_skipped_blocks(
        request_id=preq.request_id,
        processed_computed_tokens=preq.num_computed_tokens,
        num_prompt_tokens=preq.num_prompt_tokens,
    )
    return kvm, kvm.get_block_ids_for_computed_tokens(
        request_id=preq.request_id, num_computed_tokens=preq.num_computed_tokens
    )


def _alloc_on_d(d, dreq, n_ext):
    """The decoder's scheduler for an async remote load: no forward pass, so no lookahead
    (scheduler.py: ``effective_lookahead_tokens``), blocks cached later."""
    kvm = _kv_manager(d)
    new = kvm.allocate_slots(
        dreq,
        0,
        num_lookahead_tokens=0,
        num_external_computed_tokens=n_ext,
        delay_cache_blocks=True,
    )
    assert new is not None
    d["s"].update_state_after_alloc(dreq, kvm.get_blocks(dreq.request_id), n_ext)
    return kvm


class _Sock:
    """Stands in for the prefiller's ZMQ ROUTER socket: keeps the responses."""

    def __init__(self):
        self.sent: list[tuple[bytes, bytes]] = []

    async def send_multipart(self, parts):
        self.sent.append(tuple(parts))


def _run(w, coro, loop_name):
    import asyncio

    return asyncio.run_coroutine_threadsafe(coro, getattr(w, loop_name)).result(timeout=60)


def _backing(caches):
    """The one backing allocation under every layer's view, as flat bytes."""
    (storage,) = {
        c.untyped_storage().data_ptr(): c.untyped_storage() for c in caches.values()
    }.values()
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _tensor_of(kv, name):
    """The ``KVCacheTensor`` that places layer ``name``, and the layer's slot in it."""
    (tensor,) = [x for x in kv.kv_cache_tensors if name in x.layers]
    return tensor, tensor.layers.index(name)


def _page(caches, kv, name, block):
    """Layer ``name``'s page of (scheduler) block ``block`` as flat bytes of the backing
    allocation, where the plan puts it: from ``offset + slot * layer_stride + block *
    block_stride`` (``KVCacheTensor``), as many bytes as the layer's view holds per block. That is
    the block-outermost row slice (DeepSeek-V4: each block a row of all layers' pages) and the
    layer-outermost page alike (Kimi-K3's LBNHC: each layer a run of its pages). The view's first
    axis counts kernel blocks, not blocks, when a group's kernel block splits its block (K3's MLA
    on CPU: block 64 in four 16-token kernel blocks; ``prepare_kernel_block_sizes``), so the
    view's bytes of block ``b`` are kernel blocks ``ratio * b`` to ``ratio * b + ratio - 1``:
    vLLM's ``group_kernel_blocks`` regroups them, and that slice must be this very span (what the
    kernels read is what is compared)."""
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    tensor, slot = _tensor_of(kv, name)
    n = kv.num_blocks_of(tensor)
    view = caches[name]
    page_bytes = view.nbytes // n
    start = tensor.offset + slot * tensor.layer_stride + block * tensor.block_stride
    buf = _backing(caches)
    by_block = group_kernel_blocks(view, n)[block]
    assert by_block.is_contiguous() and by_block.nbytes == page_bytes, name
    assert by_block.data_ptr() == buf.data_ptr() + start, (name, block)
    return buf[start : start + page_bytes]


def _pages(caches, kv, group_ids):
    """{(layer, block id): bytes of that layer's page} for the given block ids per group."""
    return {
        (name, b): _page(caches, kv, name, b).clone()
        for gi, g in enumerate(kv.kv_cache_groups)
        for name in g.layer_names
        for b in group_ids[gi]
    }


def _block_spans(kv, block):
    """[(start, length)]: the bytes of ``block`` in the backing allocation, every layer's, padding
    included. Block-outermost (``block_stride`` > ``layer_stride``): the block's row, which vLLM
    may copy whole. Layer-outermost: each layer slot's page (``block_stride`` long)."""
    spans = set()
    for x in kv.kv_cache_tensors:
        if x.block_stride > x.layer_stride:
            assert x.offset < x.block_stride, x  # rows start at the allocation's start
            spans.add((block * x.block_stride, x.block_stride))
        else:
            spans.update(
                (x.offset + slot * x.layer_stride + block * x.block_stride, x.block_stride)
                for slot in range(len(x.layers))
            )
    return sorted(spans)


def _pull(mc, pd, tid):
    """One 100-token request through both schedulers: P prefills and finishes (max_tokens 1),
    every P stage's worker records the send, D schedules the remote prefill. Returns (P's block
    ids per group, D's pull, [(P block, D block)] per group)."""
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.request import RequestStatus

    p, d = pd["p"], pd["d"]
    preq = _request("p-req", {"do_remote_decode": True, "transfer_id": tid})
    p["s"].on_new_request(preq)
    assert p["s"].get_num_new_matched_tokens(preq, 0) == (0, False)
    _, p_ids = _prefill_on_p(p, preq)
    step1 = p["s"].build_connector_meta(None)  # the prefill step: P's workers expect a send
    assert step1.reqs_to_send == {"p-req": (tid, [])}
    for stage in p["stages"]:
        _run(stage["w"], stage["w"].record_send_reqs(step1), "sender_loop")
    preq.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay_free, _ = p["s"].request_finished(preq, tuple(p_ids))
    assert delay_free
    p_meta = p["s"].build_connector_meta(None)
    (transfer_id, p_send_ids) = p_meta.reqs_to_send["p-req"]
    assert transfer_id == tid
    assert len(p_send_ids) == len(p["sched_kv"].kv_cache_groups)
    for stage in p["stages"]:
        _run(stage["w"], stage["w"].record_send_reqs(p_meta), "sender_loop")

    dreq = _request(
        "d-req",
        {
            "do_remote_prefill": True,
            "remote_engine_id": "engine-p",
            "remote_bootstrap_addr": "127.0.0.1:1",
            "transfer_id": tid,
        },
    )
    d["s"].on_new_request(dreq)
    n_ext, load_async = d["s"].get_num_new_matched_tokens(dreq, 0)
    # With a sliding-window replay (V4.1's prefix_replay_tokens) or a recurrent state (K3's KDA
    # layers, Mamba groups) P prefills and D loads all but the last prompt token, which D
    # recomputes (the scheduler's on_new_request and _get_remote_prefill_token_count); neither
    # in the DeepSeek-V4 plans.
    loaded = PROMPT_LEN - 1 if d["s"]._bounded_replay or d["s"]._has_mamba else PROMPT_LEN
    assert d["s"]._bounded_replay == (pd["case"].startswith("dsv41"))
    assert d["s"]._has_mamba == p["s"]._has_mamba == (pd["case"].startswith("k3"))
    assert preq.num_prompt_tokens == loaded
    assert (n_ext, load_async) == (loaded, True)
    _alloc_on_d(d, dreq, n_ext)
    pull = d["s"].build_connector_meta(None).reqs_to_recv["engine-p"]["d-req"]
    # Per group, D asks for the blocks it still needs (sliding-window and compressor-state
    # groups: only the window's); P holds at least those, and vLLM pairs D's with P's last ones
    # (_build_transfer_params). What P holds before them must be out of its window (null blocks),
    # and nothing D needs may pair with a null block.
    pairs = []
    for gi, (pg, dg) in enumerate(zip(p_send_ids, pull.local_block_ids, strict=True)):
        assert 0 < len(dg) <= len(pg), (gi, pg, dg)
        tail = pg[len(pg) - len(dg) :]
        assert all(b == 0 for b in pg[: len(pg) - len(dg)]), (gi, pg, dg)
        assert 0 not in tail and 0 not in dg, (gi, pg, dg)
        pairs.append(list(zip(tail, dg, strict=True)))
    # full attention (the transfer block's groups): the whole prompt
    full = mb.attention_block_size(p["sched_kv"])
    for gi, g in enumerate(p["sched_kv"].kv_cache_groups):
        if g.kv_cache_spec.block_size == full and not isinstance(g.kv_cache_spec, MambaSpec):
            assert len(pairs[gi]) == -(-loaded // g.kv_cache_spec.block_size)
    return p_send_ids, pull, pairs


def _send_from_every_stage(mc, pd, pull):
    """D's pull metadata (with its layout) to every P stage's real send path (D pulls from each
    stage of a PP producer); bytes move by memmove. Returns each stage's response."""
    meta = _pull_meta(mc, pd["d"], {"d-req": pull})
    out = []
    for stage in pd["p"]["stages"]:
        sock = _Sock()
        _run(stage["w"], stage["w"].send_kv_to_decode(b"d", sock, meta), "sender_loop")
        (resp,) = [
            mc.msgspec.msgpack.Decoder(mc.MooncakeXferResponse).decode(m) for _, m in sock.sent
        ]
        out.append(resp)
    return out


def _transfer(mc, pd, tid):
    """One 100-token request: P prefills and finishes, D pulls from every P stage (P's pages
    random bytes, D's zeros). Returns what a correct transfer is judged by: the stages' refusals
    [(stage, message)], the layers with a D page in D's pull that differs from the paired page of
    the P stage holding that layer (in order, after the sliding-window clipping both schedulers
    apply), the offsets of D's bytes that changed outside the pulled blocks (every layer's page
    of each pulled block id, ``_block_spans``; the first 20), whether any pulled page changed at
    all, and the (P block, D block) pairs per group."""
    p, d = pd["p"], pd["d"]
    p_send_ids, pull, pairs = _pull(mc, pd, tid)
    gen = torch.Generator().manual_seed(0)
    for stage in p["stages"]:
        buf = _backing(stage["caches"])
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))
    dst_stage = _only(d)
    d_buf = _backing(dst_stage["caches"])
    d_buf.zero_()
    d_before = d_buf.clone()
    responses = _send_from_every_stage(mc, pd, pull)

    src = {}
    for stage in p["stages"]:
        src.update(_pages(stage["caches"], stage["kv"], p_send_ids))
    dst_kv = dst_stage["kv"]
    dst = _pages(dst_stage["caches"], dst_kv, pull.local_block_ids)
    changed = d_buf != d_before
    touched = torch.zeros_like(changed)
    wrong = set()
    for gi, g in enumerate(dst_kv.kv_cache_groups):
        for name in g.layer_names:
            for pb, db in pairs[gi]:
                if not torch.equal(dst[(name, db)], src[(name, pb)]):
                    wrong.add(name)
                start = _page(dst_stage["caches"], dst_kv, name, db).data_ptr() - d_buf.data_ptr()
                touched[start : start + dst[(name, db)].numel()] = True
    # Each block id is owned by one group at a time, so vLLM may copy all of a pulled block's
    # bytes (a block-outermost row with its padding); no other byte may change.
    pulled = torch.zeros_like(changed)
    for start, n in {s for g in pairs for _, db in g for s in _block_spans(dst_kv, db)}:
        pulled[start : start + n] = True
    errors = [
        (r, resp.err_msg)
        for r, resp in enumerate(responses)
        if resp.status != mc.MooncakeXferResponseStatus.FINISH or resp.err_reqs
    ]
    if not errors:
        for resp in responses:
            assert resp.ok_reqs == ["d-req"], resp
        for stage in p["stages"]:
            assert "p-req" in stage["w"].finished_sending_reqs
    return dict(
        pairs=pairs,
        errors=errors,
        wrong=sorted(wrong),
        outside=(changed & ~pulled).nonzero().flatten()[:20].tolist(),
        any_pulled_changed=bool(changed[touched].any()),
    )


@pytest.mark.parametrize("pd", [*CASES, *K3_CASES, *QWEN3_CASES], indirect=True)
def test_pd_request_transfers_every_group_page_for_page(mc, pd):
    """One 100-token request (``_transfer``): every P stage answers FINISH, every D page of
    every layer and group in D's pull equals the page of the P stage that holds that layer, and
    no byte of D's cache outside the pulled blocks changes. Pages are where the plan puts them in
    either layout (``_page``): DeepSeek-V4 / V4.1 block-outermost rows, Kimi-K3's layer-outermost
    LBNHC pages, whose MLA groups' 64-token blocks are four 16-token kernel blocks each, the tiny
    Qwen3 pair's layer-outermost LBHNC pages (one group: target and drafter layers).

    Controls (the check fails on a broken transfer):
    ``test_control_k3_kernel_blocks_not_expanded_fails_the_mla_pages`` (P sends kernel block
    ``b`` for block ``b``: every MLA layer's pages differ) and
    ``test_control_skipped_region_fails_its_layer`` (K3, Qwen3: P leaves one layer's region out:
    that layer's pages differ)."""
    out = _transfer(mc, pd, "xfer-1")
    assert not out["errors"], f"P stages refused the pull: {out['errors']}"
    assert not out["wrong"], f"D pages that differ from P's after every stage answered: {out}"
    assert not out["outside"], f"bytes outside the pulled blocks changed, offsets {out}"
    assert out["any_pulled_changed"]


def _no_shared_region(mc, case, tmp_path_factory, force_layout=None, check_pairing=True):
    """A PD of ``case`` built afresh (``force_layout``: ``_side``) and what each stage (producer
    stages, then the decoder) registered: the shared regions (group -1: name, groups) vLLM
    registered before the split, the number the split took apart, the regions after it, whether
    they name the stage's layers each once (``names``) and whether each is one layer's own view
    (``own``: that layer's address, row and page, its group alone); the stages' KV-cache groups
    (layer names) and each side's layout. ``check_pairing``: the producer stages' pairing with
    the decoder is checked (``test_producer_stages_pair_every_decoder_view_exactly_once``)."""
    fam, pp = ALL_CASES[case]
    splits: list[int] = []
    vllm_shared: list[list[tuple]] = []
    real = mooncake_regions.split_shared_regions

    def counted(worker, *a, **k):
        vllm_shared.append(
            [(r[3], r[5]) for r in _regions(worker) if r[4] == mc._SHARED_REGION_GROUP_ID]
        )
        splits.append(real(worker, *a, **k))
        return splits[-1]

    with pytest.MonkeyPatch.context() as m:
        m.setattr(mooncake_regions, "split_shared_regions", counted)
        pd = _build_pd(mc, fam, pp, tmp_path_factory, m, force_layout)
        stages = [s for side in ("p", "d") for s in pd[side]["stages"]]
        try:
            own = []
            for stage in stages:
                w, caches = stage["w"], stage["caches"]
                groups = w.kv_cache_config.transfer_group_index_by_layer
                views = {
                    (c.data_ptr(), c.stride(0) * c.element_size(), c[0].nbytes, n, groups[n])
                    for n, c in caches.items()
                    if n in w._layer_specs
                }
                regions = _regions(w)
                own.append(
                    len(regions) == len(views)
                    and {(*r[:5],) for r in regions} == views
                    and all(r[5] == (r[4],) for r in regions)
                )
            layouts = [pd[side]["cfg"].cache_config.get_resolved_kv_cache_layout().name
                       for side in ("p", "d")]  # fmt: skip
            if check_pairing:
                test_producer_stages_pair_every_decoder_view_exactly_once(mc, pd)
            return dict(
                splits=splits,
                vllm_shared=vllm_shared,
                layouts=layouts,
                own=own,
                names=[
                    sorted(st["w"].registered_layer_names) == sorted(st["w"]._layer_specs)
                    for st in stages
                ],
                groups=[[g.layer_names for g in st["kv"].kv_cache_groups] for st in stages],
                regions=[_regions(st["w"]) for st in stages],
            )
        finally:
            for stage in stages:
                stage["w"].shutdown()


@pytest.mark.parametrize("case", list(K3_CASES))
def test_k3_registers_no_shared_region_so_the_split_changes_nothing(
    mc, case, tmp_path_factory, plugin, dist_env
):
    """Kimi-K3 PD (a PP=1 / PP=2 producer into a PP=1 decoder) as its engine cores plan it: none
    of its CUDA backends (MLA, KDA) declares a KV-cache layout, so vLLM resolves the default
    layer-outermost LBNHC, where no two layer views share an address, row and page. vLLM then
    registers no shared region (group -1) on any stage, the split finds nothing to take apart
    (the registered regions are vLLM's own), and every producer stage pairs with the decoder
    view for view: the K3 PD that served before the patch is left as it was."""
    out = _no_shared_region(mc, case, tmp_path_factory)
    pp = K3_CASES[case][1]
    assert out["splits"] == [0] * (pp + 1)
    assert out["vllm_shared"] == [[]] * (pp + 1)
    assert out["layouts"] == ["LBNHC", "LBNHC"]
    assert out["names"] == [True] * (pp + 1)
    for regions in out["regions"]:
        assert -1 not in [r[4] for r in regions]


QWEN3_TARGET = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
QWEN3_DRAFT = ["model.layers.4.self_attn.attn", "model.layers.5.self_attn.attn"]


def _qwen3_stage_layers(pp):
    """The layers of each stage of a PP=``pp`` producer, then the PP=1 decoder's (the drafter's
    on the last stage)."""
    stages = [QWEN3_TARGET] if pp == 1 else [QWEN3_TARGET[:2], QWEN3_TARGET[2:]]
    stages[-1] = stages[-1] + QWEN3_DRAFT
    return [*stages, QWEN3_TARGET + QWEN3_DRAFT]


@pytest.mark.parametrize("case", list(QWEN3_CASES))
def test_qwen3_registers_no_shared_region_so_the_split_changes_nothing(
    mc, case, tmp_path_factory, plugin, dist_env
):
    """The tiny Qwen3 pair's PD (a PP=1 / PP=2 producer with the context-KV-only drafter into a
    PP=1 DSpark decoder) as its engine cores plan it. Two things keep vLLM from registering a
    shared region (group -1: one view of several KV-cache groups), each enough alone:

    * every stage plans one KV-cache group: the drafter's full-attention layers have the
      target's spec (2 KV heads of 32, float32), so they join the target's group;
    * Qwen3 is not MLA, so MooncakeConnector asks for LBHNC (``get_required_kvcache_layout``),
      which its GPU backends (TRITON_ATTN for the float32 pair, FLASH_ATTN) declare nothing
      against: layer-outermost, each layer's view a head-major page of its own, which vLLM
      registers as its own region (never through the packed-row path that merges views).

    So the split takes nothing apart, every region is one layer's own view, and each producer
    stage pairs with the decoder view for view: the Qwen3 GPU PD runs made before the region
    patch registered what the patched code registers.

    Control: ``test_control_qwen3_block_outermost_layout_merges_views`` (the same PD under a
    block-outermost layout: vLLM merges each stage's views into one region, and ``own`` here
    fails)."""
    out = _no_shared_region(mc, case, tmp_path_factory)
    pp = QWEN3_CASES[case][1]
    assert out["layouts"] == ["LBHNC", "LBHNC"]
    assert out["groups"] == [[layers] for layers in _qwen3_stage_layers(pp)]
    assert out["vllm_shared"] == [[]] * (pp + 1)
    assert out["splits"] == [0] * (pp + 1)
    assert out["names"] == out["own"] == [True] * (pp + 1), out["regions"]


def test_control_qwen3_block_outermost_layout_merges_views(mc, tmp_path_factory, plugin, dist_env):
    """Control for the Qwen3 no-shared-region check (PP=2 producer): the same PD forced to a
    block-outermost layout (``BLNHC``, DeepSeek-V4's kind). A layer's view is then no page
    (token-major rows inside the block), so vLLM registers each stage's layers as one region,
    the whole row at the allocation's start, named by the first layer: the check's ``own`` and
    ``names`` fail. Still no group -1 (one KV-cache group; a view shared by two groups is what
    vLLM marks -1) and nothing for the split (it takes apart page views only)."""
    out = _no_shared_region(mc, "qwen3-pp2", tmp_path_factory, "BLNHC", check_pairing=False)
    assert out["layouts"] == ["BLNHC", "BLNHC"]
    assert out["own"] == out["names"] == [False] * 3
    first = [layers[0] for layers in _qwen3_stage_layers(2)]
    assert [[r[3] for r in regions] for regions in out["regions"]] == [[n] for n in first]
    assert [[r[4] for r in regions] for regions in out["regions"]] == [[0]] * 3
    assert out["vllm_shared"] == [[]] * 3 and out["splits"] == [0] * 3


def _k3_control(mc, case, tmp_path_factory, sabotage):
    """A PD of ``case`` (Kimi-K3's, or another of ``ALL_CASES``) built afresh, ``sabotage(pd)``
    applied to the producer's workers, one request through ``_transfer``; returns its findings
    and the built PD (its workers shut down)."""
    fam, pp = ALL_CASES[case]
    with pytest.MonkeyPatch.context() as m:
        pd = _build_pd(mc, fam, pp, tmp_path_factory, m)
        pd["case"] = case
        try:
            sabotage(pd, m)
            return _transfer(mc, pd, "xfer-control"), pd
        finally:
            for side in ("p", "d"):
                for stage in pd[side]["stages"]:
                    stage["w"].shutdown()


K3_MLA_LAYERS = [f"model.layers.{i}.self_attn" for i in (1, 3, 4, 5)]  # 4, 5: the drafter's


def test_control_k3_kernel_blocks_not_expanded_fails_the_mla_pages(
    mc, tmp_path_factory, plugin, dist_env
):
    """Control for the page-for-page check (K3, PP=2 producer): K3's MLA groups plan 64-token
    blocks that their kernel splits in four (the worker's ``_physical_blocks_per_logical_kv_block``
    is 4, the registered MLA regions are 18432-byte kernel pages of 73728-byte blocks). With the
    P workers' kernel expansion of block ids turned off (``_logical_to_kernel_block_ids`` the
    identity), P copies kernel block ``b`` (a quarter page at the wrong offset) for block ``b``:
    every MLA layer's pages differ, and bytes outside D's pulled blocks change (the groups
    overlay one allocation, so a quarter page sent to kernel block ``b`` lands in block ``b // 4``,
    a KDA block here). A comparison that indexes the views by block id, as the check did before
    it modelled the kernel split, reads kernel blocks too and finds that broken transfer's MLA
    pages correct (and the correct transfer's wrong: the K3 failure that kept K3 out of the
    check)."""

    def unexpanded(pd, m):
        for stage in pd["p"]["stages"]:
            w = stage["w"]
            assert w._physical_blocks_per_logical_kv_block == 4
            assert sorted({r[1] for r in _regions(w)}) == [18432, 73728]
            m.setattr(w, "_logical_to_kernel_block_ids", lambda ids: ids)

    out, pd = _k3_control(mc, "k3-pp2", tmp_path_factory, unexpanded)
    assert not out["errors"], out
    # every MLA page; the KDA pages too where a misplaced kernel block lands in a KDA block
    assert set(K3_MLA_LAYERS) <= set(out["wrong"]), out
    assert out["outside"]  # kernel block b of a D block id b < 4 * b lies in another block
    # the view-indexed comparison of the old helper (D's kernel block db against P's pb) finds
    # every MLA page of that transfer correct
    d = _only(pd["d"])
    src = {n: c for st in pd["p"]["stages"] for n, c in st["caches"].items()}
    for gi, g in enumerate(d["kv"].kv_cache_groups):
        for name in set(g.layer_names) & set(K3_MLA_LAYERS):
            for pb, db in out["pairs"][gi]:
                got, sent = (
                    c[b].contiguous().view(torch.uint8)
                    for c, b in ((d["caches"][name], db), (src[name], pb))
                )
                assert torch.equal(got, sent), (name, pb, db)


@pytest.mark.parametrize(
    "case, skipped",
    [("k3-pp1", "model.layers.3.self_attn"), ("qwen3-pp2", "model.layers.4.self_attn.attn")],
)
def test_control_skipped_region_fails_its_layer(
    mc, case, skipped, tmp_path_factory, plugin, dist_env
):
    """Control for the page-for-page check: the producer stage holding ``skipped`` leaves that
    layer's region out of its registration (vLLM pairs regions by layer name, so it sends the
    other layers and answers FINISH): the check names that layer alone. K3 with a PP=1 producer
    (layer 3's MLA region), and the tiny Qwen3 pair with a PP=2 producer (the drafter's first
    layer, whose context KV stage 1 computes)."""

    def skip(pd, m):
        (w,) = [st["w"] for st in pd["p"]["stages"] if skipped in st["w"].registered_layer_names]
        (i,) = [i for i, n in enumerate(w.registered_layer_names) if n == skipped]
        for attr in mooncake_regions.REGION_FIELDS:
            values = list(getattr(w, attr))
            del values[i]
            m.setattr(w, attr, values)

    out, _ = _k3_control(mc, case, tmp_path_factory, skip)
    assert not out["errors"] and not out["outside"], out
    assert out["wrong"] == [skipped]
