"""The pure parts of the DeepSeek-V4.1 GPU group (tests/gpu/test_dsv41_pp.py, issue 42): the
bundled trained pair as ``support.mla_pairs`` finds it, and how the stock-vLLM control's start is
read (``support.pp_refusal``). No engine: vLLM has no CPU implementation of V4.1."""

from __future__ import annotations

import json
import shutil

import pytest
from support import mla_pairs, pp_refusal

pytestmark = pytest.mark.quick

REFUSAL = (
    "(EngineCore pid=1) ValueError: DeepseekV41ForCausalLM does not support dspark with "
    "pipeline parallelism"
)


def test_the_bundled_v41_pair_is_found_as_trained_for_block_7():
    pair, why = mla_pairs.trained_pair("dsv41")
    assert pair is not None, why
    assert pair.target == pair.draft and pair.target.endswith("models/dsv41-pair/dsv41")
    assert mla_pairs.block_size(pair, "dsv41") == mla_pairs.TRAINED_K == 7
    spec = pair.speculative_config(7)
    assert spec["method"] == "dspark" and spec["model"] == pair.target
    assert spec["num_speculative_tokens"] == 7
    cfg = json.loads((mla_pairs.MODELS / "dsv41-pair/dsv41/config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV41ForCausalLM"]


def test_v41_heldout_waves_are_distinct_prompts_of_the_pairs_tokenizer():
    pair, _ = mla_pairs.trained_pair("dsv41")
    waves = mla_pairs.heldout_waves(pair)
    assert [len(w) for w in waves] == [3, 5, 7]
    flat = [tuple(p) for w in waves for p in w]
    assert len(set(flat)) == 15 and all(flat)
    vocab = json.loads((mla_pairs.MODELS / "dsv41-pair/dsv41/config.json").read_text())
    assert max(max(p) for p in flat) < vocab["vocab_size"]


def test_a_missing_v41_pair_names_what_writes_it(tmp_path):
    pair, why = mla_pairs.trained_pair("dsv41", models=tmp_path)
    assert pair is None
    assert "deepseek-v4.1" in why and "train_tiny_pair --family dsv41" in why and "42" in why
    # weights gone, config and tokenizer kept: still not a pair
    d = tmp_path / "dsv41-pair" / "dsv41"
    d.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(mla_pairs.MODELS / "dsv41-pair/dsv41" / name, d / name)
    pair, why = mla_pairs.trained_pair("dsv41", models=tmp_path)
    assert pair is None and "*.safetensors" in why


def test_a_start_that_exits_naming_the_refusal_is_refused():
    logs = ["INFO starting\n" + REFUSAL + "\nmore", "INFO headless\n"]
    got = pp_refusal.read_start(ready=False, exited=["node 0 (exit 1)"], logs=logs)
    assert got["outcome"] == pp_refusal.REFUSED
    assert got["line"] == "node0: " + REFUSAL
    assert got["exited"] == ["node 0 (exit 1)"]


@pytest.mark.parametrize(
    "ready, exited, logs, outcome",
    [
        # served: the premise of the patch is gone (the control fails)
        (True, [], ["INFO ready"], pp_refusal.SERVED),
        (True, [], [REFUSAL], pp_refusal.SERVED),
        # a launcher died of something else: no evidence that stock refuses
        (False, ["node 1 (exit 1)"], ["RuntimeError: CUDA out of memory", ""], pp_refusal.FAILED),
        # the message alone, but nothing exited yet: the deadline came first
        (False, [], [REFUSAL], pp_refusal.UNDETERMINED),
    ],
    ids=["served", "served-despite-line", "other-failure", "no-exit"],
)
def test_only_an_exit_naming_the_refusal_counts_as_refused(ready, exited, logs, outcome):
    got = pp_refusal.read_start(ready=ready, exited=exited, logs=logs)
    assert got["outcome"] == outcome
    if outcome == pp_refusal.FAILED:
        assert got["line"] is None
        assert got["evidence"] == ["node0: RuntimeError: CUDA out of memory"]
