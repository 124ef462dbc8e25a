"""MooncakeConnector's transfer regions, one per layer view, so that PP stages of different sizes
pair up (DeepSeek-V4.1 PD with a PP=2 producer, issue 42).

vLLM 0.34.0's ``MooncakeConnectorWorker.register_kv_caches`` describes the registered KV cache
as a list of regions (parallel lists on the worker: address, bytes per block row, bytes per
block, layer name, layer index, KV-cache group, the groups sharing the region, offset in the
row). In a block-outermost (packed) plan every KV-cache group overlays the same rows, so the
first layers of several groups can be views with the same address, row and page bytes (the
tiny V4.1 decoder: the sliding-window caches of target layers 0 and 1 and of the two draft
layers, groups 0-3, all at offset 0 of one row). vLLM registers such views once: the first
layer's name stands for the region, its group becomes ``-1`` and the groups are listed, and
the transfer flattens those groups' block ids onto it.

Producer and consumer regions are paired by layer name (``_align_transfer_regions``). That
holds while both sides hold the same layers, but a PP stage holds only its own layers, so it
collapses a different set of views: producer stage 0 of the tiny V4.1 target has layer 0's
view alone (group 0), stage 1 collapses layers 1-3 under layer 1's name (groups 1-3), and the
PP=1 decoder collapses layers 0-3 under layer 0's name (``-1``). Stage 0 is then refused
("registered group index mismatch ... producer=0, consumer=-1"), and stage 1 finds no decoder
region named after layer 1 and, as PP sizes differ, skips its region: the decoder would get no
sliding-window KV of layers 1-3 and not be told.

:func:`split_shared_regions` takes each shared region apart again: one region per layer view,
with that layer's name, index and group (its own block ids only), in the registration's order.
Every side then names every view by its own layer, so any two PP layouts pair view for view;
the bytes a transfer moves are the same (each group's blocks once), only the regions are more.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: the worker's parallel region lists, in the order of the fields of one region
REGION_FIELDS = (
    "kv_caches_base_addr",
    "block_len_per_layer",
    "kv_block_len_per_layer",
    "registered_layer_names",
    "registered_layer_indices",
    "registered_group_indices",
    "region_shared_groups",
    "region_row_offsets",
)


@dataclass(frozen=True)
class LayerView:
    """One layer's KV cache as a transfer sees it: where its block 0 starts, the bytes from one
    block to the next, and the bytes of one block (its page as laid out, without row padding)."""

    layer: str
    group: int
    address: int
    row_bytes: int
    page_bytes: int


def page_views(kv_caches: Mapping[str, Any], group_by_layer: Mapping[str, int]) -> list[LayerView]:
    """The views of the layers that take part in transfer and whose block is one contiguous
    page, in the order of ``kv_caches`` (the order vLLM registers them in)."""
    out = []
    for name, cache in kv_caches.items():
        if name not in group_by_layer or cache.ndim < 2 or not cache[0].is_contiguous():
            continue
        out.append(
            LayerView(
                layer=name,
                group=int(group_by_layer[name]),
                address=int(cache.data_ptr()),
                row_bytes=int(cache.stride(0) * cache.element_size()),
                page_bytes=int(cache[0].nbytes),
            )
        )
    return out


def split_regions(
    regions: Mapping[str, list[Any]],
    views: list[LayerView],
    shared_group: int,
    layer_index: Callable[[str], int],
) -> tuple[dict[str, list[Any]], int]:
    """``regions`` (the lists of :data:`REGION_FIELDS`) with every region of group
    ``shared_group`` replaced by one region per layer view it stands for, each with the view's
    layer, ``layer_index(layer)``, group and ``(group,)``. A shared region is split only when its
    views are one per listed group, exactly its groups; otherwise (a row whose views are not
    pages, where vLLM keeps no layer names) it stays as it is. Returns the new lists and the
    number of regions split."""
    n = len(regions[REGION_FIELDS[0]])
    assert all(len(regions[f]) == n for f in REGION_FIELDS), {
        f: len(regions[f]) for f in REGION_FIELDS
    }
    out: dict[str, list[Any]] = {f: [] for f in REGION_FIELDS}
    split = 0
    for i in range(n):
        row = {f: regions[f][i] for f in REGION_FIELDS}
        members = []
        if row["registered_group_indices"] == shared_group:
            key = (row["kv_caches_base_addr"], row["block_len_per_layer"])
            members = [
                v
                for v in views
                if (v.address, v.row_bytes) == key and v.page_bytes == row["kv_block_len_per_layer"]
            ]
            groups = [v.group for v in members]
            if len(set(groups)) != len(groups) or sorted(groups) != sorted(
                row["region_shared_groups"]
            ):
                members = []
        if not members:
            for f in REGION_FIELDS:
                out[f].append(row[f])
            continue
        split += 1
        for v in members:
            for f, value in (
                ("registered_layer_names", v.layer),
                ("registered_layer_indices", layer_index(v.layer)),
                ("registered_group_indices", v.group),
                ("region_shared_groups", (v.group,)),
            ):
                out[f].append(value)
            for f in (
                "kv_caches_base_addr",
                "block_len_per_layer",
                "kv_block_len_per_layer",
                "region_row_offsets",
            ):
                out[f].append(row[f])
    return out, split


def split_shared_regions(
    worker: Any,
    kv_caches: Mapping[str, Any],
    shared_group: int,
    layer_index: Callable[[str], int],
) -> int:
    """Apply :func:`split_regions` to a registered ``MooncakeConnectorWorker`` (its region lists
    replaced; the caches derived from them emptied). Returns the number of regions split."""
    group_by_layer = worker.kv_cache_config.transfer_group_index_by_layer
    views = page_views(
        {n: c for n, c in kv_caches.items() if n in worker._layer_specs}, group_by_layer
    )
    regions = {f: list(getattr(worker, f)) for f in REGION_FIELDS}
    new, split = split_regions(regions, views, shared_group, layer_index)
    if split:
        for f in REGION_FIELDS:
            setattr(worker, f, new[f])
        worker._prepared_transfer_regions.clear()
        worker._layout_by_peer.clear()
    return split
