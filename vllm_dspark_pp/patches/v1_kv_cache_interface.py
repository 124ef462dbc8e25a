"""Keep non-causal (DSpark draft) MLA layers out of a causal MLA layer's KV-cache group.

WHAT: Wraps two classmethods of ``vllm.v1.kv_cache_interface``. ``MLAAttentionSpec.merge``
refuses (``AssertionError``, which every grouping step of ``vllm/v1/core/kv_cache_planning.py``
treats as "cannot share a group") to merge specs that disagree on
``non_causal_multi_token_decode``; ``UniformTypeKVCacheSpecs.is_uniform_type`` answers False for
such a mix. Together: the uniform-spec path (one group for every layer), the uniform-type path
(one group, per-layer specs) and the hybrid bucketing of
``_get_kv_cache_groups_uniform_page_size`` / ``_get_packed_kv_cache_groups`` all put a Kimi-K3
DSpark draft's MLA layers (vLLM's ``K3DSparkForCausalLM`` and our context-KV-only
``K3DSparkContextKVForCausalLM`` both register ``MLAAttentionSpec(...,
non_causal_multi_token_decode=True)``) into KV-cache groups of their own. Specs that agree on the
flag merge exactly as before.

WHY: vLLM 0.34.0 ORs the flag in ``MLAAttentionSpec.merge``. When the draft's latent geometry,
block size and KV dtype equal the target's (Kimi-K3 target MLA and the K3 DSpark draft are both
``kv_lora_rank + qk_rope_head_dim`` wide, ``num_kv_heads=1``; only an fp8 target cache keeps
them apart), the draft layers join the target's group and the target's group spec says
non-causal; a metadata builder covering target and draft layers (same backend and query heads)
is built non-causal-capable. Upstream reports NaN logits from the first token, acceptance 0 and
an illegal memory access under CUDA graph capture on Kimi-K3 DSpark; measured here (one H200,
2026-12-05, the trained tiny K3 pair, whose draft does merge without this patch) skipping it
changed nothing: same tokens, acceptance and logprobs (docs/results/gpu-dsv4-k3.md, run 5). Our
prefill-only producer registers the same spec, and a PD pair must group the draft the same way on
both sides.

UPSTREAM: vLLM PR #56952 ("[Bugfix][Kimi K3] Split DSpark draft out of the target MLA KV
group", closed unmerged; it tags the draft spec with a model version instead).

RETIRE WHEN: vLLM keeps non-causal draft MLA layers out of causal target groups (the merge no
longer ORs ``non_causal_multi_token_decode`` across a target/draft mix).

TESTED BY: tests/unit/producer/test_k3_kv_group_split.py (fails with this patch removed)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

TARGET = "vllm.v1.kv_cache_interface"

_KEY = "__vllm_dspark_pp_k3_kv_split__"


def mixes_non_causal_mla(specs: Iterable[Any]) -> bool:
    """Whether ``specs`` hold MLA specs both with and without ``non_causal_multi_token_decode``."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    flags = {
        bool(s.non_causal_multi_token_decode) for s in specs if isinstance(s, MLAAttentionSpec)
    }
    return len(flags) > 1


MESSAGE = (
    "vllm-dspark-pp: non-causal (DSpark draft) MLA layers do not share a KV cache group "
    "with causal MLA layers (vLLM PR #56952)"
)


def _wrap_classmethod(owner: type, name: str, make) -> bool:
    current = vars(owner)[name]
    if not isinstance(current, classmethod):
        raise TypeError(f"{owner.__name__}.{name} is not a classmethod in this vLLM")
    func = current.__func__
    if getattr(func, _KEY, False):
        return False
    new = make(func)
    new.__wrapped__ = func
    setattr(new, _KEY, True)
    setattr(owner, name, classmethod(new))
    return True


def apply() -> None:
    from vllm_dspark_pp.patches import when_imported

    when_imported(TARGET, _patch)


def _patch(module) -> None:
    def make_merge(orig):
        def merge(cls, specs):
            if mixes_non_causal_mla(specs):
                raise AssertionError(MESSAGE)
            return orig(cls, specs)

        return merge

    def make_is_uniform_type(orig):
        def is_uniform_type(cls, kv_cache_specs):
            if mixes_non_causal_mla(kv_cache_specs.values()):
                return False
            return orig(cls, kv_cache_specs)

        return is_uniform_type

    _wrap_classmethod(module.MLAAttentionSpec, "merge", make_merge)
    _wrap_classmethod(module.UniformTypeKVCacheSpecs, "is_uniform_type", make_is_uniform_type)


def remove() -> None:
    """Restore vLLM's methods (tests use it to show the failure without the patch)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, UniformTypeKVCacheSpecs

    for owner, name in ((MLAAttentionSpec, "merge"), (UniformTypeKVCacheSpecs, "is_uniform_type")):
        func = vars(owner)[name].__func__
        if getattr(func, _KEY, False):
            setattr(owner, name, classmethod(func.__wrapped__))
