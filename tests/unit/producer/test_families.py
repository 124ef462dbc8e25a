"""The draft-family registry (vllm_dspark_pp/producer/families.py).

:data:`EXPECTED` is the one table of families in the tests: adding a family is its module plus a
row here plus its own tests (docs/contributing.md). Every other family-dependent test reads the
registry.
"""

from __future__ import annotations

import pkgutil
import types

import pytest

from vllm_dspark_pp import deployment_plan, producer
from vllm_dspark_pp.producer import families

#: name -> (architectures, has a context-KV-only build, has a memory rule, has start checks)
EXPECTED = {
    "Qwen3 DSpark": (("Qwen3DSparkModel",), True, True, False),
    "DeepSeek-V4 DSpark": (("DSparkDraftModel",), True, False, True),
    "Kimi-K3 DSpark": (("K3DSparkModel",), True, False, False),
    "DeepSeek-V4.1 DSpark": (("DSparkV41DraftModel",), True, True, True),
    "MiniMax-M3 DSpark": (("DSparkMiniMaxDraftModel",), False, False, False),
    "Gemma4 DSpark": (("Gemma4DSparkModel",), False, False, False),
    "Qwen3-Omni DSpark": (("Qwen3OmniDSparkModel",), False, False, False),
    "Muse Spark DSpark": (("MuseSparkDSparkModel",), False, False, False),
    "Mistral Large 4 DSpark": (("MistralLarge4DSparkModel",), False, False, False),
}


def _spec(*archs):
    return types.SimpleNamespace(
        draft_model_config=types.SimpleNamespace(architectures=list(archs))
    )


def test_the_registry_holds_these_families():
    found = {
        f.name: (f.architectures, f.has_context_kv_build, f.draft_memory is not None)
        + (bool(f.start_checks),)
        for f in families.families()
    }
    assert found == EXPECTED


def test_every_producer_module_but_the_infrastructure_registers_a_family():
    """A family module is found by being in the package: each one must register itself, and
    every family names the module that registered it."""
    modules = {
        f"{producer.__name__}.{m.name}"
        for m in pkgutil.iter_modules(producer.__path__)
        if m.name not in families.NOT_FAMILIES
    }
    registering = {f.module for f in families.families()}
    assert registering == modules


def test_an_architecture_belongs_to_one_family():
    clash = families.DraftFamily("Another K3", ("K3DSparkModel",), __name__)
    with pytest.raises(ValueError, match="'K3DSparkModel' of Another K3.*already registered by "):
        families.register(clash)
    assert "Another K3" not in {f.name for f in families.families()}


@pytest.mark.parametrize("family", families.families(), ids=lambda f: f.name)
def test_producers_refuse_exactly_the_families_without_a_build(family):
    problem = families.unsupported_draft_problem(_spec(*family.architectures))
    assert (problem is None) == family.has_context_kv_build
    if problem is not None:
        assert f"no context-KV-only drafter for {family.name} yet" in problem
        for supported in families.supported_families():
            assert supported.label() in problem
        assert "kv_both" in problem
        with pytest.raises(NotImplementedError, match="kv_both"):
            families.check_draft_supported(_spec(*family.architectures))


def test_unknown_and_missing_architectures_are_refused_by_name():
    assert "for SomethingElse yet" in families.unsupported_draft_problem(_spec("SomethingElse"))
    assert "for unknown architecture yet" in families.unsupported_draft_problem(_spec())


def test_a_qwen3_omni_draft_is_refused_though_it_lists_the_qwen3_architecture():
    for archs in (
        ("Qwen3DSparkModel", "Qwen3OmniDSparkModel"),
        ("Qwen3OmniDSparkModel", "Qwen3DSparkModel"),
    ):
        assert families.family_for(archs).name == "Qwen3-Omni DSpark"
        assert "Qwen3-Omni DSpark" in families.unsupported_draft_problem(_spec(*archs))


def test_the_architectures_of_model_and_hf_config_are_one_answer():
    spec = types.SimpleNamespace(
        draft_model_config=types.SimpleNamespace(
            architectures=["Qwen3DSparkModel"],
            hf_config=types.SimpleNamespace(architectures=["DSparkDraftModel", "Qwen3DSparkModel"]),
        )
    )
    assert families.draft_architectures(spec) == ["Qwen3DSparkModel", "DSparkDraftModel"]
    assert families.family_for(families.draft_architectures(spec)).name == "Qwen3 DSpark"


def test_plan_sizes_a_draft_by_its_family_memory_rule():
    """A family without a memory rule gets the sentence naming the families that have one, not
    a Qwen3 formula applied to another shape."""
    hf = types.SimpleNamespace(architectures=["K3DSparkModel"])
    spec = types.SimpleNamespace(
        draft_model_config=types.SimpleNamespace(architectures=["K3DSparkModel"], hf_config=hf)
    )
    out = deployment_plan._draft_bytes_by_role(spec, None, 2)
    sized = [f.name for f in families.families() if f.draft_memory is not None]
    assert out == {"draft bytes": f"computed for {' and '.join(sized)} drafts only"}
    # registration order follows import order, which the rest of the suite decides
    assert sorted(sized) == ["DeepSeek-V4.1 DSpark", "Qwen3 DSpark"]
