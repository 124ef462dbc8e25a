"""Every patch module documents itself, targets a real vLLM module, and docs/patches.md matches."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from vllm_dspark_pp.patches import FIELDS, markdown_index, registry

ROOT = Path(__file__).resolve().parents[3]
PATCHES = registry()


@pytest.mark.parametrize("info", PATCHES, ids=[p.name for p in PATCHES])
def test_patch_header_is_complete(info):
    missing = [f for f in FIELDS if not info.fields.get(f)]
    assert not missing, f"{info.name} lacks header fields {missing}"
    assert "test" in info.fields["TESTED BY"].lower()


@pytest.mark.parametrize("info", PATCHES, ids=[p.name for p in PATCHES])
def test_patch_targets_a_vllm_module_and_is_named_after_it(info):
    assert info.target.startswith("vllm."), info.target
    importlib.import_module(info.target)
    expected = info.target.removeprefix("vllm.").replace(".", "_")
    assert info.name.split("__")[0] == expected, (info.name, expected)
    assert callable(getattr(info.module, "apply", None))


def test_tested_by_paths_exist():
    for info in PATCHES:
        for word in info.fields["TESTED BY"].replace(",", " ").split():
            word = word.strip("`;.()")
            if word.startswith("tests/"):
                path = word.split("::")[0]
                assert (ROOT / path).exists(), f"{info.name}: TESTED BY names missing {path}"


def test_docs_patches_md_matches_registry():
    doc = (ROOT / "docs" / "patches.md").read_text()
    assert doc.strip() == markdown_index().strip(), (
        "docs/patches.md is stale: run `vllm-dspark-pp patches --markdown > docs/patches.md`"
    )
