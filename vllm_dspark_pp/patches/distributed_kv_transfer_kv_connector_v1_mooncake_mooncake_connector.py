"""MooncakeConnector's block size from the attention KV groups, the same on every side (issue 16).

WHAT: Three wraps in vLLM's Mooncake connector module. (1) ``MooncakeConnectorWorker.
_sync_block_size_with_kernel``: before vLLM picks the kernel block size, the worker's ``block_size``
is set to ``vllm_dspark_pp.connectors.mooncake_blocks.transfer_block_size`` (the configured value
when every transfer group has one block size; otherwise the attention groups' block size: the
largest full-attention/MLA group, else the largest sliding-window group), and a change is logged.
(2) ``MooncakeConnectorScheduler.__init__``: afterwards ``block_size`` is set the same way (its only
use in 0.34.0, the placeholder for non-sliding-window groups in ``blocks_per_sw``, has no effect, so
this only keeps the scheduler's value equal to its workers'). (3)
``MooncakeConnectorWorker.shutdown`` on a worker whose ``__init__`` failed before it created
``async_zmq_ctx`` stops what had been started (sender/receiver loops, bootstrap server) instead of
raising AttributeError from ``__del__`` under the real error.

WHY: After KV-cache planning, EngineCore sets ``cache_config.block_size`` to the smallest block
of the prefix-cacheable groups (vllm/v1/engine/core.py:364-378). For DeepSeek-V4 the groups are
compressed MLA 256, SWA 64 and compressor states 4 and 8, so that is 4. The uniproc executor's
worker shares the config object and builds MooncakeConnectorWorker afterwards
(``initialize_from_config`` -> ``ensure_kv_transfer_initialized``), so
``_sync_block_size_with_kernel`` (mooncake_connector.py:1529-1593) asks
``select_common_block_size`` (v1/worker/utils.py:508-554) for a divisor of 4 that the sparse SWA
backend takes (multiples of 32) and start-up fails: "No common block size for 4
(CompressorBackend ...; DEEPSEEK_SPARSE_SWA: [MultipleOf(32)] ...)" (H200, 2026-12-03,
test_pd_over_mooncake[dsv4]). Multiproc workers were spawned before the rewrite and read 256,
while the scheduler (mooncake_connector.py:1014, built after it) reads 4. None of this depends on
speculative decoding: a DeepSeek-V4 target alone plans the same groups. The KV-cache plan is the
same in the scheduler and every worker, so deriving the value from it gives one answer for any
executor: 256 for DeepSeek-V4, exactly what a stock multiproc worker uses (kernel block 256, one
physical block per logical block, which matches the model runner's per-group kernel blocks).
Models whose transfer groups share one block size (Qwen3, Kimi-K3) keep vLLM's value unchanged.

UPSTREAM: no vLLM issue or PR found for MooncakeConnector (searched 2026-12-03). NixlConnector
needs no such patch: its worker takes the lcm of the transfer groups' block sizes (256), not the
rewritten value (nixl/base_worker.py:698-708; tests/unit/connectors/test_nixl_block_size.py).
Related work in vllm-ascend's own Mooncake connector: PR #14920 (derive the DSV4 Mooncake block
size from the KV spec), PR #15646 (sync the Mooncake block size from the workers), issue #14479
(the core.py min() rewrite overriding --block-size for DeepSeek-V4).

RETIRE WHEN: vLLM's Mooncake connector stops reading the rewritten ``cache_config.block_size``
(or EngineCore stops rewriting it for heterogeneous groups); check
``MooncakeConnectorWorker.__init__`` and ``_initialize_kv_caches`` in the new release.

TESTED BY: tests/unit/connectors/test_mooncake_block_size.py (the real tiny DeepSeek-V4 target's
KV-cache plan on CPU: stock worker fails as on the H200, the patched scheduler and uniproc and
multiproc workers agree on 256; single-block-size plans unchanged; shutdown of a half-built
worker), tests/unit/connectors/test_mooncake_dsv4_transfer.py (both PD sides of the tiny DeepSeek-V4
target with DSpark drafters: workers built by vLLM's own ``__init__``, registration, scheduling
and a pulled request page for page; the workers fail as on the H200 without this patch),
tests/gpu/test_dsv4_k3_engine.py::test_pd_over_mooncake (GPU).
"""

from __future__ import annotations

from vllm_dspark_pp.patches import when_imported
from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.dspark_pp.mooncake")


_HALF_BUILT = "_vllm_dspark_pp_half_built"


class _NoContext:
    """Stands in for the zmq context a half-built worker never created."""

    def term(self) -> None:
        return None


def _patch(module) -> None:
    from vllm_dspark_pp.connectors.mooncake_blocks import group_block_sizes, transfer_block_size

    def adopt_plan_block_size(obj, role: str) -> None:
        """Set ``obj.block_size`` (the connector's logical block) from the KV-cache plan."""
        configured = obj.block_size
        obj.block_size = transfer_block_size(obj.kv_cache_config, configured)
        if obj.block_size != configured:
            _logger().info(
                "MooncakeConnector %s: logical block size %d from the attention KV groups, not "
                "cache_config.block_size %d (transfer group block sizes %s)",
                role,
                obj.block_size,
                configured,
                group_block_sizes(obj.kv_cache_config),
            )

    def make_sync(orig):
        def _sync_block_size_with_kernel(self) -> None:
            adopt_plan_block_size(self, "worker")
            return orig(self)

        return _sync_block_size_with_kernel

    def make_init(orig):
        def __init__(self, *args, **kwargs) -> None:
            orig(self, *args, **kwargs)
            adopt_plan_block_size(self, "scheduler")

        return __init__

    def make_shutdown(orig):
        def shutdown(self) -> None:
            if hasattr(self, "async_zmq_ctx") and not getattr(self, _HALF_BUILT, False):
                return orig(self)
            # __init__ failed part-way: stop what it had started, and never let __del__ raise
            # an AttributeError that buries the error that stopped __init__.
            setattr(self, _HALF_BUILT, True)
            self.async_zmq_ctx = _NoContext()
            try:
                orig(self)
            except AttributeError as e:
                _logger().debug("shutdown of a partly built Mooncake worker stopped early: %s", e)

        return shutdown

    wrap(module.MooncakeConnectorWorker, "_sync_block_size_with_kernel", make_sync)
    wrap(module.MooncakeConnectorWorker, "shutdown", make_shutdown)
    wrap(module.MooncakeConnectorScheduler, "__init__", make_init)


def apply() -> None:
    when_imported(TARGET, _patch)
