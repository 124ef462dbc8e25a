"""MooncakeConnector registers one transfer region per layer view, so a PP=2 producer's stages
pair with a PP=1 decoder (DeepSeek-V4.1 PD, issue 42).

WHAT: Wraps ``MooncakeConnectorWorker.register_kv_caches``: after vLLM's registration, every
region that stands for views of several KV-cache groups (group ``-1``, only the first layer's
name kept) is replaced by one region per view, named by its own layer, with its own group
(``vllm_dspark_pp.connectors.mooncake_regions.split_shared_regions``). Applies on both PD roles;
regions vLLM did not collapse, and rows whose views are not pages, stay as they are.

WHY: In a block-outermost plan the KV-cache groups overlay one row, and the first layers of
several groups can have the same address, row and page. ``register_kv_caches``
(mooncake_connector.py:2366-2405 in 0.34.0) registers such views once, under the first layer's
name, with group ``_SHARED_REGION_GROUP_ID`` (-1, line 115). ``_align_transfer_regions``
(lines 393-479) pairs producer and consumer regions by layer name and occurrence; when the PP
sizes differ (``allow_partial_layers``, line 3147; vLLM PR #56033) it skips a producer region
whose name the consumer lacks (lines 424-431), then requires equal group indices (450-460). A
PP stage holds only its own layers, so it collapses other views than the PP=1 decoder does.
The bundled DeepSeek-V4.1 pair (models/dsv41-pair): the decoder collapses the sliding-window
views of target layers 0 and 1 and draft layers 2 and 3 (groups 0-3) under layer 0's name;
producer stage 0 registers layer 0's view alone (group 0), stage 1 collapses layers 1-3 under
layer 1's name. Stage 0 is refused, "Mooncake registered group index mismatch for
language_model.model.layers.0.attn.swa_cache: producer=0, consumer=-1." (H100, 2026-12-06,
group pd_pp_dsv41: every PD request HTTP 500), and stage 1, finding no decoder region named
after layer 1, skips its region and reports success: the sliding-window KV of layers 1-3 would
never be sent. DeepSeek-V4 plans the same overlay (the sliding-window caches of its four layers,
groups 2-5) and fails the same way on CPU ("producer=2, consumer=-1"). With one region per view
both sides name each view by its own layer and group, and each producer stage pairs exactly the
views of its layers; the bytes moved are the same (each group's blocks once).

UPSTREAM: vLLM PR #46004 (open: DeepSeek-V4 Mooncake PP/PD shared KV metadata; aligns regions by
the cache identity of ``KVCacheTensor.shared_by`` and the group ownership, and sends only the
groups both sides of a region hold); #56033 (merged, in 0.34.0) added the PP-aware pairing by
layer name this builds on.

RETIRE WHEN: vLLM pairs shared packed regions across PP sizes by the layers and groups they hold
(#46004 or equivalent); check ``register_kv_caches`` and ``_align_transfer_regions``.

TESTED BY: tests/unit/connectors/test_mooncake_dsv4_transfer.py (DeepSeek-V4 at PP=1 and PP=2
and the bundled DeepSeek-V4.1 pair at PP=2 as producers, a PP=1 decoder, planned on CPU, vLLM's
own workers: every layer view registered once under its own name, every decoder view filled by
exactly one stage, a pulled request page for page; without the split those fail, and the
control test shows stage 0 refused with the H100's message and stage 1 dropping layers 1-3's
sliding-window views), tests/gpu/test_pd_pp_producer.py with ``DSPARK_GPU_PD_PP_PAIR=dsv41``
(GPU).
"""

from __future__ import annotations

from vllm_dspark_pp.patches import when_imported
from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"


def _patch(module) -> None:
    from vllm.logger import init_logger

    from vllm_dspark_pp.connectors import mooncake_regions

    logger = init_logger("vllm.dspark_pp.mooncake")

    def make(orig):
        def register_kv_caches(self, kv_caches) -> None:
            orig(self, kv_caches)
            split = mooncake_regions.split_shared_regions(
                self, kv_caches, module._SHARED_REGION_GROUP_ID, module.extract_layer_index
            )
            if split:
                logger.info(
                    "MooncakeConnector: %d shared packed regions registered per layer view "
                    "(%d regions), so PP stages of any size pair by layer name",
                    split,
                    len(self.registered_layer_names),
                )

        return register_kv_caches

    wrap(module.MooncakeConnectorWorker, "register_kv_caches", make)


def apply() -> None:
    when_imported(TARGET, _patch)
