"""The statistics behind the sampling-exactness test (tests/support/reliability.py), on synthetic
distributions: the p-value function against known chi-square quantiles, the PIT test accepting
draws from the right distribution and rejecting tempered ones (its control), the exact power
computation agreeing with what the draws show; which sampled tokens follow an accepted draft token
(from the step lengths, and on a simulated verification step: they are the target's draws, each
block's last token is not); the engine worker's per-request sampling of a wave."""

from __future__ import annotations

import pytest
import torch
from support.reliability import (
    chi_square_sf,
    critical_value,
    pit_bin_probs_under,
    randomized_pit,
    tempered,
    tokens_after_accepted_drafts,
    uniformity_chi_square,
)

from dspark_dev.engine_worker import wave_params


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


def test_the_tokens_after_accepted_drafts_are_found_from_the_step_lengths():
    # prefill 1 token; a step with no accepted draft (+1); 3 accepted (+4); 1 accepted (+2);
    # a step cut by max_tokens after 2 accepted (+3 emitted). Not only each block's last token
    # (5, 7, 10): that one is selected on its own outcome (tests/support/reliability.py).
    assert tokens_after_accepted_drafts([1, 2, 6, 8, 11]) == [3, 4, 5, 7, 9, 10]
    assert tokens_after_accepted_drafts([1, 2, 3, 4]) == []  # nothing ever accepted
    assert tokens_after_accepted_drafts([3]) == []  # the first output is the prefill's


def test_a_wave_gives_each_request_its_own_sampling_parameters():
    base = {"temperature": 0.0, "max_tokens": 8}
    assert wave_params(base, None, 2) == [base, base]
    assert wave_params(base, {"temperature": 1.0}, 2) == [{"temperature": 1.0, "max_tokens": 8}] * 2
    per = wave_params(base, [{"seed": 1, "temperature": 1.0}, {"seed": 2}], 2)
    assert per == [
        {"temperature": 1.0, "max_tokens": 8, "seed": 1},
        {"temperature": 0.0, "max_tokens": 8, "seed": 2},
    ]
    with pytest.raises(ValueError, match="1 entries for a wave of 2"):
        wave_params(base, [{"seed": 1}], 2)


def _one_verification_step(p: torch.Tensor, q: torch.Tensor, trials: int, seed: int):
    """Token-level speculative sampling, simulated: per trial a prefill token (id 0, not tested)
    then one verification step of ``k`` drafts from ``q[j]`` checked against ``p[j]`` (accept
    with probability min(1, p/q), else a token from the residual (p - q)+ and stop; all
    accepted: a bonus token from ``p[k]``). Returns each trial's tokens and step lengths."""
    g = torch.Generator().manual_seed(seed)
    k = q.shape[0]
    outs, lengths = [], []
    for _ in range(trials):
        toks = [0]
        for j in range(k + 1):
            if j == k:
                toks.append(int(torch.multinomial(p[j], 1, generator=g)))
                break
            d = int(torch.multinomial(q[j], 1, generator=g))
            if float(torch.rand(1, generator=g, dtype=torch.float64)) < min(
                1.0, float(p[j, d] / q[j, d])
            ):
                toks.append(d)
                continue
            residual = (p[j] - q[j]).clamp_min(0)
            toks.append(int(torch.multinomial(residual / residual.sum(), 1, generator=g)))
            break
        outs.append(toks)
        lengths.append([1, len(toks)])
    return outs, lengths


def test_tokens_after_accepted_drafts_are_the_targets_but_each_blocks_last_is_not():
    """The e2e test's selection keeps the target's distribution; the tempting alternative, each
    accepted block's last token (selected on its own rejection), does not: its tokens come from
    the residual, and the same PIT test rejects them (the control)."""
    k, vocab = 3, 12
    p = _dists(k + 1, vocab, 5)
    q = torch.stack([tempered(row, 0.4) for row in p[:k]])  # a drafter sharper than the target
    outs, lengths = _one_verification_step(p, q, 6000, 7)
    chosen: list[tuple[int, int]] = []  # (position in the step, token)
    last: list[tuple[int, int]] = []
    for toks, sl in zip(outs, lengths, strict=True):
        chosen += [(i - 1, toks[i]) for i in tokens_after_accepted_drafts(sl)]
        if len(toks) >= 3:  # at least one accepted draft: the block's last token
            last.append((len(toks) - 2, toks[-1]))

    def pit(pairs):
        rows = torch.stack([p[j] for j, _ in pairs])
        return randomized_pit(rows, torch.tensor([t for _, t in pairs]), 3)

    assert len(chosen) > 1000 and len(last) > 1000
    assert uniformity_chi_square(pit(chosen), 5)["p_value"] > 1e-3
    assert uniformity_chi_square(pit(last), 5)["p_value"] < 1e-6


def test_noncentral_chi_square_matches_simulation_and_the_central_case():
    """The power function against sums of squared shifted normals (the noncentral chi-square's
    definition), and against the central case at noncentrality 0."""
    from support.reliability import noncentral_chi_square_sf

    assert abs(noncentral_chi_square_sf(9.488, 4, 0.0) - 0.05) < 1e-4
    g = torch.Generator().manual_seed(3)
    for lam in (5.0, 27.6):
        z = torch.randn(200_000, 4, generator=g, dtype=torch.float64)
        z[:, 0] += lam**0.5
        x = (z**2).sum(-1)
        for cut in (9.488, 18.467):
            simulated = float((x >= cut).double().mean())
            assert abs(noncentral_chi_square_sf(cut, 4, lam) - simulated) < 4e-3, (lam, cut)


def test_the_gpu_runs_size_has_the_power_it_claims():
    """The sample sizes behind tests/gpu/test_sampling_gpu.py: from the CPU run's noncentralities
    at temperature 0.8, power 0.9 needs 898 first tokens and 1,108 tokens after an accepted draft
    token; the GPU run's 2,048 requests exceed both."""
    from support.reliability import (
        CPU_RUN_NONCENTRALITY_T08,
        GPU_SAMPLING_REQUESTS,
        SAMPLING_ALPHA,
        SAMPLING_BINS,
        SAMPLING_POWER,
        pit_power,
        samples_for_power,
    )

    need = {
        name: samples_for_power(lam / n, SAMPLING_BINS, SAMPLING_ALPHA, SAMPLING_POWER)
        for name, (lam, n) in CPU_RUN_NONCENTRALITY_T08.items()
    }
    assert need == {"first": 898, "after_accepted": 1108}
    for name, (lam, n) in CPU_RUN_NONCENTRALITY_T08.items():
        per = lam / n
        assert pit_power(need[name], per, SAMPLING_BINS, SAMPLING_ALPHA) >= SAMPLING_POWER
        assert pit_power(need[name] - 1, per, SAMPLING_BINS, SAMPLING_ALPHA) < SAMPLING_POWER
        assert pit_power(GPU_SAMPLING_REQUESTS, per, SAMPLING_BINS, SAMPLING_ALPHA) > 0.99


def test_at_the_gpu_runs_size_the_test_accepts_the_target_and_rejects_temperature_0_8():
    """Synthetic contexts harder than the pair's (vocabulary 448, top token about 0.70 of the
    mass, noncentrality per sample at temperature 0.8 below the CPU run's 0.025): at the GPU run's
    n, draws from the contexts' own distributions are not rejected, draws at temperature 0.8 and
    0.5 are (the control)."""
    from support.reliability import (
        GPU_SAMPLING_REQUESTS,
        SAMPLING_ALPHA,
        SAMPLING_BINS,
        pit_noncentrality_per_sample,
    )

    n = GPU_SAMPLING_REQUESTS
    g = torch.Generator().manual_seed(11)
    p = torch.softmax(torch.randn(n, 448, generator=g, dtype=torch.float64) * 7.0, -1)
    assert pit_noncentrality_per_sample(p[:512], 0.8, SAMPLING_BINS) < 0.025
    right = torch.multinomial(p, 1, generator=g).squeeze(-1)
    got = uniformity_chi_square(randomized_pit(p, right, 4), SAMPLING_BINS)
    assert got["p_value"] > SAMPLING_ALPHA, got
    for t in (0.8, 0.5):
        q = torch.stack([tempered(row, t) for row in p])
        wrong = torch.multinomial(q, 1, generator=g).squeeze(-1)
        got = uniformity_chi_square(randomized_pit(p, wrong, 4), SAMPLING_BINS)
        assert got["p_value"] < SAMPLING_ALPHA, (t, got)
