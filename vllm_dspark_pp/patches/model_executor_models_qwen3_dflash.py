"""Per-layer K-norm of the DFlash/DSpark context keys on the CPU platform.

WHAT: On CPU only, ``DFlashQwen3Model._normalize_context_k`` normalizes the context keys of each
draft layer with that layer's own ``k_norm`` weight (``vllm_dspark_pp.cpu_ops.grouped_rms_norm``)
instead of one grouped ``_C.rms_norm`` call.

WHY: vLLM 0.34.0 stacks the draft layers' k_norm weights into ``[num_layers, head_dim]``
(qwen3_dflash.py ``_build_context_kv_buffers``) and relies on the CUDA rms_norm kernel selecting
the row by the outermost index (qwen3_dflash.py ``_normalize_context_k``). The CPU kernel reads only
the first ``head_dim`` weights, so every layer after the first uses layer 0's k_norm for its
context keys. Drafts with two or more layers then draft differently on CPU than their weights say
(found by tests/unit/dspark_dev/training/test_dspark_equivalence.py: max base-logit error 0.5
before, 0 after).
Greedy output stays lossless either way; drafts and acceptance counts do not.

UPSTREAM: none yet (a CPU rms_norm kernel that honours a 2-D weight, or a per-layer loop in
qwen3_dflash.py on CPU).

RETIRE WHEN: vLLM's CPU ``_C.rms_norm`` supports a per-group weight.

TESTED BY: tests/unit/dspark_dev/training/test_dspark_equivalence.py
"""

from __future__ import annotations

from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.model_executor.models.qwen3_dflash"


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return  # the CUDA kernel is correct; nothing to import or change
    from vllm_dspark_pp.patches import when_imported

    when_imported(TARGET, _patch)


def _patch(qwen3_dflash) -> None:
    def make(orig):
        def _normalize_context_k(self, all_k):
            w = self._k_norm_weights
            if all_k.device.type == "cpu" and w.dim() == 2 and w.shape[0] > 1:
                from vllm_dspark_pp.cpu_ops import grouped_rms_norm

                return grouped_rms_norm(all_k, w, self._rms_norm_eps)
            return orig(self, all_k)

        return _normalize_context_k

    wrap(qwen3_dflash.DFlashQwen3Model, "_normalize_context_k", make)
