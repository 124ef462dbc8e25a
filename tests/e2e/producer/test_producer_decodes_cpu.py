"""CPU end to end: a DSpark prefill-only producer that is asked to decode.

A PD proxy sends the producer one output token per request, but nothing stops a client from
asking it for more. Such a request must decode like a plain (non-speculative) engine: the
producer's drafter is context-KV-only, so no draft may be scheduled, verified or fed to the
target as an input id.

Before the fix (``patches/v1_core_sched_scheduler.py``, case 1) vLLM 0.34.0's async scheduler
gave every decoding request ``num_speculative_tokens`` placeholder drafts
(``vllm/v1/core/sched/async_scheduler.py:22-41``); the model runner filled them from its draft
buffer, which holds ``-1`` after a zero-draft propose (``model_runner.py:2388-2390``), and the
target embedded token id ``-1``: harmless on the CPU's wrapped indexing, a device-side assert
on CUDA (docs/results/gpu.md). Here the producer must report zero drafts and produce exactly
the plain greedy tokens, under async scheduling (and sync, opt-in: ``DSPARK_E2E_FULL=1``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.e2e import run_generate
from support.engines import RANDOM_MAX_TOKENS, RANDOM_PROMPTS, shared_case

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent

MAX_TOKENS = RANDOM_MAX_TOKENS  # the shared plain run's (tests/support/engines.py)


# The bug was in vLLM's AsyncScheduler only (its placeholder drafts); the sync variant is opt-in.
SYNC_COVERED_BY = (
    "test_producer_decodes_without_drafts[async]: the bug was in vLLM 0.34.0's AsyncScheduler "
    "(placeholder drafts for every decoding request, async_scheduler.py:22-41); the sync "
    "Scheduler schedules only drafts a drafter proposed, and a producer proposes none; the "
    "patch's scheduler case, unit: tests/unit/producer/test_runner_patches.py::"
    "test_scheduler_of_a_producer_schedules_no_drafts"
)


def _run_producer(tiny, timeout_s: float, store: Path, async_scheduling: bool):
    kv = {
        "kv_connector": "DSparkDraftKVFileConnector",
        "kv_connector_module_path": "dspark_pp_draft_kv_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    return run_generate(
        {
            "model": tiny.target,
            "speculative_config": {"method": "dspark", "model": tiny.draft},
            "kv_transfer_config": kv,
        },
        RANDOM_PROMPTS,
        timeout_s=timeout_s,
        sampling={"max_tokens": MAX_TOKENS, "ignore_eos": True},
        async_scheduling=async_scheduling,
        env={"PYTHONPATH": str(HERE)},
    )


# The default case starts with the session's other shared runs (tests/support/engines.py).
@shared_case(
    "producer_decodes_async",
    cost_s=26,
    asked_by="test_producer_decodes_cpu.py::test_producer_decodes_without_drafts[async]",
)
def _producer_async(request):
    tiny, t = request.getfixturevalue("tiny_models"), request.getfixturevalue("e2e_timeout_s")
    store = request.getfixturevalue("tmp_path_factory").mktemp("producer-decodes-store")
    return lambda: _run_producer(tiny, t, store, True)


@pytest.mark.parametrize(
    "async_scheduling",
    [
        pytest.param(True, id="async"),
        pytest.param(False, id="sync", marks=pytest.mark.e2e_full(covered_by=SYNC_COVERED_BY)),
    ],
)
def test_producer_decodes_without_drafts(
    request, shared_runs, tiny_models, random_reference, tmp_path, e2e_timeout_s, async_scheduling
):
    """Against the shared PP=1 no-spec run of the random pair (same prompts, same length)."""
    plain = random_reference
    if async_scheduling:
        prod = shared_runs.get("producer_decodes_async", request)
    else:
        store = tmp_path / "store"
        store.mkdir()
        prod = _run_producer(tiny_models, e2e_timeout_s, store, False)
    assert prod.config["async_scheduling"] is async_scheduling
    assert all(len(t) == MAX_TOKENS for t in prod.tokens)
    assert prod.tokens == plain.tokens
    # No draft was scheduled or verified on the producer.
    assert prod.metrics["num_drafts"] == 0, prod.metrics
    assert prod.metrics["num_draft_tokens"] == 0, prod.metrics
