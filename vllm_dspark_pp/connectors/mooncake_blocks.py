"""The block size MooncakeConnector transfers in, derived from the KV-cache plan (issue 16).

vLLM 0.34.0's MooncakeConnector reads one scalar, ``cache_config.block_size``, on both sides:
the scheduler keeps it as ``MooncakeConnectorScheduler.block_size``, and the worker treats it as
the logical block its attention kernels may split (``_sync_block_size_with_kernel``: the kernel
block every transfer backend accepts, and ``_physical_blocks_per_logical_kv_block``, the factor
by which it expands attention block ids and divides per-block transfer lengths).

After planning, EngineCore rewrites ``cache_config.block_size`` to the smallest block of the
prefix-cacheable KV-cache groups (``vllm/v1/engine/core.py``, after
``generate_scheduler_kv_cache_config``). With one block size for every group that is a no-op.
DeepSeek-V4 plans groups of different block sizes (compressed MLA 256, SWA 64, compressor states
4 and 8), so the rewritten value is a compressor state's 4: the scheduler (built after the
rewrite) reads 4, a uniproc worker (sharing the engine's config object) reads 4 and fails
("No common block size for 4": the sparse SWA backend takes multiples of 32), and multiproc
workers (spawned before the rewrite) read the logical 256.

:func:`transfer_block_size` gives one answer from the KV-cache plan alone, which the scheduler
and every worker hold whatever the executor: with a single block size it returns the configured
value unchanged; with several it returns the block size of the attention groups (the largest
full-attention group, else the largest sliding-window group), which is the logical block the
planner resolved (DeepSeek-V4: 256, what a multiproc worker reads on stock vLLM).
"""

from __future__ import annotations

from typing import Any


def _layer_specs(group: Any) -> list[Any]:
    from vllm.v1.kv_cache_interface import iter_layer_specs

    return list(iter_layer_specs(group.kv_cache_spec))


def group_block_sizes(kv_cache_config: Any) -> list[int]:
    """The block size of each KV-cache group that takes part in KV transfer, in group order."""
    if kv_cache_config is None:
        return []
    return [int(g.kv_cache_spec.block_size) for g in kv_cache_config.transfer_groups]


def attention_block_size(kv_cache_config: Any) -> int | None:
    """The block size of the attention KV groups: the largest full-attention group's (MLA
    included), else the largest sliding-window group's; None without attention groups."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    full: list[int] = []
    window: list[int] = []
    for group in kv_cache_config.transfer_groups:
        specs = _layer_specs(group)
        if not specs:
            continue
        size = int(group.kv_cache_spec.block_size)
        if all(isinstance(s, FullAttentionSpec) for s in specs):
            full.append(size)
        elif all(isinstance(s, SlidingWindowSpec) for s in specs):
            window.append(size)
    if full:
        return max(full)
    if window:
        return max(window)
    return None


def transfer_block_size(kv_cache_config: Any, configured: int) -> int:
    """The logical block size MooncakeConnector should use on the scheduler and the worker.

    ``configured`` is the value vLLM would use (``cache_config.block_size`` as that process sees
    it). It is returned unchanged unless the transfer groups have more than one block size and
    attention groups exist; then the attention groups' block size is returned.
    """
    if len(set(group_block_sizes(kv_cache_config))) <= 1:
        return configured
    logical = attention_block_size(kv_cache_config)
    return configured if logical is None else logical
