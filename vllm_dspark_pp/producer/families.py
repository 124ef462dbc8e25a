"""The one registry of DSpark draft families.

A family is everything the plugin knows about one kind of DSpark drafter, in one place:

* the architecture names vLLM reports for its drafts (``draft_model_config.architectures``);
* the builder of its context-KV-only drafter (the PD prefill-only producer's drafter), or
  ``None``: the family is refused on a prefill-only producer, with the supported list;
* its memory rule (``plan``'s draft bytes per role), or ``None``: ``plan`` says it has none;
* its start checks: run on every DSpark config of the family while vLLM builds its
  ``VllmConfig`` (``start_checks.check_dspark``), each raising
  :class:`DSparkConfigError` with the fix.

Adding a family is one module in ``vllm_dspark_pp/producer/`` that calls :func:`register` when
imported; :func:`families` imports every module of the package except :data:`NOT_FAMILIES`, so
nothing else lists it (``tests/unit/producer/test_families.py`` checks that each such module
registers a family, and pins the registry's contents). This module imports nothing else of the
project, so every layer may read it.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


class DSparkConfigError(ValueError):
    """A DSpark speculative config that cannot work; the message names the fix (raised by the
    start checks, generic ones in ``start_checks.py`` and each family's; defined here, at the
    bottom, so that family modules raise it without importing upward)."""


#: Modules of ``vllm_dspark_pp.producer`` that are not draft families.
NOT_FAMILIES = ("drafter", "families", "load", "roles")


@dataclass(frozen=True)
class DraftFamily:
    name: str
    architectures: tuple[str, ...]
    #: The module that registered the family (``__name__`` of the family module).
    module: str
    #: The context-KV-only drafter's top-level class, built on first call; ``None``: refused on
    #: a prefill-only producer.
    context_kv_class: Callable[..., type] | None = None
    #: ``(draft hf_config, dtype_bytes, own_embed, own_head) -> bytes`` with the keys ``full``,
    #: ``context_only``, ``fused_kv_copy`` (what the full drafter derives from its weights after
    #: loading, a copy included in ``full``; the context-only drafter holds none) and
    #: ``shared_with_target``; ``None``: plan prints no figure.
    draft_memory: Callable[[Any, int, bool, bool], dict[str, int]] | None = None
    #: Each takes the ``VllmConfig`` and raises ``DSparkConfigError`` naming the fix.
    start_checks: tuple[Callable[[Any], None], ...] = ()

    @property
    def has_context_kv_build(self) -> bool:
        return self.context_kv_class is not None

    def label(self) -> str:
        return f"{self.name} ({', '.join(self.architectures)})"


_lock = threading.RLock()
_registry: dict[str, DraftFamily] = {}
_loaded = False


def register(family: DraftFamily) -> DraftFamily:
    """Add ``family``; registering the same family again (a module re-imported) is a no-op, an
    architecture claimed by two families is an error."""
    with _lock:
        others = [f for f in _registry.values() if f.name != family.name]
        for arch in family.architectures:
            owner = next((f for f in others if arch in f.architectures), None)
            if owner is not None:
                raise ValueError(
                    f"draft architecture {arch!r} of {family.name} ({family.module}) is already "
                    f"registered by {owner.name} ({owner.module})"
                )
        _registry[family.name] = family
    return family


def _load_family_modules() -> None:
    global _loaded
    with _lock:
        if _loaded:
            return
        package = importlib.import_module(__name__.rpartition(".")[0])
        for mod in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
            if mod.name not in NOT_FAMILIES:
                importlib.import_module(f"{package.__name__}.{mod.name}")
        _loaded = True


def families() -> list[DraftFamily]:
    """Every registered family, the family modules imported first (in registration order)."""
    _load_family_modules()
    return list(_registry.values())


def family_for(architectures: Iterable[str]) -> DraftFamily | None:
    """The family of a draft that lists ``architectures`` (None: no family claims any).

    The first architecture a family claims decides (the model config's come first, see
    :func:`draft_architectures`), except that a family without a context-KV-only build wins over
    one with it: a Qwen3-Omni draft also lists the Qwen3 architecture and must be refused on a
    producer, not built as Qwen3."""
    by_arch = {a: f for f in families() for a in f.architectures}
    found = [by_arch[a] for a in architectures if a in by_arch]
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
    """The context-KV-only top-level class of this draft's family (refused if it has none)."""
    check_draft_supported(spec_config)
    family = family_for(draft_architectures(spec_config))
    assert family is not None and family.context_kv_class is not None
    return family.context_kv_class()
