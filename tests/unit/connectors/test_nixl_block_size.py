"""NixlConnector's block size for DeepSeek-V4 after EngineCore's rewrite (issue 16, cause 5): the
NIXL worker does not fail where MooncakeConnector's does, so no patch is needed.

EngineCore rewrites ``cache_config.block_size`` to the smallest prefix-cacheable group block after
planning (4 for DeepSeek-V4), and a uniproc worker sees that value. vLLM 0.34.0's NIXL worker
does not start from it: ``NixlBaseConnectorWorker.__init__`` (nixl/base_worker.py:698-708) takes
the least common multiple of the transfer groups' block sizes (Mamba and circular-buffer groups
left out), and only falls back to ``cache_config.block_size`` with no such group. For
DeepSeek-V4's groups (256, 64, 8, 4) that is 256, the same value as the Mooncake patch's
``transfer_block_size``, whatever the configured value; so ``_sync_block_size_with_kernel``
finds kernel block 256 and the handshake metadata carries 256. The NIXL scheduler keeps the
rewritten 4 (``base_scheduler.py:73``), but its only use there is the placeholder block of
non-sliding-window groups in ``blocks_per_sw``, whose token count is 0, so it changes nothing;
the compatibility hash has no block size in it (``metadata.py:149-206``).

Built here: the real tiny DeepSeek-V4 GPU target on CPU, planned by vLLM as the engine core
does, with a NixlConnector config and ``cache_config.block_size`` rewritten to 4; the worker is
vLLM's ``NixlPullConnectorWorker`` (with our patches applied) built by its own ``__init__``, and
the scheduler vLLM's ``NixlConnectorScheduler``. Stood in for: only the nixl agent object (nixl
is not installed here), and the CPU platform's NUMA query (so that the worker does not pin this
test process to one core). Not covered: registration and transfer with a real nixl agent (GPU).
"""

from __future__ import annotations

import pytest

from dspark_dev import tiny_mla_targets as t
from dspark_dev.tiny_dsv4_cpu import build_dsv4_target, engine_config, plan_as_engine_core
from vllm_dspark_pp.connectors import mooncake_blocks as mb

WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"


class FakeNixlAgent:
    """Stands in for ``nixl_agent``: the worker's ``__init__`` only constructs it (and creates
    backends for some configurations, recorded here)."""

    def __init__(self, name, config):
        self.name = name
        self.config = config
        self.backends: list[tuple[str, dict]] = []

    def create_backend(self, name, params):
        self.backends.append((name, dict(params)))


def _nixl(role: str) -> dict:
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}


@pytest.fixture(scope="module")
def dsv4_nixl(tmp_path_factory, plugin, dist_env):
    """(config with block size rewritten as EngineCore does, worker KV-cache config, scheduler
    KV-cache config) for the tiny DeepSeek-V4 target as a NIXL prefiller."""
    pair = t.make_tiny_dsv4_pair(tmp_path_factory.mktemp("nixl-dsv4"), gpu=True)
    cfg = engine_config(pair, kv_cache_dtype="fp8_ds_mla", kv_transfer_config=_nixl("kv_both"))
    assert cfg.cache_config.block_size == 256
    with pytest.MonkeyPatch.context() as m:
        specs = build_dsv4_target(cfg, m)
    _, kv_cfg, sched_cfg, cfg.cache_config.block_size = plan_as_engine_core(cfg, specs)
    assert cfg.cache_config.block_size == 4
    return cfg, kv_cfg, sched_cfg


def _worker(cfg, kv_cfg, monkeypatch):
    import importlib

    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )

    base = importlib.import_module(WORKER_MODULE)
    monkeypatch.setattr(base, "NixlWrapper", FakeNixlAgent)
    monkeypatch.setattr(base, "check_nixl_version", lambda *a: None)
    # the CPU worker pins the process to each NUMA node's last core; not this test process
    monkeypatch.setattr(base.current_platform, "discover_numa_topology", lambda: [])
    with set_current_vllm_config(cfg):
        return NixlPullConnectorWorker(cfg, "engine-nixl", kv_cfg)


def test_uniproc_dsv4_nixl_worker_starts_with_block_256(dsv4_nixl, monkeypatch):
    """The uniproc case that fails for MooncakeConnector ("No common block size for 4"): the
    NIXL worker, built by its own ``__init__`` on the rewritten config, starts with logical and
    kernel block 256."""
    cfg, kv_cfg, _ = dsv4_nixl
    assert sorted(set(mb.group_block_sizes(kv_cfg))) == [4, 8, 64, 256]
    w = _worker(cfg, kv_cfg, monkeypatch)
    try:
        assert isinstance(w.nixl_wrapper, FakeNixlAgent)
        assert cfg.cache_config.block_size == 4  # what a uniproc worker's config holds
        assert (w.block_size, w._physical_blocks_per_logical_kv_block) == (256, 1)
        # the same answer as the Mooncake patch's rule, from either configured value
        assert w.block_size == mb.transfer_block_size(kv_cfg, 4)
        assert w.block_size == mb.transfer_block_size(kv_cfg, 256)
        assert w.num_blocks == kv_cfg.num_blocks  # one kernel block per logical block
    finally:
        w._handshake_initiation_executor.shutdown(wait=False)


def test_the_stock_kernel_sync_would_fail_from_4(dsv4_nixl, monkeypatch):
    """The test above can fail: had the NIXL worker kept the rewritten 4, vLLM's own
    ``_sync_block_size_with_kernel`` would raise the H200's Mooncake error."""
    cfg, kv_cfg, _ = dsv4_nixl
    w = _worker(cfg, kv_cfg, monkeypatch)
    try:
        w.block_size = cfg.cache_config.block_size
        w._physical_blocks_per_logical_kv_block = 1
        with pytest.raises(ValueError, match=r"No common block size for 4 \(") as e:
            w._sync_block_size_with_kernel()
        assert "DEEPSEEK_SPARSE_SWA: [MultipleOf(32)]" in str(e.value)
    finally:
        w._handshake_initiation_executor.shutdown(wait=False)


def test_nixl_scheduler_keeps_4_but_uses_it_for_nothing(dsv4_nixl):
    """The scheduler reads the rewritten 4; its only use, the placeholder block of the groups
    without a sliding window, gives the same ``blocks_per_sw`` as 256 would."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.scheduler import (
        NixlConnectorScheduler,
    )

    cfg, _, sched_cfg = dsv4_nixl
    seen = {}
    for configured in (4, 256):
        cfg.cache_config.block_size = configured
        try:
            s = NixlConnectorScheduler(cfg, "engine-nixl", sched_cfg)
        finally:
            cfg.cache_config.block_size = 4
        seen[configured] = (s.block_size, s.blocks_per_sw)
    assert seen[4][0] == 4 and seen[256][0] == 256
    assert seen[4][1] == seen[256][1]
    assert any(seen[4][1])  # the sliding-window groups are counted
