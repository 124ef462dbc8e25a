"""The real patched PPHandler, one rule at a time (recording broadcast, CPU)."""

from __future__ import annotations

import numpy as np
import protocol_replay
import pytest
import torch
from protocol_sim import Batch, FakeGroup, aligned, make_handler, random_case

from vllm_dspark_pp.protocol.handler import DSparkExchange, ExchangeError
from vllm_dspark_pp.protocol.schedule import (
    ExchangeSpec,
    counts_row_len,
    need_sampled_mask,
    step_schedule,
)


def decode_batch(n, drafts=0):
    return Batch(
        req_ids=[f"r{i}" for i in range(n)],
        idx_mapping_np=np.arange(n, dtype=np.intp),
        num_computed_tokens_np=np.full(n, 10, dtype=np.int32),
        num_scheduled_tokens=np.full(n, 1 + drafts, dtype=np.int32),
        prefill_len_np=np.full(n, 5, dtype=np.int32),
        max_seq_len_np=None,
        is_prefilling_np=np.zeros(n, dtype=bool),
        num_drafts_np=np.full(n, drafts, dtype=np.int32),
    )


class Recorder:
    def __init__(self):
        self.posts = []

    def __call__(self, tensor, src, group=None, async_op=False):
        self.posts.append((group.rank, tuple(tensor.shape), tensor.dtype, aligned(tensor)))


@pytest.fixture
def rec(patch_broadcast):
    r = Recorder()
    patch_broadcast(r)
    return r


@pytest.mark.parametrize("n", range(1, 10))
def test_plain_sampler_rows_are_padded_and_counts_rows_aligned(rec, n):
    k = 3
    last = make_handler(1, 2, k, 16, FakeGroup(1))
    other = make_handler(0, 2, k, 16, FakeGroup(0))
    batch = decode_batch(n)  # no drafts in this batch: the sampler returns [N, 1]
    last.begin_step(k)
    last.broadcast(
        torch.arange(n, dtype=torch.int64).view(n, 1),
        torch.ones(n, dtype=torch.int32),
        torch.zeros(n, dtype=torch.int32),
        batch,
    )
    last.broadcast_drafts(torch.zeros(n, k, dtype=torch.int64))
    last.end_step()
    other.begin_step(k)
    assert other.receive(batch, recv_drafts=True) is True
    other.end_step()
    want = [((n, k + 1), torch.int64), ((2, counts_row_len(n)), torch.int32), ((n, k), torch.int64)]
    assert [(p[1], p[2]) for p in rec.posts if p[0] == 1] == want
    assert [(p[1], p[2]) for p in rec.posts if p[0] == 0] == want
    assert all(p[3] for p in rec.posts)
    slot = other.queue[-1]
    assert slot.sampled_tokens.shape == (n, k + 1)
    for view in (slot.num_sampled, slot.num_rejected, slot.sampled_tokens, slot.draft_tokens):
        assert aligned(view)
        assert view.data_ptr() % 16 == 0


def test_second_draft_broadcast_in_a_step_is_refused(rec):
    last = make_handler(1, 2, 2, 8, FakeGroup(1))
    b = decode_batch(3, drafts=2)
    last.begin_step(2)
    last.broadcast(
        torch.zeros(3, 3, dtype=torch.int64),
        torch.ones(3, dtype=torch.int32),
        torch.zeros(3, dtype=torch.int32),
        b,
    )
    last.broadcast_drafts(torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ExchangeError, match="posted twice"):
        last.broadcast_drafts(torch.zeros(3, 2, dtype=torch.int64))


def test_planned_draft_broadcast_that_never_comes_fails_the_step(rec):
    last = make_handler(1, 2, 2, 8, FakeGroup(1))
    last.begin_step(2)
    last.broadcast(
        torch.zeros(3, 3, dtype=torch.int64),
        torch.ones(3, dtype=torch.int32),
        torch.zeros(3, dtype=torch.int32),
        decode_batch(3, drafts=2),
    )
    with pytest.raises(ExchangeError, match="wait forever"):
        last.end_step()


def test_drafts_on_a_step_that_schedules_none_are_refused(rec):
    last = make_handler(1, 2, 2, 8, FakeGroup(1))
    last.begin_step(0)  # skip_drafts: num_spec_tokens_to_schedule == 0
    last.broadcast(
        torch.zeros(3, 1, dtype=torch.int64),
        torch.ones(3, dtype=torch.int32),
        torch.zeros(3, dtype=torch.int32),
        decode_batch(3),
    )
    with pytest.raises(ExchangeError, match="schedule has none"):
        last.broadcast_drafts(torch.zeros(3, 2, dtype=torch.int64))


def test_receive_refuses_a_draft_flag_that_contradicts_the_step(rec):
    other = make_handler(0, 2, 2, 8, FakeGroup(0))
    other.begin_step(2)
    with pytest.raises(ExchangeError, match="recv_drafts"):
        other.receive(decode_batch(2), recv_drafts=False)


def test_disabled_exchange_posts_nothing_on_any_rank(rec):
    last = make_handler(2, 3, 2, 8, FakeGroup(2))
    mid = make_handler(1, 3, 2, 8, FakeGroup(1))
    b = decode_batch(4, drafts=2)
    with last.exchange_disabled(), mid.exchange_disabled():
        last.begin_step(2)
        last.broadcast(
            torch.zeros(4, 3, dtype=torch.int64),
            torch.ones(4, dtype=torch.int32),
            torch.zeros(4, dtype=torch.int32),
            b,
        )
        last.broadcast_drafts(torch.zeros(4, 2, dtype=torch.int64))
        last.end_step()
        mid.get_prev_sampled_outputs()
        mid.begin_step(2)
        assert mid.receive(b, recv_drafts=True) is False
        mid.end_step()
        assert mid.queue[-1] is None
    assert rec.posts == []
    assert last.sampled_tokens_broadcast is False
    # enabled again after the block
    mid.begin_step(2)
    assert mid.receive(b, recv_drafts=True) is True
    assert len(rec.posts) == 3


def test_ring_depth_and_aux_relay_of_vllm_are_kept(cpu_streams):

    from vllm_dspark_pp.protocol.handler import vllm_pp_handler_class

    h = make_handler(0, 4, 1, 8, FakeGroup(0))
    assert type(h).__name__ == "DSparkPPHandler" and isinstance(h, vllm_pp_handler_class(type(h)))
    assert len(h.queue) == 4 and all(s is None for s in h.queue)
    for name in ("relay_aux_hidden_states", "get_prev_sampled_outputs", "on_req_idx_freed"):
        assert name not in type(h).__dict__ and name not in DSparkExchange.__dict__, name
    h.on_req_idx_freed(3)
    assert h.req_idx_gen_np[3] == 1


def test_need_sampled_mask_matches_vllm(cpu_streams):
    from vllm.v1.worker.gpu.pp_utils import compute_need_sampled_mask

    checked = 0
    for seed in range(300):
        for s in random_case(seed).steps:
            if s.batch is None:
                continue
            ours, theirs = need_sampled_mask(s.batch), compute_need_sampled_mask(s.batch)
            assert (ours is None) == (theirs is None)
            if ours is not None:
                assert np.array_equal(ours, theirs)
            checked += 1
    assert checked > 1000


def test_schedule_is_a_pure_function_of_the_batch():
    spec = ExchangeSpec(3)
    b = decode_batch(5, drafts=3)
    a1, a2 = step_schedule(spec, b, 3), step_schedule(spec, b, 3)
    assert a1 == a2 and a1.digest() == a2.digest()
    assert [p.name for p in a1.payloads] == ["sampled", "counts", "drafts"]
    assert [p.name for p in step_schedule(spec, b, 0).payloads] == ["sampled", "counts"]
    assert step_schedule(spec, b, 3, enabled=False).payloads == ()
    assert step_schedule(ExchangeSpec(0), b, 0).sampled.shape == (5, 1)


def test_unpatched_vllm_handler_fails_the_alignment_check(patch_broadcast):
    """The same replay against vLLM 0.34.0's own PPHandler methods finds the misaligned counts
    view this plugin fixes (so the randomized test can tell the two apart)."""
    from vllm.v1.worker.gpu import pp_utils

    from vllm_dspark_pp.protocol.handler import DSparkExchange, vllm_pp_handler_class

    ours = pp_utils.PPHandler
    assert issubclass(ours, DSparkExchange)
    vllm_cls = vllm_pp_handler_class(ours)
    # Our step brackets (the replay calls them), vLLM 0.34.0's exchange methods.
    stock = type(
        "StockExchange",
        (ours,),
        {
            n: vllm_cls.__dict__[n]
            for n in ("broadcast", "receive", "broadcast_drafts", "_sample_len")
        },
    )
    try:
        pp_utils.PPHandler = stock
        found = None
        for seed in range(60):
            case = random_case(seed)
            _, problems = protocol_replay.replay(case, patch_broadcast)
            if any("not 16-byte aligned" in p for p in problems):
                found = seed
                break
        assert found is not None
    finally:
        pp_utils.PPHandler = ours
