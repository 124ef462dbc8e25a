"""Lossless parity of DSpark on pipeline-parallel targets (CPU, float32, greedy).

Two model pairs:

* **Acceptance parity: the trained tiny pair** (``models/tiny-pair``, docs/tiny-pair.md; k=7, the
  drafter's trained block size) on the 32 held-out GSM8K-style prompts of the seeded corpus that
  the GSM8K gate scores (23-35 tokens, answers ending at EOS), chunked prefill with a 128-token
  budget (the ~900 prefill tokens take several steps, so prompts are split across steps). The
  engine runs are session fixtures (tests/support/engines.py) shared with tests/evals/gsm8k.
  Reference:
  PP=1 without speculation. PP=1 DSpark must give its tokens and accept informatively (rejections
  at draft positions > 0); PP=2 and PP=3 with synchronous scheduling (the CPU default) and PP=2
  with asynchronous scheduling forced on (the GPU default) must give the same tokens and exactly
  PP=1 DSpark's spec-decode counters: drafts, draft tokens, accepted tokens and accepted tokens
  per draft position. PP=3 puts one of the drafter's aux taps on each stage (target layers 0 | 1-2
  | 3, aux ids 1, 3, 4). Measured on the 2-core CPU (2026-12-02, then 16 prompts): PP=1, PP=2
  sync, PP=3 sync and PP=2 async all gave 69 drafts, 483 draft tokens, 445 accepted, per position
  [69, 69, 65, 64, 60, 59, 59] (mean acceptance length 7.45), with identical tokens (hand-run
  figures; the tests assert equality between the runs, not these numbers).
  The async counters are required to be equal too: they were identical in every run (PP=2 async
  twice on 8 prompts and twice on these 16, always equal to the sync counters). They are
  deterministic because, without a token-budget cut (16 requests x 8 tokens = the 128 budget),
  each request's draft and verify sequence depends only on its own greedy tokens, and the
  counters are sums over requests.
* **The random-weight pair** (``tiny_models`` fixture: 6 layers, k=4) for what does not need real
  acceptance: 6 prompts of 3-90 tokens (token ids and text prompts; with a 32-token budget the
  40- and 90-token prompts are split into chunks), 16 new tokens each: PP=1 DSpark and PP=2 with
  chunked prefill switched off against PP=1 without speculation. The PP=2 sync tokens check is
  the developer loop's (``-m "not slow"``) one real PP=2 DSpark generation. PP=2 with async
  scheduling, the fixed graph batch and a request aborted mid-stream is
  tests/e2e/test_protocol_e2e.py. (It accepts only at draft position 0, so its counters prove
  little about acceptance; the trained pair's cases replaced its PP=2/PP=3 sync and PP=2 async
  cases.)

On a mismatch the failure message shows the first differing position of each prompt and, from
the reference's top-2 logprobs, whether it is a numerical near-tie.

Stock vLLM 0.34.0 fails the synchronous PP cases (`assert (num_scheduled_tokens_np >=
num_logits).all()` on PP rank 0); see docs/sync-scheduling.md. Run them without the plugin with
``DSPARK_E2E_PLUGINS=none`` (sets ``VLLM_PLUGINS`` in the children).
"""

from __future__ import annotations

import pytest
from support import tiny_pair
from support.engines import PAIR_MAX_TOKENS, PAIR_NUM_PROMPTS, RANDOM_MAX_TOKENS
from support.parity_cpu import assert_same_counters, assert_same_tokens, describe

pytestmark = pytest.mark.e2e


@pytest.mark.quick
def test_pp2_dspark_sync_without_chunked_prefill_is_lossless(
    random_reference, random_pp2_unchunked
):
    """The developer loop's PP=2 check: a real PP=2 DSpark generation under synchronous
    scheduling gives exactly the PP=1 no-spec tokens."""
    res = random_pp2_unchunked
    assert res.config["chunked_prefill"] is False and res.config["async_scheduling"] is False
    assert res.config["pipeline_parallel_size"] == 2
    assert_same_tokens(random_reference, res, "PP=2 DSpark, chunked prefill off", RANDOM_MAX_TOKENS)
    assert res.metrics["num_drafts"] > 0, res.metrics


def test_pp1_dspark_is_lossless_and_drafts(random_reference, random_pp1):
    assert_same_tokens(random_reference, random_pp1, "PP=1 DSpark", RANDOM_MAX_TOKENS)
    drafts, draft_tokens, accepted = random_pp1.acceptance
    assert drafts > 0 and draft_tokens == 4 * drafts
    # Acceptance must be informative: neither nothing nor everything.
    assert 0 < accepted < draft_tokens, random_pp1.metrics


def test_pp2_dspark_without_chunked_prefill_counts_like_pp1(random_pp1, random_pp2_unchunked):
    assert random_pp2_unchunked.metrics == random_pp1.metrics


# ------------------------------------------------------------------ the trained tiny pair


def test_pair_pp1_dspark_is_lossless_and_accepts(pair_reference, pair_pp1):
    assert len(pair_reference.tokens) == PAIR_NUM_PROMPTS
    assert_same_tokens(pair_reference, pair_pp1, "trained pair, PP=1 DSpark", None)
    k = tiny_pair.num_speculative_tokens()
    assert pair_pp1.config["num_speculative_tokens"] == k
    m = pair_pp1.metrics
    print(f"trained pair PP=1 DSpark: {describe(m)}")
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] == k * m["num_drafts"], m
    per_pos = m["accepted_per_pos"]
    assert len(per_pos) == k and sum(per_pos) == m["num_accepted_tokens"], m
    # A trained drafter: mean acceptance length at least issue 7's bar of 3.0 ...
    assert 1 + m["num_accepted_tokens"] / m["num_drafts"] >= 3.0, describe(m)
    # ... and informative counters: some drafts are rejected, at more than one position > 0
    # (accepted counts per position drop there), so a shifted or lost draft would show.
    drops = [i for i in range(1, k) if per_pos[i] < per_pos[i - 1]]
    assert len(drops) >= 2, (
        f"acceptance is not informative enough for a parity check: {describe(m)}"
    )
    assert all(len(t) < PAIR_MAX_TOKENS for t in pair_pp1.tokens)


@pytest.mark.parametrize("pp", [2, 3])
def test_pp_dspark_sync_scheduling_is_lossless(request, pair_reference, pair_pp1, pp):
    """Trained pair: PP=2/3, synchronous scheduling: same tokens, same counters as PP=1."""
    assert pp <= tiny_pair.num_target_layers()
    res = request.getfixturevalue(f"pair_pp{pp}_sync")
    assert res.config["async_scheduling"] is False and res.config["pipeline_parallel_size"] == pp
    assert_same_tokens(pair_reference, res, f"trained pair, PP={pp} DSpark (sync scheduling)", None)
    print(f"trained pair PP={pp} sync DSpark: {describe(res.metrics)}")
    assert_same_counters(pair_pp1, res, f"PP={pp} sync")


def test_pp2_dspark_async_scheduling_is_lossless(pair_reference, pair_pp1, pair_pp2_async):
    """Trained pair: PP=2, async scheduling: same tokens, same counters (see the module
    docstring)."""
    res = pair_pp2_async
    assert res.config["async_scheduling"] is True and res.config["pipeline_parallel_size"] == 2
    assert_same_tokens(pair_reference, res, "trained pair, PP=2 DSpark (async scheduling)", None)
    print(f"trained pair PP=2 async DSpark: {describe(res.metrics)}")
    assert_same_counters(pair_pp1, res, "PP=2 async")
