"""Refuse, with the fix named, a KV-cache plan that would have to merge non-causal draft MLA
layers into a causal MLA group.

WHAT: Wraps ``vllm.v1.core.kv_cache_planning.unify_hybrid_kv_cache_specs`` (run by
``get_kv_cache_groups`` only when the hybrid KV-cache manager is disabled, i.e. everything must
become one KV-cache group): when the specs mix non-causal MLA layers (a Kimi-K3 DSpark draft,
full or context-KV-only) with causal ones, it raises a ``ValueError`` naming the fix instead.

WHY: patches/v1_kv_cache_interface.py keeps such layers in KV-cache groups of their own; with
the hybrid manager disabled (``--disable-hybrid-kv-cache-manager``, or a KV connector without
HMA support, e.g. vLLM's ExampleConnector) one group is mandatory, and vLLM would otherwise stop
with "Failed to promote local KV cache specs to one unified type", which names no cause.
Merging instead is the hazard of vLLM PR #56952 (NaN logits, acceptance 0, illegal memory
access under CUDA graphs).

UPSTREAM: vLLM PR #56952 (closed unmerged), as patches/v1_kv_cache_interface.py.

RETIRE WHEN: patches/v1_kv_cache_interface.py is retired.

TESTED BY: tests/unit/producer/test_k3_kv_group_split.py
(test_single_group_plan_is_refused_with_the_fix_named)
"""

from __future__ import annotations

TARGET = "vllm.v1.core.kv_cache_planning"

MESSAGE = (
    "vllm-dspark-pp: this model has non-causal DSpark draft MLA layers (Kimi-K3 DSpark) whose "
    "KV cache must not share a group with the target's causal MLA layers (vLLM PR #56952), but "
    "the hybrid KV cache manager is disabled, which forces a single group. Enable it: do not "
    "pass --disable-hybrid-kv-cache-manager, and use a KV connector that supports it "
    "(MooncakeConnector does; ExampleConnector does not)."
)


def apply() -> None:
    from vllm_dspark_pp.patches import when_imported

    when_imported(TARGET, _patch)


def _patch(planning) -> None:
    from vllm_dspark_pp.patches._util import wrap
    from vllm_dspark_pp.patches.v1_kv_cache_interface import mixes_non_causal_mla

    def make(orig):
        def unify_hybrid_kv_cache_specs(kv_cache_spec, *args, **kwargs):
            if mixes_non_causal_mla(kv_cache_spec.values()):
                raise ValueError(MESSAGE)
            return orig(kv_cache_spec, *args, **kwargs)

        return unify_hybrid_kv_cache_specs

    wrap(planning, "unify_hybrid_kv_cache_specs", make)
