"""MooncakeConnector's block size for DeepSeek-V4: one value on the scheduler and on uniproc and
multiproc workers (the patch ``distributed_kv_transfer_kv_connector_v1_mooncake_mooncake_connector``
over ``vllm_dspark_pp.connectors.mooncake_blocks``).

The DeepSeek-V4 cases use the real tiny GPU target (``make_tiny_dsv4_pair(gpu=True)``) built on
CPU, its KV-cache specs planned by vLLM's own ``get_kv_cache_configs`` as the engine core does,
with a MooncakeConnector producer config and no speculative config (the failure does not need
one), and vLLM's own connector classes (the module imports without Mooncake; a worker cannot be
constructed without it, so the worker cases bind the attributes ``__init__`` sets before
``_sync_block_size_with_kernel`` on an instance made with ``object.__new__`` and call the real
method). vLLM's unpatched methods come from ``patches._util.original``. The PD with a PP=2
producer case plans the target's two layers as two PP stages (vLLM's planner over both workers)
and checks that each stage's worker, the scheduler and the PP=1 decoder agree.

What only a GPU run shows: that the engine then registers and transfers the KV cache
(tests/gpu/test_dsv4_k3_engine.py::test_pd_over_mooncake[dsv4]).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dspark_dev import tiny_mla_targets as t
from dspark_dev.tiny_dsv4_cpu import build_dsv4_target, engine_config, plan_as_engine_core
from vllm_dspark_pp.connectors import mooncake_blocks as mb
from vllm_dspark_pp.patches._util import original

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"


@pytest.fixture(scope="module")
def mc(plugin):
    import importlib

    from vllm_dspark_pp.patches import applied_patches

    assert "distributed_kv_transfer_kv_connector_v1_mooncake_mooncake_connector" in (
        applied_patches()
    )
    return importlib.import_module(MODULE)


def _mooncake(role: str) -> dict:
    return {"kv_connector": "MooncakeConnector", "kv_role": role}


@pytest.fixture(scope="module")
def dsv4_built(tmp_path_factory, plugin, dist_env):
    """(config, {layer name: KV-cache spec}) of the tiny DeepSeek-V4 target as a Mooncake
    prefiller."""
    pair = t.make_tiny_dsv4_pair(tmp_path_factory.mktemp("mc-dsv4"), gpu=True)
    # the GPU run's cache dtype: DeepSeek-V4's CUDA attention picks fp8_ds_mla by itself there
    cfg = engine_config(
        pair, kv_cache_dtype="fp8_ds_mla", kv_transfer_config=_mooncake("kv_producer")
    )
    assert cfg.speculative_config is None
    assert cfg.cache_config.block_size == 256
    with pytest.MonkeyPatch.context() as m:
        specs = build_dsv4_target(cfg, m)
    return cfg, specs


@pytest.fixture(scope="module")
def dsv4(dsv4_built):
    """(config, worker KV-cache config, scheduler KV-cache config, block size after the engine
    core's rewrite) for the tiny DeepSeek-V4 target as a Mooncake prefiller."""
    cfg, specs = dsv4_built
    _, kv_cfg, sched_cfg, rewritten = plan_as_engine_core(cfg, specs)
    return cfg, kv_cfg, sched_cfg, rewritten


def _worker(mc, cfg, kv_cfg, block_size):
    """A MooncakeConnectorWorker holding what ``__init__`` sets before it calls
    ``_sync_block_size_with_kernel`` (mooncake_connector.py:1529-1534)."""
    w = object.__new__(_no_del(mc))
    w.vllm_config = cfg
    w.kv_cache_config = kv_cfg
    w.block_size = block_size
    w._physical_blocks_per_logical_kv_block = 1
    return w


def _no_del(mc):
    """The worker class without ``__del__`` (nothing to shut down in a stand-in); every other
    method is the (patched) vLLM one."""

    class Worker(mc.MooncakeConnectorWorker):
        def __del__(self):
            pass

    return Worker


def _scheduler(mc, cfg, kv_cfg, block_size, *, stock: bool):
    init = original(mc.MooncakeConnectorScheduler, "__init__") if stock else None
    s = object.__new__(mc.MooncakeConnectorScheduler)
    before = cfg.cache_config.block_size
    cfg.cache_config.block_size = block_size  # what the scheduler process's config holds
    try:
        (init or mc.MooncakeConnectorScheduler.__init__)(s, cfg, "engine-x", kv_cfg)
    finally:
        cfg.cache_config.block_size = before
    return s


def test_dsv4_plan_mixes_block_sizes_and_the_rewrite_picks_a_state_block(dsv4):
    _, kv_cfg, _, rewritten = dsv4
    assert sorted(set(mb.group_block_sizes(kv_cfg))) == [4, 8, 64, 256]
    assert rewritten == 4
    assert mb.attention_block_size(kv_cfg) == 256


def test_stock_uniproc_worker_fails_as_on_the_h200(mc, dsv4):
    cfg, kv_cfg, _, rewritten = dsv4
    w = _worker(mc, cfg, kv_cfg, rewritten)
    stock = original(mc.MooncakeConnectorWorker, "_sync_block_size_with_kernel")
    with pytest.raises(ValueError, match=r"No common block size for 4 \(") as e:
        stock(w)
    assert "DEEPSEEK_SPARSE_SWA: [MultipleOf(32)]" in str(e.value)
    assert "CompressorBackend: [MultipleOf(1)]" in str(e.value)


def test_stock_multiproc_worker_and_scheduler_disagree(mc, dsv4):
    cfg, kv_cfg, sched_cfg, rewritten = dsv4
    w = _worker(mc, cfg, kv_cfg, 256)  # spawned before the rewrite
    original(mc.MooncakeConnectorWorker, "_sync_block_size_with_kernel")(w)
    assert (w.block_size, w._physical_blocks_per_logical_kv_block) == (256, 1)
    s = _scheduler(mc, cfg, sched_cfg, rewritten, stock=True)
    assert s.block_size == 4


def test_patched_scheduler_and_workers_agree_on_256(mc, dsv4):
    cfg, kv_cfg, sched_cfg, rewritten = dsv4
    seen = {}
    for name, configured in (("uniproc", rewritten), ("multiproc", 256)):
        w = _worker(mc, cfg, kv_cfg, configured)
        w._sync_block_size_with_kernel()
        seen[name] = (w.block_size, w._physical_blocks_per_logical_kv_block)
    assert seen == {"uniproc": (256, 1), "multiproc": (256, 1)}
    patched = _scheduler(mc, cfg, sched_cfg, rewritten, stock=False)
    stock = _scheduler(mc, cfg, sched_cfg, rewritten, stock=True)
    assert patched.block_size == 256
    # the only other use of the scheduler's block size is unchanged
    assert patched.blocks_per_sw == stock.blocks_per_sw


def test_pp2_producer_stages_agree_with_the_pp1_decoder_on_256(mc, dsv4_built, dsv4):
    """PD with a PP=2 producer (tests/gpu/test_pd_pp_producer.py, DSPARK_GPU_PD_PP_PAIR=dsv4):
    each producer stage plans only its own layers (stage 0 the ratio-4 layer, stage 1 the
    ratio-128 one; vLLM plans PP workers together, ``get_kv_cache_configs``), and the engine core
    rewrites the block size to the smallest state block of the stages' scheduler plan. The patched
    worker of each stage, the scheduler and a PP=1 decoder must still transfer in one block size:
    256 (the decoder pulls every stage's pages into its own blocks)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    cfg, specs = dsv4_built
    _, decoder_plan, _, decoder_rewritten = dsv4
    stages = [{n: s for n, s in specs.items() if (".layers.0." in n) == (r == 0)} for r in (0, 1)]
    assert all(stages) and sum(map(len, stages)) == len(specs), stages
    with set_current_vllm_config(cfg):
        groups = get_global_kv_cache_groups(cfg, stages)
        plans = get_kv_cache_configs(cfg, stages, [1 << 30] * 2, groups)
    sched = generate_scheduler_kv_cache_config(plans)
    rewritten = min(
        g.kv_cache_spec.block_size
        for g in sched.kv_cache_groups
        if g.kv_cache_spec.prefix_cacheable
    )
    assert rewritten == 4
    seen = []
    for r, plan in enumerate(plans):
        held = {n for g in plan.transfer_groups for n in g.layer_names}
        assert held == set(stages[r]), (r, held)  # a stage's plan holds its own layers only
        assert sorted(set(mb.group_block_sizes(plan))) == [4, 8, 64, 256]
        w = _worker(mc, cfg, plan, rewritten)  # uniproc: the rewritten value
        w._sync_block_size_with_kernel()
        seen.append((w.block_size, w._physical_blocks_per_logical_kv_block))
    dec = _worker(mc, cfg, decoder_plan, decoder_rewritten)
    dec._sync_block_size_with_kernel()
    assert (
        seen == [(dec.block_size, dec._physical_blocks_per_logical_kv_block)] * 2 == [(256, 1)] * 2
    )
    assert _scheduler(mc, cfg, sched, rewritten, stock=False).block_size == 256


def _group(name, spec):
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return KVCacheGroupSpec([name], spec)


def _config(*groups):
    from vllm.v1.kv_cache_interface import KVCacheConfig

    return KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=list(groups))


def _full(block_size):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
    )


def _mla(block_size, ratio=1):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=512,
        dtype=torch.bfloat16,
        tokens_per_state=ratio,
    )


def _swa(block_size, window):
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

    return SlidingWindowMLASpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=512,
        dtype=torch.bfloat16,
        sliding_window=window,
    )


def _mamba(block_size):
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=block_size, shapes=((4, 8),), dtypes=(torch.float32,))


def test_single_block_size_plans_keep_the_configured_value():
    qwen3 = _config(_group("a", _full(16)))
    kimi = _config(_group("mla", _mla(128)), _group("kda", _mamba(128)))
    for plan in (qwen3, kimi):
        for configured in (16, 128, 4):
            assert mb.transfer_block_size(plan, configured) == configured
    assert mb.transfer_block_size(None, 32) == 32
    assert mb.transfer_block_size(_config(), 32) == 32


def test_mixed_plans_take_the_attention_block():
    dsv4_like = _config(
        _group("attn", _mla(256, ratio=4)),
        _group("state4", _swa(4, 8)),
        _group("swa", _swa(64, 128)),
        _group("state8", _swa(8, 128)),
    )
    assert mb.transfer_block_size(dsv4_like, 4) == 256
    assert mb.transfer_block_size(dsv4_like, 256) == 256
    # no full-attention group: the largest sliding-window group, not the smallest state block
    swa_only = _config(_group("state4", _swa(4, 8)), _group("swa", _swa(64, 128)))
    assert mb.transfer_block_size(swa_only, 4) == 64
    # no attention group at all: vLLM's value
    mamba_only = _config(_group("m1", _mamba(16)), _group("m2", _mamba(32)))
    assert mb.transfer_block_size(mamba_only, 16) == 16


def test_patched_worker_passes_single_block_size_through(mc, make_vllm_config):
    """A Qwen3-like plan (one group): the patched method does what vLLM's does."""
    from vllm.v1.attention.backends.utils import record_kv_cache_layout

    cfg = make_vllm_config(kv_transfer_config=_mooncake("kv_producer"))
    record_kv_cache_layout(cfg.cache_config, "LBNHC")  # as a worker adopts the engine's layout
    bs = cfg.cache_config.block_size
    plan = _config(_group("model.layers.0.self_attn.attn", _full(bs)))
    results = []
    for method in (
        original(mc.MooncakeConnectorWorker, "_sync_block_size_with_kernel"),
        mc.MooncakeConnectorWorker._sync_block_size_with_kernel,
    ):
        w = _worker(mc, cfg, plan, bs)
        method(w)
        results.append((w.block_size, w._physical_blocks_per_logical_kv_block))
    assert results[0] == results[1] == (bs, 1)
    stock = _scheduler(mc, cfg, plan, bs, stock=True)
    patched = _scheduler(mc, cfg, plan, bs, stock=False)
    assert (patched.block_size, patched.blocks_per_sw) == (stock.block_size, stock.blocks_per_sw)


def test_shutdown_of_a_half_built_worker_stops_its_sender_and_does_not_raise(mc, dsv4):
    """``__init__`` failed after starting the sender loop and before ``async_zmq_ctx``: vLLM's
    shutdown raises AttributeError (from ``__del__``, under the real error) and stops nothing."""
    cfg = dsv4[0]

    def half_built():
        w = object.__new__(mc.MooncakeConnectorWorker)
        w.vllm_config = cfg
        w.is_kv_producer, w.is_kv_consumer = True, False
        w._sender_executor = ThreadPoolExecutor(max_workers=1)
        w.sender_loop = asyncio.new_event_loop()
        w._sender_listener_t = threading.Thread(target=w.sender_loop.run_forever, daemon=True)
        w._sender_listener_t.start()
        return w

    stock = half_built()
    with pytest.raises(AttributeError, match="async_zmq_ctx"):
        original(mc.MooncakeConnectorWorker, "shutdown")(stock)
    assert stock._sender_listener_t.is_alive()
    stock.sender_loop.call_soon_threadsafe(stock.sender_loop.stop)
    stock._sender_listener_t.join(timeout=5)

    w = half_built()
    w.shutdown()
    w._sender_listener_t.join(timeout=5)
    assert not w._sender_listener_t.is_alive()
    w.shutdown()  # twice, as __del__ may after an explicit call

    empty = object.__new__(mc.MooncakeConnectorWorker)  # failed before anything was set
    empty.shutdown()
