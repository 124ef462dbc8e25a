"""The GPU adaptive test's pinned cost tables (tests/support/adaptive_probe/probe_tables.py) fed
to vLLM 0.34.0's own draft budget (``AdaptiveVerificationManager.get_num_tokens``) for one
request with seven drafts: with the slope alone a confident draft keeps all seven (why the
H100 run of 2026-12-07 saw "the budget never bound"), with the cap the budget keeps ``cap - 1``
whatever the confidences."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from support.adaptive_probe.probe_tables import pinned_tables

K = 7


def _budget(tables, confidence: float, num_reqs: int = 1) -> int:
    from vllm.v1.worker.gpu.spec_decode.adaptive_verification import (
        AdaptiveVerificationManager,
    )

    ids = [f"r{i}" for i in range(num_reqs)]
    stale = np.full((num_reqs, K), confidence, dtype=np.float32)
    fake = SimpleNamespace(
        cost_tables=tables,
        req_states=SimpleNamespace(
            req_id_to_index={r: i for i, r in enumerate(ids)},
            num_computed_tokens_np=np.full(num_reqs, 100, dtype=np.int32),
            prefill_len=SimpleNamespace(np=np.full(num_reqs, 10, dtype=np.int32)),
        ),
        _stale_confidences=[SimpleNamespace(np=stale)],
        _stale_idx=0,
        num_speculative_steps=K,
        _max_total_logits=1024,
        num_bonus_tokens=1,
    )
    AdaptiveVerificationManager.get_num_tokens(
        fake, {r: 1 + K for r in ids}, {r: list(range(K)) for r in ids}
    )
    return int(fake._batch_budget[2])  # the draft budget vLLM stashed for the step


@pytest.mark.parametrize("confidence", [0.9999, 0.999])
def test_with_the_slope_alone_a_confident_draft_keeps_every_draft(confidence):
    # the old premise: the trained pair's median confidence is 0.9999, nothing is trimmed
    assert _budget(pinned_tables(20.0, None, 8, 512), confidence) == K


@pytest.mark.parametrize("confidence", [0.9999, 0.999, 0.99])
def test_the_cap_binds_every_lone_verify_step(confidence):
    assert _budget(pinned_tables(20.0, 4, 8, 512), confidence) == 3  # the bonus row, 3 drafts


def test_the_cap_leaves_low_confidence_trimming_to_vllms_ranking():
    # a draft the budget would cut anyway stays cut below the cap
    assert _budget(pinned_tables(20.0, 4, 8, 512), 0.2) < 3
    assert _budget(pinned_tables(20.0, None, 8, 512), 0.2) < K


def test_the_tables_are_vllms_shape():
    draft, verify = pinned_tables(3.0, 6, 8, 64)
    assert draft.shape == (9,) and verify.shape == (65,)
    assert verify[6] == 1.0 + 3.0 * 6 and verify[7] == 1000.0 * (1.0 + 3.0 * 7)
