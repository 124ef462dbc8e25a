"""The exchange code with real collectives: 2 and 3 gloo processes replay a few hundred steps
of seeded schedules through the real patched PPHandler; every received tensor must equal what
the last rank sent and every rank must have posted the same collective sequence. The adaptive
cases (admitted draft counts in the drafts payload) also check, before every step, that each
rank holds the counts the last rank sent, and that every rank builds the same token count for
each verify step; a rank that keeps corrupted counts must stop every rank at once."""

from __future__ import annotations

import re
import time

import pytest
from protocol_gloo_workers import exchange_worker, run_processes
from protocol_sim import random_case

from vllm_dspark_pp.protocol.schedule import compare_sequences

PLAIN_SEEDS = list(range(14))  # 14 cases x 24 steps
ADAPTIVE_SEEDS = [s for s in range(15, 30) if random_case(s).adaptive][:8]
SEEDS = PLAIN_SEEDS + ADAPTIVE_SEEDS


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_ranks_receive_exactly_what_the_last_rank_sent(world, monkeypatch):
    """... and, with ``VLLM_DSPARK_PP_DRAFT_DIGEST`` on, every rank ends each case with the same
    draft-post count and digest (protocol/draft_digest.py; the comparison's control:
    tests/unit/protocol/test_draft_digest.py)."""
    assert len(ADAPTIVE_SEEDS) == 8
    assert {random_case(s).admitted_lag for s in ADAPTIVE_SEEDS} == {0, 1, 2}
    monkeypatch.setenv("VLLM_DSPARK_PP_DRAFT_DIGEST", "1")  # inherited by the spawned ranks
    results = run_processes(exchange_worker, world, lambda r: (SEEDS, None), timeout_s=260)
    assert sorted(results) == list(range(world)), f"ranks missing: {results}"
    for r, res in results.items():
        assert res["ok"], f"rank {r} failed:\n{res.get('error')}"
        assert res["problems"] == [], f"rank {r}: {res['problems'][:5]}"
        assert res["steps"] == 24 * len(SEEDS)
        assert res["verify_steps"] > 50, "too few adaptive verify steps to mean anything"
    digests = {r: res.get("digests", []) for r, res in results.items()}
    assert len(digests[0]) >= 8, digests  # the cases with drafts (k > 0)
    assert all(d == digests[0] for d in digests.values()), digests
    logs = {r: res["log"] for r, res in results.items()}
    compare_sequences(logs)
    assert len(logs[0]) > 100, "too few collectives to mean anything"
    print(
        f"world={world}: {results[0]['steps']} steps, {len(logs[0])} broadcasts per rank, "
        f"{results[0]['verify_steps']} adaptive verify steps"
    )


@pytest.mark.timeout(120)
def test_gloo_a_rank_with_corrupted_admitted_counts_stops_every_rank_at_once():
    """Control: PP rank 1 of 3 keeps every admitted count + 1. Its verify-step token count differs
    from rank 0's: rank 1 raises the batch-shape error in the first step that reads a corrupted
    count, and the other ranks stop in that same step (no rank waits in a collective)."""
    t0 = time.monotonic()
    results = run_processes(exchange_worker, 3, lambda r: (ADAPTIVE_SEEDS, 1), timeout_s=100)
    elapsed = time.monotonic() - t0
    assert sorted(results) == [0, 1, 2], f"ranks missing (a rank hung?): {results}"
    errors = {r: res.get("error") or "" for r, res in results.items()}
    assert all(not res["ok"] for res in results.values()), errors
    assert "stages disagree on the (adaptive verification) batch shape" in errors[1], errors[1]
    assert "another rank found a batch-shape mismatch" in errors[0], errors[0]
    steps = {r: re.findall(r"step (\d+)", errors[r])[-1] for r in range(3)}
    assert len(set(steps.values())) == 1, steps  # every rank stopped in the same step
    print(f"{elapsed:.0f} s (with process start-up): {errors[1].strip().splitlines()[-1]}")
