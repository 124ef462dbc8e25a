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

The side channel (``VLLM_DSPARK_PP_TAP_PARTIALS=side``: each stage that makes taps sends its
``W_s @ taps`` straight to the last stage, outside the intermediate tensors):

* ``side_pp2`` (``3,1``: one sender with two taps) and ``side_pp3`` (stages 0 | 1-2 | 3: two
  senders, stage 1 no longer relays stage 0's tap) give the PP=1 no-spec tokens and the raw-tap
  run's (PP=1 DSpark's) counters per position; the first stages' logged dict keys are only
  ``hidden_states`` and ``residual`` (the partial row is gone from the critical path) and each
  sender logs its side-channel row instead. Opt-in (two engine starts, about 80 s);
* in CI the shared PP=2 async run (``pair_pp2_async``, 2,2 split, async scheduling, a seeded
  sampling wave) runs the side channel (tests/support/engines.py ``PP2_ASYNC_ENV``): its tokens,
  counters and seeded wave are checked against PP=1's by test_pp_parity.py and
  test_sampling.py, its keys here (:func:`test_pp2_async_run_sends_partials_on_the_side`).
"""

from __future__ import annotations

import re

import pytest
from support.engines import run_pair
from support.parity_cpu import assert_same_counters, assert_same_tokens, describe

pytestmark = pytest.mark.e2e

PARTITION = {"VLLM_PP_LAYER_PARTITION": "3,1"}


def _run(timeout_s: float, env: dict, pp: int = 2):
    return run_pair(timeout_s, pp=pp, spec=True, env=env)


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


# ------------------------------------------------------------------ the side channel

SIDE_COVERED_BY = (
    "test_pp2_async_run_sends_partials_on_the_side and tests/e2e/test_pp_parity.py::"
    "test_pp2_dspark_async_scheduling_is_lossless (the PP=2 async run sends its partials on the "
    "side channel: tokens and counters equal PP=1's)"
)
ROW = 128 * 4  # hidden 128, float32
TARGET_ONLY = {"hidden_states": ROW, "residual": ROW}


@pytest.fixture(scope="module")
def side_pp2(e2e_timeout_s):
    return _run(e2e_timeout_s, {**PARTITION, "VLLM_DSPARK_PP_TAP_PARTIALS": "side"})


@pytest.fixture(scope="module")
def side_pp3(e2e_timeout_s):
    return _run(e2e_timeout_s, {"VLLM_DSPARK_PP_TAP_PARTIALS": "side"}, pp=3)


def side_rows(log: str, stage: int) -> dict[str, int]:
    """What PP stage ``stage`` logged at its first side-channel send (key: bytes per token row)."""
    lines = re.findall(
        rf"DSpark PP stage {stage} sends on the side channel per token row: (.*)", log
    )
    assert lines, f"stage {stage} logged no side-channel send"
    return {k: int(b) for k, b in re.findall(r"^(\w+) (\d+) B", lines[0])}


def assert_side_keys(log: str, senders: tuple[int, ...], relays: tuple[int, ...] = ()) -> None:
    """Every stage before the last sends the target's tensors only on the critical path; each
    sender sends one partial row on the side channel, a stage without taps none."""
    assert "DSpark tap partials on, side channel" in log, "the side channel is not on"
    for stage in (*senders, *relays):
        assert sent_keys(log, stage) == TARGET_ONLY, (stage, sent_keys(log, stage))
    for stage in senders:
        assert side_rows(log, stage) == {"dspark_tap_partial": ROW}, stage
    for stage in relays:
        assert f"DSpark PP stage {stage} sends on the side channel" not in log, stage
    # every link was made at start-up (TapSideChannel.connect), not at a first send in a step
    connected = re.findall(r"DSpark tap partials: side channel connected \((.*?)\)", log)
    assert sorted(c for c in connected if c.startswith("to ")) == [
        "to PP rank " + str(max((*senders, *relays)) + 1)
    ] * len(senders), connected
    assert ("from PP ranks " + ", ".join(map(str, senders))) in connected, connected


@pytest.mark.e2e_full(covered_by=SIDE_COVERED_BY)
def test_side_pp2_is_lossless_and_counts_like_raw_taps(pair_reference, pair_pp1, side_pp2):
    assert_same_tokens(pair_reference, side_pp2, "PP=2 3,1 tap partials on the side channel", None)
    print(f"PP=2 3,1 side channel: {describe(side_pp2.metrics)}")
    # pair_pp1 reads raw taps; PP=2 3,1 raw taps counts like it (test above)
    assert_same_counters(pair_pp1, side_pp2, "PP=2 3,1 side channel")


@pytest.mark.e2e_full(covered_by=SIDE_COVERED_BY)
def test_side_pp2_boundary_carries_no_partial(side_pp2):
    """The one boundary carries hidden_states and residual only; stage 0's two taps go to the
    last stage as one side-channel row (the in-dict control: test_partials_pp2_boundary_...)."""
    assert_side_keys(side_pp2.log_text, senders=(0,))
    assert "receives on the side channel: dspark_tap_partial 512 B per token row from stage 0" in (
        side_pp2.log_text
    )


@pytest.mark.e2e_full(covered_by=SIDE_COVERED_BY)
def test_side_pp3_is_lossless_and_no_boundary_carries_a_tap(pair_reference, pair_pp1, side_pp3):
    assert_same_tokens(pair_reference, side_pp3, "PP=3 tap partials on the side channel", None)
    print(f"PP=3 side channel: {describe(side_pp3.metrics)}")
    assert_same_counters(pair_pp1, side_pp3, "PP=3 side channel")
    # stages 0 and 1 each make one tap and send it straight to stage 2: boundary 1 -> 2 carries
    # no relayed partial (with "1" it carries one, with raw taps two rows)
    assert_side_keys(side_pp3.log_text, senders=(0, 1))
    assert "from stages 0, 1" in side_pp3.log_text


def test_pp2_async_run_sends_partials_on_the_side(pair_pp2_async):
    """CI's side-channel coverage, from the shared PP=2 async run (2,2 split: stage 0 makes tap
    1, the last stage taps 3 and 4); its tokens and counters: test_pp_parity.py."""
    assert_side_keys(pair_pp2_async.log_text, senders=(0,))
