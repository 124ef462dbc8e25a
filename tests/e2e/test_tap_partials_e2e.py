"""Aux taps crossing PP stages as one partial sum (protocol/tap_partials.py), end to end on CPU.

Trained tiny pair (float32, greedy, the shared runs' 32 held-out prompts and settings), aux ids
(1, 3, 4) of a 4-layer target. With ``VLLM_PP_LAYER_PARTITION=3,1`` the first stage makes taps 1
and 3, so in vLLM's relay the one boundary carries two tap rows; with partial sums one row.

* ``partials_pp2`` (``VLLM_DSPARK_PP_TAP_PARTIALS=auto``) and its control ``raw_pp2`` (the
  default, ``0``): both give the PP=1 no-spec tokens and PP=1 DSpark's
  spec-decode counters per position (float32; the drafter's input differs only by summation
  order); the sent keys logged by the first stage are ``hidden_states``, ``residual`` and
  ``dspark_tap_partial`` in the partial run, and two ``aux_hidden_states_*`` rows in place of
  the partial in the control (which therefore fails the partial run's key check).
* the shared PP=3 run (``pair_pp3_sync``, stages 0 | 1-2 | 3, one tap each: boundary 1->2
  relays two taps) runs partial sums (``VLLM_DSPARK_PP_TAP_PARTIALS=1``, tests/support/
  engines.py); its tokens and counters are checked by tests/e2e/test_pp_parity.py (equal to
  PP=1's, like every raw-tap PP run's), its keys here.

The PP=2 pair costs two engine starts (about 80 s), so CI leaves it out (``e2e_full``); the PP=3
run covers the partial sums there.
"""

from __future__ import annotations

import re

import pytest
from support import tiny_pair
from support.e2e import run_generate
from support.engines import PAIR_LLM, PAIR_SAMPLING, pair_prompts, plugin_env
from support.parity_cpu import assert_same_counters, assert_same_tokens, describe

pytestmark = pytest.mark.e2e

PARTITION = {"VLLM_PP_LAYER_PARTITION": "3,1"}


def _run(timeout_s: float, env: dict):
    ok, why = tiny_pair.available()
    if not ok:
        pytest.fail(why)
    cfg = {
        "model": tiny_pair.TARGET,
        "pipeline_parallel_size": 2,
        "speculative_config": tiny_pair.spec_config(),
        **PAIR_LLM,
    }
    return run_generate(
        cfg, pair_prompts(), timeout_s, sampling=PAIR_SAMPLING, env={**plugin_env(), **env}
    )


PP2_COVERED_BY = (
    "test_pp3_run_sends_partials and tests/e2e/test_pp_parity.py::"
    "test_pp_dspark_sync_scheduling_is_lossless[3] (the PP=3 run relays partial sums: tokens "
    "and counters equal PP=1's); every other PP e2e run relays raw taps"
)


@pytest.fixture(scope="module")
def partials_pp2(e2e_timeout_s):
    return _run(e2e_timeout_s, {**PARTITION, "VLLM_DSPARK_PP_TAP_PARTIALS": "auto"})


@pytest.fixture(scope="module")
def raw_pp2(e2e_timeout_s):
    return _run(e2e_timeout_s, PARTITION)


def sent_keys(log: str, stage: int) -> dict[str, int]:
    """The keys (and bytes per token row) PP stage ``stage`` logged at its first send."""
    lines = re.findall(rf"DSpark PP stage {stage} sends per token row: (.*)", log)
    assert lines, f"stage {stage} logged no sent keys"
    return {k: int(b) for k, b in re.findall(r"(\w+) (\d+) B", lines[0])}


@pytest.mark.e2e_full(covered_by=PP2_COVERED_BY)
def test_partials_pp2_is_lossless_and_counts_like_raw_taps(
    pair_reference, pair_pp1, partials_pp2, raw_pp2
):
    assert_same_tokens(pair_reference, partials_pp2, "PP=2 3,1 tap partials", None)
    assert_same_tokens(pair_reference, raw_pp2, "PP=2 3,1 raw taps", None)
    print(f"PP=2 3,1 tap partials: {describe(partials_pp2.metrics)}")
    print(f"PP=2 3,1 raw taps:     {describe(raw_pp2.metrics)}")
    assert_same_counters(raw_pp2, partials_pp2, "PP=2 3,1 tap partials vs raw taps")
    assert_same_counters(pair_pp1, partials_pp2, "PP=2 3,1 tap partials")


@pytest.mark.e2e_full(covered_by=PP2_COVERED_BY)
def test_partials_pp2_boundary_carries_one_partial_row(partials_pp2, raw_pp2):
    row = 128 * 4  # hidden 128, float32
    want = {"hidden_states": row, "residual": row, "dspark_tap_partial": row}
    assert "DSpark tap partials on" in partials_pp2.log_text
    assert sent_keys(partials_pp2.log_text, 0) == want
    # the control: vLLM's relay, two tap rows where the partial goes
    raw = sent_keys(raw_pp2.log_text, 0)
    assert "DSpark tap partials off (VLLM_DSPARK_PP_TAP_PARTIALS=0)" in raw_pp2.log_text
    assert raw == {
        "hidden_states": row,
        "residual": row,
        "aux_hidden_states_0": row,
        "aux_hidden_states_1": row,
    }
    assert raw != want


def test_pp3_run_sends_partials(pair_pp3_sync):
    row = 128 * 4
    log = pair_pp3_sync.log_text
    assert "DSpark tap partials on" in log
    for stage in (0, 1):
        assert sent_keys(log, stage) == {
            "hidden_states": row,
            "residual": row,
            "dspark_tap_partial": row,
        }
