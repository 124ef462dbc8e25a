"""Randomized schedules through the real patched PPHandler of every PP rank (no collectives).

1,200 seeded cases (seeds 0..1199): mixes of chunked prefills, decodes with and without drafts,
skipped drafts, aborts, preemptions, max-length finishes and empty steps, PP sizes 2..4
(seed % 3 + 2), k in {0, 1, 2, 3, 5}, adaptive verification (the drafts payload carries each
request's admitted draft count) in every other block of 15 seeds with k > 0. Every rank must post
the identical collective sequence,
every posted buffer and every view handed to the post-update kernel must be 16-byte aligned, the
received data must equal the sent data and the ring must deliver it pp_size steps later; before
every step every rank must return the same admitted count for every request slot, the one of the
slot's latest draft broadcast.
A failing seed prints a minimal reproducer.
"""

from __future__ import annotations

import os

import protocol_replay
import pytest
from protocol_sim import random_case

from vllm_dspark_pp.protocol import handler as pp_exchange
from vllm_dspark_pp.protocol.schedule import (
    ExchangeMismatch,
    Payload,
    StepSchedule,
    compare_sequences,
)

NUM_CASES = int(os.environ.get("DSPARK_PP_RANDOM_CASES", "1200"))
SEEDS = range(NUM_CASES)


_last_logs: dict = {}


def _fails(case, patch_broadcast) -> str | None:
    try:
        logs, problems = protocol_replay.replay(case, patch_broadcast)
        _last_logs.clear()
        _last_logs.update(logs)
        compare_sequences(logs)
    except (ExchangeMismatch, pp_exchange.ExchangeError, AssertionError) as e:
        return str(e)
    return "; ".join(problems[:3]) or None


def _first_failure(patch_broadcast, eligible) -> tuple[int, str] | None:
    """The first seed (among cases ``eligible`` accepts) whose replay fails, with its error."""
    for seed in SEEDS:
        case = random_case(seed)
        if eligible(case):
            err = _fails(case, patch_broadcast)
            if err:
                return seed, err
    return None


def test_every_rank_posts_the_same_collectives_1200_seeds(patch_broadcast):
    assert NUM_CASES >= 1000 or os.environ.get("DSPARK_PP_RANDOM_CASES")
    posted = steps = 0
    pp_sizes, ks, adaptive, lags = set(), set(), set(), set()
    for seed in SEEDS:
        case = random_case(seed)
        pp_sizes.add(case.pp_size)
        ks.add(case.k)
        adaptive.add((case.adaptive, case.pp_size, case.k))
        lags.add((case.adaptive, case.admitted_lag))
        err = _fails(case, patch_broadcast)
        if err:
            repro = protocol_replay.minimal_reproducer(seed, patch_broadcast, _fails)
            pytest.fail(f"seed {seed}: {err}\n{repro}")
        posted += len(_last_logs[0])
        steps += len(case.steps)
    assert pp_sizes == {2, 3, 4} and ks == {0, 1, 2, 3, 5}
    assert {(p, k) for a, p, k in adaptive if a} == {
        (p, k) for p in (2, 3, 4) for k in (1, 2, 3, 5)
    }
    assert {lag for a, lag in lags if a} == {0, 1, 2}  # every admitted-count lag is replayed
    assert posted > 0
    print(f"{NUM_CASES} seeded cases (seeds 0..{NUM_CASES - 1}), {steps} steps: identical")


def test_cases_cover_every_situation():
    """The generator really produces each situation the issue lists (so the test above can fail
    on them)."""
    seen = dict(
        prefill_chunk=0,
        decode_drafts=0,
        decode_plain=0,
        skipped_drafts=0,
        freed=0,
        empty=0,
        capped=0,
        nothing_posted=0,
    )
    from vllm_dspark_pp.protocol.schedule import need_sampled_mask

    for seed in range(200):
        case = random_case(seed)
        for s in case.steps:
            seen["freed"] += bool(s.freed)
            if s.batch is None:
                seen["empty"] += 1
                continue
            b = s.batch
            seen["prefill_chunk"] += int(
                (b.num_computed_tokens_np + b.num_scheduled_tokens < b.prefill_len_np).any()
            )
            seen["decode_drafts"] += int((b.num_drafts_np > 0).any())
            seen["decode_plain"] += int(((~b.is_prefilling_np) & (b.num_drafts_np == 0)).any())
            seen["skipped_drafts"] += int(case.k > 0 and s.num_spec_tokens == 0)
            if b.max_seq_len_np is not None:
                seen["capped"] += int(
                    ((b.prefill_len_np + 1 >= b.max_seq_len_np) & b.is_prefilling_np).any()
                )
            seen["nothing_posted"] += need_sampled_mask(b) is None
    assert all(v > 0 for v in seen.values()), seen


def test_a_broken_schedule_on_one_side_is_caught(patch_broadcast, monkeypatch, capsys):
    """Non-last ranks use 0.34.0's old width rule ([N, 1] when the batch has no drafts): the
    comparison must catch it and print a minimal reproducer."""
    real = pp_exchange.schedule_for

    def broken(handler, input_batch, num_spec_tokens):
        sched = real(handler, input_batch, num_spec_tokens)
        if handler.is_last_rank or not sched.posts or input_batch.num_draft_tokens > 0:
            return sched
        payloads = tuple(
            Payload(p.name, (p.shape[0], 1), p.dtype) if p.name == "sampled" else p
            for p in sched.payloads
        )
        return StepSchedule(sched.num_reqs, payloads, sched.need_sampled_mask)

    monkeypatch.setattr(pp_exchange, "schedule_for", broken)
    caught = _first_failure(patch_broadcast, lambda case: case.k > 0)
    assert caught is not None, "a broken non-last schedule went unnoticed"
    seed, err = caught
    repro = protocol_replay.minimal_reproducer(seed, patch_broadcast, _fails)
    print(f"caught at seed {seed}: {err}\n{repro}")
    assert "collective #" in err and "rank" in err
    assert f"seed={seed}" in repro and "step 0:" in repro


def test_a_corrupted_admitted_count_on_one_rank_is_caught(patch_broadcast, monkeypatch, capsys):
    """Control for the admitted counts: rank 0 keeps count + 1 for every request; the per-step
    comparison must catch it at the first step that reads a count."""
    real = pp_exchange.DSparkExchange._keep_admitted

    def corrupted(self, column, idx_mapping_np):
        if not self.is_last_rank and self.broadcast_group.rank == 0:
            column = column + 1
        return real(self, column, idx_mapping_np)

    monkeypatch.setattr(pp_exchange.DSparkExchange, "_keep_admitted", corrupted)
    caught = _first_failure(patch_broadcast, lambda case: case.adaptive)
    assert caught is not None, "a corrupted admitted count went unnoticed"
    seed, err = caught
    print(f"caught at seed {seed}: {err}")
    assert "rank 0 admitted counts" in err
