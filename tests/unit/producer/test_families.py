"""The draft-family registry (vllm_dspark_pp/producer/families.py).

:data:`EXPECTED` is the one table of families in the tests: adding a family is its module, its
row in the registry, a row here and its own tests (docs/contributing.md). Every other
family-dependent test reads the registry.
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from vllm_dspark_pp import deployment_plan
from vllm_dspark_pp.producer import drafter, families

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


@pytest.mark.parametrize("family", families.families(), ids=lambda f: f.name)
def test_every_name_the_registry_holds_resolves(family):
    """Each ``"module:attribute"`` name imports, and names what the row says: the family's
    context-KV-only top level (a top-level class of its module, of this family), its memory
    rule and its start checks (functions)."""
    if family.has_context_kv_build:
        cls = family.context_kv_class()
        module, _, name = family.context_kv.partition(":")
        assert (cls.__module__, cls.__qualname__) == (module, name)
        assert issubclass(cls, drafter.ContextKVDrafter) and cls.family == family.name
    else:
        with pytest.raises(NotImplementedError, match="no context-KV-only drafter"):
            family.context_kv_class()
    for rule in (family.draft_memory, *family.start_checks):
        assert rule is None or callable(rule)


def test_a_name_that_is_not_module_and_attribute_is_refused():
    with pytest.raises(ValueError, match="not a 'module:attribute' name"):
        families.resolve("vllm_dspark_pp.producer.qwen3")
    with pytest.raises(AttributeError):
        families.resolve("vllm_dspark_pp.producer.memory:no_such_rule")


def test_reading_the_registry_imports_no_family_module():
    """``plan`` and the start checks read the registry in every process; the drafters' model code
    (and vLLM's) is imported only when a producer builds its drafter."""
    code = (
        "import sys\n"
        "from vllm_dspark_pp.producer import families\n"
        "[(f.label(), f.draft_memory, f.start_checks) for f in families.families()]\n"
        "families.unsupported_draft_problem(None)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('vllm_dspark_pp.producer.', "
        "'vllm.models', 'vllm.model_executor.models'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == str(
        [
            "vllm_dspark_pp.producer.drafter",
            "vllm_dspark_pp.producer.families",
            "vllm_dspark_pp.producer.memory",
        ]
    )


def test_an_architecture_belongs_to_one_family():
    clash = families.DraftFamily("Another K3", ("K3DSparkModel",))
    with pytest.raises(ValueError, match="'K3DSparkModel' of Another K3 is already claimed by "):
        families.by_architecture([*families.families(), clash])
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
    assert sized == ["Qwen3 DSpark", "DeepSeek-V4.1 DSpark"]  # the registry's order
