"""The statistics behind the sampling-exactness test (tests/support/reliability.py), on synthetic
distributions: the p-value function against known chi-square quantiles, the PIT test accepting
draws from the right distribution and rejecting tempered ones (its control), the exact power
computation agreeing with what the draws show."""

from __future__ import annotations

import torch
from support.reliability import (
    chi_square_gof,
    chi_square_sf,
    critical_value,
    noncentrality,
    pit_bin_probs_under,
    randomized_pit,
    tempered,
    uniformity_chi_square,
)


def test_chi_square_sf_matches_known_quantiles():
    # 95 % and 99.9 % quantiles of chi-square(4) and chi-square(19) from tables.
    assert abs(chi_square_sf(9.488, 4) - 0.05) < 1e-4
    assert abs(chi_square_sf(18.467, 4) - 0.001) < 1e-5
    assert abs(chi_square_sf(30.144, 19) - 0.05) < 1e-4
    assert abs(critical_value(4, 1e-3) - 18.467) < 1e-2


def _dists(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 2, -1)


def test_pit_accepts_the_right_sampler_and_rejects_a_tempered_one():
    p = _dists(3000, 40, 0)
    g = torch.Generator().manual_seed(1)
    right = torch.multinomial(p, 1, generator=g).squeeze(-1)
    q = torch.stack([tempered(r, 0.7) for r in p])
    wrong = torch.multinomial(q, 1, generator=g).squeeze(-1)
    assert uniformity_chi_square(randomized_pit(p, right, 2), 5)["p_value"] > 1e-3
    assert uniformity_chi_square(randomized_pit(p, wrong, 2), 5)["p_value"] < 1e-6
    # The exact bin probabilities: uniform under the null, shifted to low u when tempered.
    assert torch.allclose(pit_bin_probs_under(p, p, 5), torch.full((5,), 0.2, dtype=torch.float64))
    shifted = pit_bin_probs_under(p, q, 5)
    assert shifted[0] > 0.2 > shifted[-1]


def test_pearson_counts_pool_rare_tokens_and_see_a_missing_one():
    p = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01], dtype=torch.float64)
    ok = [0] * 50 + [1] * 30 + [2] * 15 + [3] * 4 + [4]
    res = chi_square_gof(ok, p)
    assert res["bins"][-1] == [3, 4] and res["p_value"] > 0.5  # 5 expected in the pooled bin
    never_second = [0] * 80 + [2] * 15 + [3] * 5
    assert chi_square_gof(never_second, p)["p_value"] < 1e-6
    q = tempered(p, 0.5)
    assert noncentrality(p, q, res["bins"], 100) > noncentrality(p, q, res["bins"], 10)
