"""The shared base of the context-KV-only DSpark drafters (every family module imports it).

A prefill-only producer never verifies drafts, but the decode instance's DSpark drafter reads the
draft's *context KV* for the prompt (pulled over the KV connector by layer name). So the producer
builds only what writes that KV, under the full drafter's layer names and KV-cache specs, loads
only those weights, and refuses everything that drafts (:class:`RefuseDrafting`). One module per
family builds its classes: :mod:`.qwen3`, :mod:`.deepseek_v4`, :mod:`.kimi_k3`; :mod:`.load`
picks one and loads it through vLLM's own DSpark loading path. Every other DSpark draft
architecture is refused at start on a prefill-only producer (:func:`unsupported_draft_problem`).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import SpeculativeConfig

DSV4_ARCH = "DSparkDraftModel"
K3_ARCH = "K3DSparkModel"

#: Draft architectures (``draft_model_config.architectures``) with a context-KV-only build.
CONTEXT_ONLY_ARCHITECTURES: dict[str, str] = {
    "Qwen3DSparkModel": "Qwen3 DSpark",  # qwen3.py
    "DSparkDraftModel": "DeepSeek-V4 DSpark",  # deepseek_v4.py
    "K3DSparkModel": "Kimi-K3 DSpark",  # kimi_k3.py
}

#: DSpark draft architectures vLLM 0.34.0 serves that have no context-only build yet.
KNOWN_UNSUPPORTED_ARCHITECTURES: dict[str, str] = {
    "DSparkV41DraftModel": "DeepSeek-V4.1 DSpark",
    "DSparkMiniMaxDraftModel": "MiniMax-M3 DSpark",
    "Gemma4DSparkModel": "Gemma4 DSpark",
    "Qwen3OmniDSparkModel": "Qwen3-Omni DSpark",
    "MuseSparkDSparkModel": "Muse Spark DSpark",
    "MistralLarge4DSparkModel": "Mistral Large 4 DSpark",
}


class ContextOnlyDrafterError(RuntimeError):
    """A context-KV-only drafter was asked to draft tokens."""


def _refuse(what: str) -> ContextOnlyDrafterError:
    return ContextOnlyDrafterError(
        f"{what}: this DSpark drafter was built context-KV-only because this instance is a "
        "prefill-only KV producer (kv_role='kv_producer'); it writes the draft's context KV "
        "for the decode instance and cannot draft tokens. Serve decodes from a kv_consumer or "
        "kv_both instance (kv_both keeps the full drafter)."
    )


# --------------------------------------------------------------------------- refusals
def refusing(what: str):
    """A method that raises :class:`ContextOnlyDrafterError` naming ``what``."""

    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise _refuse(what)

    refused.__doc__ = f"Refused on a context-KV-only drafter: {what}."
    return refused


def layer_holding(attn_cls: type, name: str) -> type:
    """A decoder-layer module named ``name`` whose only child is ``self_attn = attn_cls(**kwargs)``
    (the layer shape every family's checkpoint names expect) and whose forward is refused."""
    from torch import nn

    def __init__(self: Any, **kwargs: Any) -> None:
        nn.Module.__init__(self)
        self.self_attn = attn_cls(**kwargs)

    return type(
        name,
        (nn.Module,),
        {"__init__": __init__, "forward": refusing("draft decoder layer forward")},
    )


class RefuseDrafting:
    """Every drafting entry point of a DSpark drafter, refused."""

    context_kv_only = True
    draft_id_to_target_id = None

    forward = refusing("draft forward")

    embed_input_ids = refusing("draft token embedding")

    compute_logits = refusing("draft logits")

    compute_draft_logits = compute_logits
    compute_draft_logits_local = compute_logits

    map_draft_to_target = refusing("draft-to-target id map")

    markov_embed = refusing("Markov head")

    markov_bias = markov_embed
    apply_markov_bias_gathered = markov_embed
    markov_step = markov_embed

    compute_confidence = refusing("confidence head")


# --------------------------------------------------------------------------- families
def draft_architectures(spec_config: SpeculativeConfig) -> list[str]:
    draft = getattr(spec_config, "draft_model_config", None)
    if draft is None:
        return []
    return list(getattr(draft, "architectures", None) or [])


def unsupported_draft_problem(spec_config: SpeculativeConfig) -> str | None:
    """Why this draft has no context-only build (None when it has one)."""
    archs = draft_architectures(spec_config)
    if any(a in CONTEXT_ONLY_ARCHITECTURES for a in archs):
        # Qwen3-Omni drafts resolve to the Qwen3 class but are their own family.
        if not any(a in KNOWN_UNSUPPORTED_ARCHITECTURES for a in archs):
            return None
    family = next(
        (KNOWN_UNSUPPORTED_ARCHITECTURES[a] for a in archs if a in KNOWN_UNSUPPORTED_ARCHITECTURES),
        None,
    )
    name = family or (", ".join(archs) if archs else "unknown architecture")
    supported = ", ".join(f"{v} ({k})" for k, v in CONTEXT_ONLY_ARCHITECTURES.items())
    return (
        f"vllm-dspark-pp has no context-KV-only drafter for {name} yet, so it cannot serve as a "
        f"DSpark prefill-only producer (kv_role='kv_producer'). Supported: {supported}. "
        "Run this instance with kv_role='kv_both' (keeps the full drafter) or without "
        "speculative decoding on the producer."
    )


def check_draft_supported(spec_config: SpeculativeConfig) -> None:
    problem = unsupported_draft_problem(spec_config)
    if problem is not None:
        raise NotImplementedError(problem)


def weight_filter(
    keep: re.Pattern[str],
) -> tuple[Callable[[str], bool], Callable[[Iterable[str]], list[str]]]:
    """``(is_kept(name), skipped(names))`` for a family's pattern of the checkpoint tensors its
    context-only drafter loads."""

    def is_kept(name: str) -> bool:
        return keep.match(name) is not None

    def skipped(names: Iterable[str]) -> list[str]:
        return [n for n in names if keep.match(n) is None]

    return is_kept, skipped


def is_context_kv_only(model: Any) -> bool:
    return bool(getattr(model, "context_kv_only", False))


# --------------------------------------------------------------------------- MLA families
def platform_module(arch: str, registry_module: str, module_name: str | None) -> Any:
    """The module that holds vLLM's full drafter for ``arch`` on this platform."""
    if module_name is None:
        # The registry entry resolves the platform implementation (deepseek_v4/__init__.py).
        top = importlib.import_module(registry_module)
        cls_name = "DSparkDeepseekV4ForCausalLM" if arch == DSV4_ARCH else "K3DSparkForCausalLM"
        module_name = getattr(top, cls_name).__module__
    return importlib.import_module(module_name)


def refuse_platform(family: str, module: Any, missing: str) -> NotImplementedError:
    return NotImplementedError(
        f"vllm-dspark-pp's context-KV-only {family} drafter needs vLLM's CUDA implementation "
        f"({missing} is missing from {module.__name__}; vLLM 0.34.0 ships a DSpark drafter for "
        "this family only on CUDA/ROCm, and the context-only build follows the CUDA one). "
        "Run this producer on NVIDIA GPUs or with kv_role='kv_both'."
    )
