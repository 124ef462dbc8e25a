"""Kimi-K3 KDA: the zero padding shard of ``in_proj_qkvgfab`` is not a checkpoint shard.

WHAT: Wraps ``_KimiGDNMergedColumnParallelLinear.pop_missing_shards`` (the KDA layer's fused
q/k/v/g/f_a/b input projection): when the layer pads its TP-local rows (``padding_size`` > 0),
the last shard id, the padding vLLM appends, is dropped from the shards it reports missing. Every
other shard is still reported when no checkpoint tensor filled it; weights, loading and the
forward are unchanged.

WHY: vLLM 0.34.0 appends a padding shard to ``in_proj_qkvgfab`` when
4*H*d/TP + d + H/TP rows per rank are not a multiple of 16 (models/kimi_k3/nvidia/kda.py:641-669)
and zero-fills it itself, leaving its rows out of the load-completion count (kda.py:132-138).
But ``MergedColumnParallelLinear`` makes every entry of its output sizes a shard id
(model_executor/layers/linear.py:787), the loader only fills shards 0-5 (q, k, v, g, f_a, b;
models/kimi_k3/nvidia/model.py:1342-1356), and ``pop_missing_shards`` (linear.py:729-742) reports
each shard with rows on the rank that nothing loaded. ``track_weights_loading``, on for every
unquantized checkpoint (model_loader/default_loader.py:547-573, 608-612), then stops the engine
("Following weights were not initialized from checkpoint:
{'model.layers.2.self_attn.in_proj_qkvgfab.weight.6'}"). The bundled K3 target (16 KDA heads x
16) needs no padding at TP=1 (1,056 rows) but 8 rows at TP=2 (536 rows per rank): its TP=2 x
PP=2 engine did not start on an H100 (2026-12-06), and stock vLLM refuses it the same way.

UPSTREAM: none yet (leave the padding out of ``shard_ids``, or exempt it in
``_KimiGDNMergedColumnParallelLinear``; the same padding is in the ROCm layer, amd/kda.py).

RETIRE WHEN: vLLM's KDA layer no longer reports its padding shard as missing.

TESTED BY: tests/unit/producer/test_k3_weight_tracking.py
"""

from __future__ import annotations

from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.models.kimi_k3.nvidia.kda"


def apply() -> None:
    from vllm_dspark_pp.patches import when_imported

    when_imported(TARGET, _patch)


def _patch(kda) -> None:
    def make(orig):
        def pop_missing_shards(self):
            missing = orig(self)
            if not getattr(self, "padding_size", 0):
                return missing
            # the padding is the last output size (kda.py:658-659); entries are "<param>.<shard>"
            padding = str(len(self.output_sizes) - 1)
            return [entry for entry in missing if entry.rsplit(".", 1)[-1] != padding]

        return pop_missing_shards

    wrap(kda._KimiGDNMergedColumnParallelLinear, "pop_missing_shards", make)
