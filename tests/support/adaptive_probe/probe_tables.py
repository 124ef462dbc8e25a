"""The adaptive probe's pinned cost tables (tests/support/adaptive_probe/sitecustomize.py; a
module of its own so that a CPU unit test can feed them to vLLM's own budget code).

``pinned_tables(slope, cap, max_num_reqs, max_batch_tokens)`` returns vLLM's
``(draft_cost, verify_cost)`` pair: the draft step costs 1 whatever the batch, the verify step
``1 + slope * tokens``, and with a ``cap`` every verify step of more than ``cap`` tokens costs a
thousand times that. The slope alone leaves the budget free where the draft is confident (the
trained tiny pair: median confidence 0.9999; on an H100, 2026-12-07, PP=1 trimmed 4 of 245
drafts and PP=2 none, so the test's "the budget bound" check failed without a fault of the code
under test); the cap makes it bind at every verify step of a lone request (``cap - 1`` drafts
at most), so stage 0 must apply trimmed counts every time."""

from __future__ import annotations

CAP_FACTOR = 1000.0


def pinned_tables(slope: float, cap: int | None, max_num_reqs: int, max_batch_tokens: int):
    import numpy as np

    tokens = np.arange(max_batch_tokens + 1, dtype=np.float64)
    verify = 1.0 + float(slope) * tokens
    if cap is not None:
        verify = np.where(tokens > int(cap), verify * CAP_FACTOR, verify)
    return np.ones(max_num_reqs + 1), verify
