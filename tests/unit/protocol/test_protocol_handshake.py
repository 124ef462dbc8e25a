"""The PP start-up handshake over three real gloo processes: agreement passes; mismatched
versions, mismatched k, mismatched adaptive verification or count lag and a silent rank (a rank
without the plugin) each fail every participating rank fast, with one message naming the rank and
the field."""

from __future__ import annotations

import pytest
from protocol_gloo_workers import HANDSHAKE_SCENARIOS, handshake_worker, run_processes

TIMEOUT = 6.0  # handshake timeout inside the workers (seconds)
# ... of the two silent-rank scenarios, whose other ranks wait it out (plus the 5 s verdict grace
# where the last rank is silent); the others never wait for a timeout, so theirs can be roomy.
SILENT_TIMEOUT = 2.0
# Bounds are loose on purpose (CI machines are shared): "fast" means no wait beyond the
# timeout plus its grace, never a hang.
SLACK = 10.0


@pytest.fixture(scope="module")
def outcomes():
    names = list(HANDSHAKE_SCENARIOS)
    res = run_processes(
        handshake_worker, 3, lambda r: (names, TIMEOUT, SILENT_TIMEOUT), timeout_s=150
    )
    assert sorted(res) == [0, 1, 2], res
    for r in res.values():
        assert "error" not in r, r["error"]
    return {name: {r: res[r]["scenarios"][name] for r in res} for name in names}


@pytest.mark.timeout(200)
def test_agreeing_ranks_pass(outcomes):
    assert [outcomes["agree"][r]["outcome"] for r in range(3)] == ["ok"] * 3


@pytest.mark.timeout(200)
def test_mismatched_versions_fail_every_rank_naming_rank_and_field(outcomes):
    got = outcomes["versions"]
    for r in range(3):
        assert got[r]["outcome"] == "error" and got[r]["type"] == "HandshakeError", got[r]
        msg = got[r]["message"]
        assert "PP rank 0 has protocol=2" in msg and "protocol=1" in msg, msg
        assert "PP rank 0 has vllm_version='0.35.0'" in msg, msg
        assert "PP rank 1 has" not in msg
        assert got[r]["elapsed"] < TIMEOUT, "a mismatch must not wait for the timeout"
    assert len({got[r]["message"] for r in range(3)}) == 1, "every rank fails with one message"


@pytest.mark.timeout(200)
def test_mismatched_k_fails_every_rank(outcomes):
    got = outcomes["k"]
    for r in range(3):
        assert got[r]["outcome"] == "error", got[r]
        msg = got[r]["message"]
        assert "PP rank 1 has num_speculative_tokens=5" in msg, msg
        assert "PP rank 2 (last) has num_speculative_tokens=3" in msg, msg
        assert got[r]["elapsed"] < TIMEOUT


@pytest.mark.timeout(200)
def test_ranks_disagreeing_on_adaptive_verification_fail_every_rank(outcomes):
    """One rank would ship admitted counts in the drafts payload ([N, k+1]) and the others not."""
    got = outcomes["adaptive"]
    for r in range(3):
        assert got[r]["outcome"] == "error", got[r]
        assert "PP rank 0 has adaptive_verification=True" in got[r]["message"], got[r]
        assert got[r]["elapsed"] < TIMEOUT


@pytest.mark.timeout(200)
def test_ranks_applying_counts_of_another_lag_fail_every_rank(outcomes):
    """One rank would verify with the latest shipped counts, the others with the ones before
    (VLLM_DSPARK_PP_ADAPTIVE_LAG): their verify batches would differ."""
    got = outcomes["lag"]
    for r in range(3):
        assert got[r]["outcome"] == "error", got[r]
        msg = got[r]["message"]
        assert "PP rank 1 has admitted_lag=0" in msg and "has admitted_lag=1" in msg, msg
        assert "VLLM_DSPARK_PP_ADAPTIVE_LAG" in msg, msg


def test_ranks_disagreeing_on_tap_partials_fail_every_rank(outcomes):
    """One rank would receive raw aux taps where the others send one partial sum."""
    got = outcomes["tap_partials"]
    for r in range(3):
        assert got[r]["outcome"] == "error", got[r]
        assert "PP rank 2 (last) has tap_partials='0'" in got[r]["message"], got[r]
        assert got[r]["elapsed"] < TIMEOUT


def test_ranks_disagreeing_on_the_tap_side_channel_fail_every_rank(outcomes):
    """VLLM_DSPARK_PP_TAP_PARTIALS=side on one rank, 1 on the others: the side channel's sends
    and receives would have no partner."""
    got = outcomes["tap_side"]
    for r in range(3):
        assert got[r]["outcome"] == "error", got[r]
        msg = got[r]["message"]
        assert "PP rank 0 has tap_partials='side'" in msg and "has tap_partials='1'" in msg, msg
        assert got[r]["elapsed"] < TIMEOUT


@pytest.mark.timeout(200)
def test_a_silent_rank_fails_the_others_fast(outcomes):
    got = outcomes["silent_rank"]
    assert got[1]["outcome"] == "silent"
    for r in (0, 2):
        assert got[r]["outcome"] == "error", got[r]
        msg = got[r]["message"]
        assert "PP rank 1 sent no handshake" in msg and "without vllm-dspark-pp" in msg, msg
        assert got[r]["elapsed"] < SILENT_TIMEOUT + SLACK, got[r]["elapsed"]


@pytest.mark.timeout(200)
def test_a_silent_last_rank_fails_the_others_fast(outcomes):
    got = outcomes["silent_last"]
    for r in (0, 1):
        assert got[r]["outcome"] == "error", got[r]
        assert "PP rank 2 (last) sent no verdict" in got[r]["message"], got[r]["message"]
        assert got[r]["elapsed"] < SILENT_TIMEOUT + 5 + SLACK, got[r]["elapsed"]
