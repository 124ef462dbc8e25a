"""The one registry of DSpark draft families.

A family is everything the plugin knows about one kind of DSpark drafter, in one row of
:data:`FAMILIES`:

* the architecture names vLLM reports for its drafts (``draft_model_config.architectures``);
* its context-KV-only drafter (the PD prefill-only producer's drafter), a top-level class named
  ``"module:Class"`` and imported only when a producer builds it, or ``None``: the family is
  refused on a prefill-only producer, with the supported list;
* its memory rule (``plan``'s draft bytes per role), ``"module:function"``, or ``None``: ``plan``
  says it has none;
* its start checks, ``"module:function"`` each: run on every DSpark config of the family while
  vLLM builds its ``VllmConfig`` (``start_checks.check_dspark``), each raising
  ``drafter.DSparkConfigError`` with the fix.

As in vLLM's model registry, the names are strings resolved on first use, so reading the
registry imports no family module (``plan`` and the start checks never import a drafter's
model code). This module imports nothing else of the project, so every layer may read it, and
nothing it names imports it back (``tests/unit/repo/test_layering.py`` follows the names).
Adding a family is its module, its row here and its tests (docs/contributing.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


def resolve(name: str) -> Any:
    """The object a ``"package.module:attribute"`` name names (the module imported now)."""
    module, sep, attr = name.partition(":")
    if not sep or not attr:
        raise ValueError(f"{name!r} is not a 'module:attribute' name")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class DraftFamily:
    name: str
    architectures: tuple[str, ...]
    #: ``"module:Class"`` of the context-KV-only drafter's top level; ``None``: refused on a
    #: prefill-only producer.
    context_kv: str | None = None
    #: ``"module:function"`` of the memory rule, ``(draft hf_config, dtype_bytes, own_embed,
    #: own_head) -> bytes`` with the keys ``full``, ``context_only``, ``fused_kv_copy`` (what the
    #: full drafter derives from its weights after loading, a copy included in ``full``; the
    #: context-only drafter holds none) and ``shared_with_target``; ``None``: plan prints no
    #: figure.
    memory: str | None = None
    #: ``"module:function"`` each; the function takes the ``VllmConfig`` and raises
    #: ``DSparkConfigError`` naming the fix.
    checks: tuple[str, ...] = ()
    #: The attribute of the drafter's inner ``model`` that ``combine_hidden_states`` applies
    #: first to the concatenated aux taps: a bias-free linear, nothing before it (vLLM 0.34.0:
    #: Qwen3 ``fc`` then its norm, qwen3_dflash.py:958-979; DeepSeek-V4/V4.1 ``main_proj`` then
    #: ``main_norm``, dspark.py; Kimi-K3 ``context_proj`` then ``context_norm``,
    #: dspark_mla.py:216). ``None``: not known, so a PP target relays raw taps
    #: (protocol/tap_partials.py).
    context_linear: str | None = None

    @property
    def has_context_kv_build(self) -> bool:
        return self.context_kv is not None

    def context_kv_class(self) -> type:
        """The context-KV-only drafter's top-level class (its module imported now)."""
        if self.context_kv is None:
            raise NotImplementedError(f"{self.name} has no context-KV-only drafter")
        return resolve(self.context_kv)

    @property
    def draft_memory(self) -> Callable[[Any, int, bool, bool], dict[str, int]] | None:
        return None if self.memory is None else resolve(self.memory)

    @property
    def start_checks(self) -> tuple[Callable[[Any], None], ...]:
        return tuple(resolve(c) for c in self.checks)

    def label(self) -> str:
        return f"{self.name} ({', '.join(self.architectures)})"


#: Every DSpark draft family vLLM 0.34.0 serves. Those without a context-KV-only build decode as
#: usual (aggregated, or on a PD decoder); a prefill-only producer refuses them at start.
FAMILIES: tuple[DraftFamily, ...] = (
    DraftFamily(
        "Qwen3 DSpark",
        ("Qwen3DSparkModel",),
        "vllm_dspark_pp.producer.qwen3:Qwen3DSparkContextKVForCausalLM",
        # measured, docs/results/performance.md
        memory="vllm_dspark_pp.producer.memory:draft_load_bytes",
        context_linear="fc",
    ),
    DraftFamily(
        "DeepSeek-V4 DSpark",
        ("DSparkDraftModel",),
        "vllm_dspark_pp.producer.deepseek_v4:DSparkDeepseekV4ContextKVForCausalLM",
        # its drafter ships inside the target checkpoint: the target must be a DeepSeek-V4 one
        checks=("vllm_dspark_pp.producer.drafter:check_target_carries_the_draft",),
        context_linear="main_proj",
    ),
    DraftFamily(
        "Kimi-K3 DSpark",
        ("K3DSparkModel",),
        "vllm_dspark_pp.producer.kimi_k3:K3DSparkContextKVForCausalLM",
        context_linear="context_proj",
    ),
    DraftFamily(
        "DeepSeek-V4.1 DSpark",
        ("DSparkV41DraftModel",),
        "vllm_dspark_pp.producer.deepseek_v41:DSparkDeepseekV41ContextKVForCausalLM",
        memory="vllm_dspark_pp.producer.memory:v41_draft_bytes",
        checks=("vllm_dspark_pp.producer.drafter:check_target_carries_the_draft",),
        context_linear="main_proj",
    ),
    # No context-KV-only build yet: giving one a build is its module plus a class name here.
    DraftFamily("MiniMax-M3 DSpark", ("DSparkMiniMaxDraftModel",)),
    DraftFamily("Gemma4 DSpark", ("Gemma4DSparkModel",)),
    # a Qwen3-Omni draft also lists Qwen3DSparkModel: the refusal wins (family_for)
    DraftFamily("Qwen3-Omni DSpark", ("Qwen3OmniDSparkModel",)),
    DraftFamily("Muse Spark DSpark", ("MuseSparkDSparkModel",)),
    DraftFamily("Mistral Large 4 DSpark", ("MistralLarge4DSparkModel",)),
)


def by_architecture(table: Iterable[DraftFamily]) -> dict[str, DraftFamily]:
    """Architecture name -> family; an architecture claimed by two families is an error."""
    out: dict[str, DraftFamily] = {}
    for family in table:
        for arch in family.architectures:
            owner = out.get(arch)
            if owner is not None:
                raise ValueError(
                    f"draft architecture {arch!r} of {family.name} is already claimed by "
                    f"{owner.name}"
                )
            out[arch] = family
    return out


_BY_ARCH = by_architecture(FAMILIES)  # a second claim fails at import


def families() -> list[DraftFamily]:
    """Every family, in the order of :data:`FAMILIES`."""
    return list(FAMILIES)


def family_for(architectures: Iterable[str]) -> DraftFamily | None:
    """The family of a draft that lists ``architectures`` (None: no family claims any).

    The first architecture a family claims decides (the model config's come first, see
    :func:`draft_architectures`), except that a family without a context-KV-only build wins over
    one with it: a Qwen3-Omni draft also lists the Qwen3 architecture and must be refused on a
    producer, not built as Qwen3."""
    found = [_BY_ARCH[a] for a in architectures if a in _BY_ARCH]
    refused = [f for f in found if not f.has_context_kv_build]
    if refused:
        return refused[0]
    return found[0] if found else None


def supported_families() -> list[DraftFamily]:
    """The families with a context-KV-only build."""
    return [f for f in families() if f.has_context_kv_build]


# --------------------------------------------------------------------------- questions of a config
def draft_architectures(spec_config: Any) -> list[str]:
    """The draft's architectures: the model config's, then any other its HF config lists (the one
    answer the start checks, the refusals and the producer's class choice all use)."""
    draft = getattr(spec_config, "draft_model_config", None)
    archs = list(getattr(draft, "architectures", None) or [])
    hf = getattr(draft, "hf_config", None)
    archs += [a for a in (getattr(hf, "architectures", None) or []) if a not in archs]
    return archs


def unsupported_draft_problem(spec_config: Any) -> str | None:
    """Why this draft has no context-KV-only build, so no prefill-only producer can serve it
    (None when it has one)."""
    archs = draft_architectures(spec_config)
    family = family_for(archs)
    if family is not None and family.has_context_kv_build:
        return None
    name = family.name if family else (", ".join(archs) if archs else "unknown architecture")
    supported = ", ".join(f.label() for f in supported_families())
    return (
        f"vllm-dspark-pp has no context-KV-only drafter for {name} yet, so it cannot serve as a "
        f"DSpark prefill-only producer (kv_role='kv_producer'). Supported: {supported}. "
        "Run this instance with kv_role='kv_both' (keeps the full drafter) or without "
        "speculative decoding on the producer."
    )


def check_draft_supported(spec_config: Any) -> None:
    problem = unsupported_draft_problem(spec_config)
    if problem is not None:
        raise NotImplementedError(problem)


def context_kv_class_for(spec_config: Any) -> type:
    """The context-KV-only top-level class of this draft's family, imported now; refused if the
    family has none, or if this platform cannot build it (the class's ``check_platform``)."""
    check_draft_supported(spec_config)
    family = family_for(draft_architectures(spec_config))
    assert family is not None
    cls: Any = family.context_kv_class()
    cls.check_platform()
    return cls
