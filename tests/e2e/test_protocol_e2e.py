"""PP=2 generation on the CPU platform through the patched PP exchange (fixed-width aligned
broadcasts, draft broadcast, handshake, fixed DSpark graph batch) stays lossless under async
scheduling, with a request aborted mid-stream; and the same abort under synchronous scheduling
(no fixed graph batch), the case the old ``test_pp2_dspark_abort_mid_stream`` covered (opt-in,
``DSPARK_E2E_FULL=1``; the skip reason names what covers it in CI).

Random-weight pair (k=3, ``dspark_pp_fixed_graph_batch`` 4; 6 requests, one aborted), against the
shared PP=1 no-spec reference
(tests/support/engines.py): every other request's tokens equal the reference, the aborted one is
a prefix of its reference, drafts were broadcast and some were accepted. Synchronous scheduling
with PP=2 and PP=3 is tests/e2e/test_pp_parity.py.
"""

from __future__ import annotations

import pytest
from support.engines import RANDOM_MAX_TOKENS, run_random, shared_case

pytestmark = pytest.mark.e2e

ABORTED = 2


def _run(tiny_models, timeout_s: float, mode: str):
    spec = {
        "method": "dspark",
        "model": str(tiny_models.draft),
        "num_speculative_tokens": 3,
    }
    if mode == "async":
        spec["dspark_pp_fixed_graph_batch"] = 4
    return run_random(
        tiny_models,
        timeout_s,
        pp=2,
        spec=False,
        extra={
            "speculative_config": spec,
            "enable_chunked_prefill": True,
            "max_num_batched_tokens": 32,
        },
        async_scheduling=mode == "async",
        abort={"index": ABORTED, "after_tokens": 5},
    )


# The default case starts with the session's other shared runs (tests/support/engines.py).
@shared_case(
    "random_pp2_abort_async",
    cost_s=30,
    asked_by="test_protocol_e2e.py::test_pp2_dspark_with_an_abort_is_lossless[async-fixed-batch]",
)
def _abort_async(request):
    tiny, t = request.getfixturevalue("tiny_models"), request.getfixturevalue("e2e_timeout_s")
    return lambda: _run(tiny, t, "async")


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("async", id="async-fixed-batch"),
        pytest.param(
            "sync",
            id="sync",
            marks=pytest.mark.e2e_full(
                covered_by="[async-fixed-batch] (the same abort, PP=2, chunked) and PP=2 "
                "synchronous scheduling: tests/e2e/test_pp_parity.py::"
                "test_pp_dspark_sync_scheduling_is_lossless[2] (trained pair, chunked prefill) "
                "and test_pp2_dspark_sync_without_chunked_prefill_is_lossless"
            ),
        ),
    ],
)
def test_pp2_dspark_with_an_abort_is_lossless(
    request, shared_runs, tiny_models, e2e_timeout_s, random_reference, mode
):
    if mode == "async":
        res = shared_runs.get("random_pp2_abort_async", request)
    else:
        res = _run(tiny_models, e2e_timeout_s, mode)
    assert res.config["async_scheduling"] is (mode == "async")
    assert res.config["pipeline_parallel_size"] == 2
    assert res.config["num_speculative_tokens"] == 3
    assert res.aborted
    for i, (ref_t, got_t) in enumerate(zip(random_reference.tokens, res.tokens, strict=True)):
        if i == ABORTED:
            assert 5 <= len(got_t) < RANDOM_MAX_TOKENS and got_t == ref_t[: len(got_t)], (
                ref_t,
                got_t,
            )
            assert res.finish_reasons[i] == "abort"
        else:
            assert got_t == ref_t, f"prompt {i} differs from PP=1 no-spec (another was aborted)"
    m = res.metrics
    assert m["num_drafts"] > 0, f"no drafts: the draft broadcast was never exercised: {m}"
    assert m["num_draft_tokens"] == 3 * m["num_drafts"], m
    assert m["num_accepted_tokens"] > 0, f"no draft accepted: the broadcast drafts are wrong? {m}"
