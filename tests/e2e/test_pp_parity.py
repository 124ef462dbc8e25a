"""Lossless parity of DSpark on pipeline-parallel targets (CPU, float32, greedy).

Reference: PP=1 without speculation. Every DSpark run (PP in {1, 2, 3}, synchronous scheduling =
the CPU default, and PP=2 with asynchronous scheduling forced on = the GPU default) must produce
the same tokens for every prompt, and the PP runs the same speculative-decoding counters (drafts,
draft tokens, accepted tokens, accepted per position) as PP=1 for the same inputs. Chunked
prefill is exercised with a 32-token budget (the long prompt is split into chunks) and switched
off in a separate case; one case aborts a request mid-stream.

On a mismatch the failure message shows the first differing position of each prompt and, from
the reference's top-2 logprobs, whether it is a numerical near-tie.

Stock vLLM 0.34.0 fails the synchronous PP cases (`assert (num_scheduled_tokens_np >=
num_logits).all()` on PP rank 0); see docs/sync-scheduling.md. Run them without the plugin with
``DSPARK_E2E_PLUGINS=none`` (sets ``VLLM_PLUGINS`` in the children).
"""

from __future__ import annotations

import os

import pytest
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


def _plugin_env() -> dict:
    # Off switch used to show the failure on stock vLLM (any non-matching name disables ours).
    if os.environ.get("DSPARK_E2E_PLUGINS") == "none":
        return {"VLLM_PLUGINS": "no-such-plugin"}
    return {}


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


def _assert_same_tokens(ref, got, what):
    assert got.tokens == ref.tokens, f"{what}: greedy output differs from PP=1 no-spec:\n" + _explain_mismatch(ref, got)
    assert all(len(t) == MAX_TOKENS for t in got.tokens)


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


@pytest.mark.parametrize("pp", [2, 3])
def test_pp_dspark_sync_scheduling_is_lossless(tiny_models, e2e_timeout_s, reference, pp1_dspark, pp):
    res = _run(tiny_models, e2e_timeout_s, pp=pp, spec=True, extra=CHUNKED)
    assert res.config["async_scheduling"] is False and res.config["pipeline_parallel_size"] == pp
    _assert_same_tokens(reference, res, f"PP={pp} DSpark (sync scheduling)")
    assert res.metrics == pp1_dspark.metrics, f"PP={pp} spec-decode counters differ from PP=1"


def test_pp2_dspark_sync_without_chunked_prefill(tiny_models, e2e_timeout_s, reference, pp1_dspark):
    res = _run(tiny_models, e2e_timeout_s, pp=2, spec=True, extra=UNCHUNKED)
    assert res.config["chunked_prefill"] is False
    _assert_same_tokens(reference, res, "PP=2 DSpark, chunked prefill off")
    assert res.metrics == pp1_dspark.metrics


def test_pp2_dspark_async_scheduling_is_lossless(tiny_models, e2e_timeout_s, reference, pp1_dspark):
    res = _run(tiny_models, e2e_timeout_s, pp=2, spec=True, extra=CHUNKED, async_scheduling=True)
    assert res.config["async_scheduling"] is True
    _assert_same_tokens(reference, res, "PP=2 DSpark (async scheduling)")
    assert res.metrics["num_drafts"] > 0 and res.metrics["num_accepted_tokens"] > 0


def test_pp2_dspark_abort_mid_stream(tiny_models, e2e_timeout_s, reference):
    res = _run(tiny_models, e2e_timeout_s, pp=2, spec=True, extra=CHUNKED, abort={"index": 2, "after_tokens": 5})
    assert res.aborted
    for i, (ref_t, got_t) in enumerate(zip(reference.tokens, res.tokens, strict=True)):
        if i == 2:
            assert 5 <= len(got_t) < MAX_TOKENS and got_t == ref_t[: len(got_t)], (ref_t, got_t)
            assert res.finish_reasons[i] == "abort"
        else:
            assert got_t == ref_t, f"prompt {i} changed after another request was aborted"
