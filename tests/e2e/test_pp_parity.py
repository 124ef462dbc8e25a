"""Lossless parity of DSpark on pipeline-parallel targets (CPU, float32, greedy).

Two model pairs:

* **Acceptance parity: the trained tiny pair** (``models/tiny-pair``, docs/tiny-pair.md; k=7, the
  drafter's trained block size) on 16 held-out GSM8K-style prompts of the seeded corpus (23-35
  tokens, answers of 23-56 tokens ending at EOS), chunked prefill with a 128-token budget (the
  16 prompts' ~450 prefill tokens take four steps, so prompts are split across steps). Reference:
  PP=1 without speculation. PP=1 DSpark must give its tokens and accept informatively (rejections
  at draft positions > 0); PP=2 and PP=3 with synchronous scheduling (the CPU default) and PP=2
  with asynchronous scheduling forced on (the GPU default) must give the same tokens and exactly
  PP=1 DSpark's spec-decode counters: drafts, draft tokens, accepted tokens and accepted tokens
  per draft position. PP=3 puts one of the drafter's aux taps on each stage (target layers 0 | 1-2
  | 3, aux ids 1, 3, 4). Measured on the 2-core CPU (2026-12-02): PP=1, PP=2 sync, PP=3 sync and
  PP=2 async all gave 69 drafts, 483 draft tokens, 445 accepted, per position
  [69, 69, 65, 64, 60, 59, 59] (mean acceptance length 7.45), with identical tokens.
  The async counters are required to be equal too: they were identical in every run (PP=2 async
  twice on 8 prompts and twice on these 16, always equal to the sync counters). They are
  deterministic because, without a token-budget cut (16 requests x 8 tokens = the 128 budget),
  each request's draft and verify sequence depends only on its own greedy tokens, and the
  counters are sums over requests.
* **The random-weight pair** (``tiny_models`` fixture: 6 layers, k=4) for what does not need real
  acceptance: 4 prompts of 3-90 tokens (token ids and one text prompt; with a 32-token budget the
  40- and 90-token prompts are split into chunks), 16 new tokens each: PP=1 DSpark, PP=2 with
  chunked prefill switched off, and PP=2 with a request aborted mid-stream, against PP=1 without
  speculation. (It accepts only at draft position 0, so its counters prove little about
  acceptance; the trained pair's cases replaced its PP=2/PP=3 sync and PP=2 async cases.)

On a mismatch the failure message shows the first differing position of each prompt and, from
the reference's top-2 logprobs, whether it is a numerical near-tie.

Stock vLLM 0.34.0 fails the synchronous PP cases (`assert (num_scheduled_tokens_np >=
num_logits).all()` on PP rank 0); see docs/sync-scheduling.md. Run them without the plugin with
``DSPARK_E2E_PLUGINS=none`` (sets ``VLLM_PLUGINS`` in the children).
"""

from __future__ import annotations

import pytest
from e2e import tiny_pair
from e2e.harness import run_generate

pytestmark = pytest.mark.e2e

MAX_TOKENS = 16
NEAR_TIE = 1e-3  # top-2 logprob gap below which a flipped greedy token counts as a near-tie

# Token-id prompts of different lengths (3 .. 90 tokens) and one text prompt (tokenizer path).
PROMPTS = [
    [11, 12, 13],
    "the quick brown fox jumps over the lazy dog while a small cat sleeps",
    [(7 * i + 3) % 500 + 4 for i in range(40)],
    [(13 * i + 5) % 500 + 4 for i in range(90)],
]
CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 32}
UNCHUNKED = {"enable_chunked_prefill": False, "max_num_batched_tokens": 512}

# The trained pair's cases: settings in e2e/tiny_pair.py.


_plugin_env = tiny_pair.plugin_env  # DSPARK_E2E_PLUGINS=none: stock vLLM


def _run(tiny, timeout, *, pp, spec, extra=None, **kw):
    cfg = {"model": tiny.target, "pipeline_parallel_size": pp}
    if spec:
        cfg["speculative_config"] = {"method": "dspark", "model": tiny.draft}
    cfg.update(extra or {})
    return run_generate(
        cfg, PROMPTS, timeout, sampling={"max_tokens": MAX_TOKENS}, env=_plugin_env(), **kw
    )


def _explain_mismatch(ref, got) -> str:
    lines = []
    for i, (a, b) in enumerate(zip(ref.tokens, got.tokens, strict=True)):
        if a == b:
            continue
        pos = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        note = ""
        if ref.logprobs and ref.logprobs[i] and pos < len(ref.logprobs[i]):
            top = sorted(ref.logprobs[i][pos].items(), key=lambda kv: -kv[1])[:2]
            if len(top) == 2:
                gap = top[0][1] - top[1][1]
                kind = "NEAR-TIE (numerical noise)" if gap < NEAR_TIE else "not a near-tie (a real bug)"
                note = f"; reference top-2 {top} gap {gap:.2e}: {kind}"
        lines.append(f"prompt {i}: first difference at output position {pos}: ref {a[pos:pos + 4]} got {b[pos:pos + 4]}{note}")
    return "\n".join(lines)


def _assert_same_tokens(ref, got, what, length=MAX_TOKENS):
    assert got.tokens == ref.tokens, f"{what}: greedy output differs from PP=1 no-spec:\n" + _explain_mismatch(ref, got)
    if length is None:  # stopped at EOS: the finish reasons must agree too
        assert got.finish_reasons == ref.finish_reasons, (what, got.finish_reasons, ref.finish_reasons)
    else:
        assert all(len(t) == length for t in got.tokens)


@pytest.fixture(scope="module")
def reference(tiny_models, e2e_timeout_s):
    """PP=1, no speculation; also records top-2 logprobs to diagnose any mismatch."""
    ref = run_generate(
        {"model": tiny_models.target, "pipeline_parallel_size": 1, **CHUNKED},
        PROMPTS,
        e2e_timeout_s,
        sampling={"max_tokens": MAX_TOKENS, "logprobs": 2},
        env=_plugin_env(),
    )
    assert [len(t) for t in ref.tokens] == [MAX_TOKENS] * len(PROMPTS)
    # The tiny target must not be degenerate, or parity would prove little.
    assert all(len(set(t)) >= 6 for t in ref.tokens), ref.tokens
    return ref


@pytest.fixture(scope="module")
def pp1_dspark(tiny_models, e2e_timeout_s):
    return _run(tiny_models, e2e_timeout_s, pp=1, spec=True, extra=CHUNKED)


def test_pp1_dspark_is_lossless_and_drafts(reference, pp1_dspark):
    _assert_same_tokens(reference, pp1_dspark, "PP=1 DSpark")
    drafts, draft_tokens, accepted = pp1_dspark.acceptance
    assert drafts > 0 and draft_tokens == 4 * drafts
    # Acceptance must be informative: neither nothing nor everything.
    assert 0 < accepted < draft_tokens, pp1_dspark.metrics


def test_pp2_dspark_sync_without_chunked_prefill(tiny_models, e2e_timeout_s, reference, pp1_dspark):
    res = _run(tiny_models, e2e_timeout_s, pp=2, spec=True, extra=UNCHUNKED)
    assert res.config["chunked_prefill"] is False
    _assert_same_tokens(reference, res, "PP=2 DSpark, chunked prefill off")
    assert res.metrics == pp1_dspark.metrics


def test_pp2_dspark_abort_mid_stream(tiny_models, e2e_timeout_s, reference):
    res = _run(tiny_models, e2e_timeout_s, pp=2, spec=True, extra=CHUNKED, abort={"index": 2, "after_tokens": 5})
    assert res.aborted
    for i, (ref_t, got_t) in enumerate(zip(reference.tokens, res.tokens, strict=True)):
        if i == 2:
            assert 5 <= len(got_t) < MAX_TOKENS and got_t == ref_t[: len(got_t)], (ref_t, got_t)
            assert res.finish_reasons[i] == "abort"
        else:
            assert got_t == ref_t, f"prompt {i} changed after another request was aborted"


# ------------------------------------------------------------------ the trained tiny pair


_run_pair = tiny_pair.run_pair


def _describe(m: dict) -> str:
    d, t, a = m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"]
    return f"{d} drafts, {a}/{t} accepted, per position {m['accepted_per_pos']}, mean acceptance length {1 + a / max(d, 1):.3f}"


def _assert_same_counters(ref, got, what):
    assert got.metrics == ref.metrics, (
        f"{what}: spec-decode counters differ from PP=1 DSpark:\n  PP=1: {_describe(ref.metrics)}\n"
        f"  got:  {_describe(got.metrics)}"
    )


# pair_reference and pair_pp1 (PP=1 no-spec / PP=1 DSpark) are session fixtures in e2e/conftest.py.


def test_pair_pp1_dspark_is_lossless_and_accepts(pair_reference, pair_pp1):
    _assert_same_tokens(pair_reference, pair_pp1, "trained pair, PP=1 DSpark", length=None)
    k = tiny_pair.num_speculative_tokens()
    assert pair_pp1.config["num_speculative_tokens"] == k
    m = pair_pp1.metrics
    print(f"trained pair PP=1 DSpark: {_describe(m)}")
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] == k * m["num_drafts"], m
    per_pos = m["accepted_per_pos"]
    assert len(per_pos) == k and sum(per_pos) == m["num_accepted_tokens"], m
    # A trained drafter: mean acceptance length at least issue 7's bar of 3.0 ...
    assert 1 + m["num_accepted_tokens"] / m["num_drafts"] >= 3.0, _describe(m)
    # ... and informative counters: some drafts are rejected, at more than one position > 0
    # (accepted counts per position drop there), so a shifted or lost draft would show.
    drops = [i for i in range(1, k) if per_pos[i] < per_pos[i - 1]]
    assert len(drops) >= 2, f"acceptance is not informative enough for a parity check: {_describe(m)}"


@pytest.mark.parametrize("pp", [2, 3])
def test_pp_dspark_sync_scheduling_is_lossless(e2e_timeout_s, pair_reference, pair_pp1, pp):
    """Trained pair: PP=2/3, synchronous scheduling: same tokens, same counters as PP=1."""
    assert pp <= tiny_pair.num_target_layers()
    res = _run_pair(e2e_timeout_s, pp=pp, spec=True)
    assert res.config["async_scheduling"] is False and res.config["pipeline_parallel_size"] == pp
    _assert_same_tokens(pair_reference, res, f"trained pair, PP={pp} DSpark (sync scheduling)", length=None)
    print(f"trained pair PP={pp} sync DSpark: {_describe(res.metrics)}")
    _assert_same_counters(pair_pp1, res, f"PP={pp} sync")


def test_pp2_dspark_async_scheduling_is_lossless(e2e_timeout_s, pair_reference, pair_pp1):
    """Trained pair: PP=2, async scheduling: same tokens, same counters (see the module docstring)."""
    res = _run_pair(e2e_timeout_s, pp=2, spec=True, async_scheduling=True)
    assert res.config["async_scheduling"] is True and res.config["pipeline_parallel_size"] == 2
    _assert_same_tokens(pair_reference, res, "trained pair, PP=2 DSpark (async scheduling)", length=None)
    print(f"trained pair PP=2 async DSpark: {_describe(res.metrics)}")
    _assert_same_counters(pair_pp1, res, "PP=2 async")
