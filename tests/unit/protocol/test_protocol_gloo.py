"""The exchange code with real collectives: 2 and 3 gloo processes replay a few hundred steps
of seeded schedules through the real patched PPHandler; every received tensor must equal what
the last rank sent and every rank must have posted the same collective sequence."""

from __future__ import annotations

import pytest
from protocol_gloo_workers import exchange_worker, run_processes

from vllm_dspark_pp.protocol.schedule import compare_sequences

SEEDS = list(range(14))  # 14 cases x 24 steps = 336 steps per process


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_ranks_receive_exactly_what_the_last_rank_sent(world):
    results = run_processes(exchange_worker, world, lambda r: (SEEDS,), timeout_s=200)
    assert sorted(results) == list(range(world)), f"ranks missing: {results}"
    for r, res in results.items():
        assert res["ok"], f"rank {r} failed:\n{res.get('error')}"
        assert res["problems"] == [], f"rank {r}: {res['problems'][:5]}"
        assert res["steps"] == 24 * len(SEEDS)
    logs = {r: res["log"] for r, res in results.items()}
    compare_sequences(logs)
    assert len(logs[0]) > 100, "too few collectives to mean anything"
    print(f"world={world}: {results[0]['steps']} steps, {len(logs[0])} broadcasts per rank")
