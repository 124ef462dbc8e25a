"""CPU end to end: a PP=2 DSpark prefill-only producer feeding a PP=1 decoder.

Over a file connector (``dspark_pp_draft_kv_connector``: vLLM's ExampleConnector plus the draft
layers, whose context KV is written outside the attention forward):

1. aggregated run (PP=1, no connector, full drafter): the reference tokens and acceptance;
2. reference producer (PP=1, ``kv_both`` -> full drafter) writes a KV store;
3. the producer under test (PP=2, ``kv_producer`` -> context-KV-only drafter on the last stage)
   writes another store;
4. every saved layer, target and draft, is bitwise equal between the two stores;
5. a PP=1 decoder (``kv_consumer``, full drafter) loads the PP=2 producer's store and produces
   exactly the aggregated tokens with exactly the aggregated acceptance counts.

Step 4 is what proves the draft's context KV: with the tiny pair the decoder's acceptance does
not react to corrupted draft KV (checked: draft-layer files overwritten with noise gave the same
``accepted_per_pos`` ``[21, 0, 0, 0]``; every accept is at draft position 0), so step 5 alone
could not catch a wrong draft KV; step 4 can (any wrong byte fails it). Step 5 also fails if the
draft layer's file is missing (ExampleConnector's loader opens one file per KV layer).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/, for e2e.harness

from e2e.harness import run_generate  # noqa: E402

WORDS = (
    "the quick brown fox jumps over the lazy dog while a small cat sleeps on a warm mat near "
    "the door of an old house by the river where boats pass slowly in the morning light and "
    "birds sing"
).split()
# 40 and 47 words: one full 32-token block of KV per prompt goes through the connector.
PROMPTS = [" ".join((WORDS * 4)[i : i + 40 + 7 * i]) for i in range(2)]
CONNECTOR = "DSparkDraftKVFileConnector"
DRAFT_LAYER = "model.layers.6.self_attn.attn"  # tiny target has 6 layers (0-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from vllm_dspark_pp.tiny_models import make_tiny_models

    return make_tiny_models(tmp_path_factory.mktemp("tiny"))


def _kv(role: str, store: Path) -> dict:
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": "dspark_pp_draft_kv_connector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }


def _load_store(store: Path) -> dict[tuple[str, str], object]:
    import safetensors.torch as st

    out = {}
    for d in sorted(store.iterdir()):
        for f in sorted(d.iterdir()):
            out[(d.name, f.name.removesuffix(".safetensors"))] = st.load_file(str(f))["kv_cache"]
    return out


def test_pp2_producer_context_only_feeds_pp1_decoder(tiny, tmp_path, e2e_timeout_s):
    import torch

    base = {
        "model": tiny.target,
        "speculative_config": {"method": "dspark", "model": tiny.draft},
        "block_size": 32,
    }
    env = {"PYTHONPATH": str(HERE)}
    ref_store, prod_store = tmp_path / "ref", tmp_path / "prod"
    ref_store.mkdir()
    prod_store.mkdir()
    report = tmp_path / "context_kv_builds.jsonl"

    agg = run_generate(dict(base), PROMPTS, timeout_s=e2e_timeout_s, sampling={"max_tokens": 24})
    assert agg.metrics["num_drafts"] > 0

    ref = run_generate(
        dict(base, kv_transfer_config=_kv("kv_both", ref_store)),
        PROMPTS,
        timeout_s=e2e_timeout_s,
        sampling={"max_tokens": 1},
        env=dict(env, VLLM_DSPARK_PP_CONTEXT_KV_REPORT=str(report)),
    )
    assert not report.exists(), "kv_both must keep the full drafter"

    prod = run_generate(
        dict(base, kv_transfer_config=_kv("kv_producer", prod_store), pipeline_parallel_size=2),
        PROMPTS,
        timeout_s=e2e_timeout_s,
        sampling={"max_tokens": 1},
        env=dict(env, VLLM_DSPARK_PP_CONTEXT_KV_REPORT=str(report)),
    )
    assert prod.config["pipeline_parallel_size"] == 2
    assert [t[:1] for t in agg.tokens] == prod.tokens == ref.tokens
    assert prod.metrics["num_drafts"] == 0
    # Exactly one context-only drafter was built (on the last stage), and only its KV parts.
    builds = [json.loads(line) for line in report.read_text().splitlines()]
    assert len(builds) == 1, builds
    assert builds[0]["layers"] == [DRAFT_LAYER]
    # The worker's SpeculativeConfig saw the KV role through the attachment that pickling
    # carried from the engine process (patches/config_speculative.py).
    assert builds[0]["attached_prefill_only"] is True
    assert builds[0]["params"] == [
        "model.fc.weight",
        "model.hidden_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
        "model.layers.0.self_attn.qkv_proj.weight",
    ]

    ref_kv, prod_kv = _load_store(ref_store), _load_store(prod_store)
    assert len({k[0] for k in ref_kv}) == len(PROMPTS)
    assert set(ref_kv) == set(prod_kv)
    assert {k[1] for k in prod_kv} >= {DRAFT_LAYER, "model.layers.0.self_attn.attn"}
    for key in ref_kv:
        assert torch.equal(ref_kv[key], prod_kv[key]), f"KV differs for {key}"
        assert ref_kv[key].abs().sum() > 0, f"empty KV for {key}"

    dec = run_generate(
        dict(base, kv_transfer_config=_kv("kv_consumer", prod_store)),
        PROMPTS,
        timeout_s=e2e_timeout_s,
        sampling={"max_tokens": 24},
        env=env,
    )
    assert dec.tokens == agg.tokens
    assert dec.acceptance == agg.acceptance
    assert dec.metrics["accepted_per_pos"] == agg.metrics["accepted_per_pos"]

