"""Fixtures of the CPU end-to-end tier (see docs/testing.md).

``e2e_timeout_s``: the hard per-case wall-clock limit (``DSPARK_E2E_TIMEOUT_S``, default 300 s;
a case takes well under a minute on an idle 2-core machine; measured 90-160 s on a host loaded 10x, hence the margin).
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def e2e_timeout_s() -> float:
    return float(os.environ.get("DSPARK_E2E_TIMEOUT_S", "300"))


@pytest.fixture(scope="session")
def pair_reference(e2e_timeout_s):
    """Trained pair, PP=1, no speculation, 16 held-out prompts (top-2 logprobs to diagnose a
    mismatch): the reference of test_pp_parity.py, test_quickstart.py and test_multi_node.py."""
    from e2e import tiny_pair

    ok, why = tiny_pair.available()
    if not ok:
        pytest.fail(why)
    ref = tiny_pair.run_pair(
        e2e_timeout_s, pp=1, spec=False, sampling=dict(tiny_pair.PAIR_SAMPLING, logprobs=2)
    )
    # Every answer ran to its EOS inside the limit (the corpus' answers end with '#### n' + EOS).
    n = tiny_pair.PAIR_NUM_PROMPTS
    assert ref.finish_reasons == ["stop"] * n, ref.finish_reasons
    assert all(10 <= len(t) < tiny_pair.PAIR_MAX_TOKENS for t in ref.tokens), [len(t) for t in ref.tokens]
    return ref


@pytest.fixture(scope="session")
def pair_pp1(e2e_timeout_s):
    """Trained pair, PP=1 DSpark, the same 16 prompts: the acceptance counters to match."""
    from e2e import tiny_pair

    return tiny_pair.run_pair(e2e_timeout_s, pp=1, spec=True)
