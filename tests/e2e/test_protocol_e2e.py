"""PP=2 generation on the CPU platform through the patched PP exchange (fixed-width aligned
broadcasts, draft broadcast, handshake, fixed DSpark graph batch key) stays lossless: the greedy
tokens equal the non-speculative PP=1 run.

Needs the e2e harness (tests/e2e/harness.py, branch e2e) and the tiny models fixture. Async
scheduling only: PP=2 + speculative decoding with sync scheduling is the engine-core bug the e2e
branch fixes; the exchange itself does not depend on the scheduling mode.
"""

from __future__ import annotations

import pytest

harness = pytest.importorskip("e2e.harness", reason="the e2e harness (branch e2e) is not merged")

pytestmark = pytest.mark.e2e

PROMPTS = ["the quick brown fox", [5, 6, 7, 8, 9, 10, 11]]


@pytest.mark.timeout(400)
def test_pp2_dspark_with_patched_exchange_is_lossless(tiny_models):
    target, draft = tiny_models.target, tiny_models.draft
    base = harness.run_generate(
        {"model": str(target)}, PROMPTS, timeout_s=180, sampling={"max_tokens": 16}
    )
    pp2 = harness.run_generate(
        {
            "model": str(target),
            "pipeline_parallel_size": 2,
            "speculative_config": {
                "method": "dspark",
                "model": str(draft),
                "num_speculative_tokens": 3,
                "dspark_pp_fixed_graph_batch": 4,
            },
        },
        PROMPTS,
        timeout_s=200,
        sampling={"max_tokens": 16},
        async_scheduling=True,
    )
    assert pp2.tokens == base.tokens
    assert pp2.metrics["num_drafts"] > 0, "no drafts: the draft broadcast was never exercised"
