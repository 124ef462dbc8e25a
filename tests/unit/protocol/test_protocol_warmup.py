"""The warm-up patch: no PP broadcast on any rank during warm-up, then the non-last ranks'
deferred post-update (plain and draft-adopting) is run on receive-shaped buffers with every row
masked, through vLLM's real post_update kernel (Triton interpreter on CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from protocol_sim import FakeGroup, aligned, make_handler
from test_protocol_pp_handler import decode_batch

from vllm_dspark_pp.patches import v1_worker_gpu_warmup
from vllm_dspark_pp.protocol.handler import prewarm_deferred_post_update
from vllm_dspark_pp.protocol.schedule import counts_row_len


class FakeRunner:
    """The pieces of GPUModelRunner the warm-up patch and the deferred post-update touch; its
    postprocess_sampled calls vLLM's real post_update kernel on real state tensors."""

    def __init__(self, handler, k, max_num_reqs=8, max_model_len=64):
        self.pp_handler = handler
        self.max_num_reqs = max_num_reqs
        self.is_last_pp_rank = handler.is_last_rank
        self.num_computed = torch.arange(max_num_reqs, dtype=torch.int32) + 5
        self.last_sampled = torch.full((max_num_reqs,), 7, dtype=torch.int64)
        self.all_token_ids = torch.zeros(max_num_reqs, max_model_len, dtype=torch.int32)
        self.total_len = torch.full((max_num_reqs,), 6, dtype=torch.int32)
        self.draft_tokens = torch.full((max_num_reqs, max(k, 1)), 9, dtype=torch.int64)[:, :k]
        self.draft_tokens = self.draft_tokens.contiguous()
        self.calls = []

    def postprocess_sampled(
        self,
        idx_mapping,
        sampled_tokens,
        num_sampled,
        num_rejected,
        query_start_loc=None,
        draft_tokens=None,
    ):
        from vllm.v1.worker.gpu.input_batch import post_update

        self.calls.append(
            dict(
                idx=idx_mapping.clone(),
                sampled=sampled_tokens,
                ns=num_sampled,
                nr=num_rejected,
                drafts=draft_tokens,
            )
        )
        post_update(
            idx_mapping,
            self.num_computed,
            self.last_sampled,
            None,
            sampled_tokens,
            num_sampled,
            num_rejected,
            query_start_loc,
            self.all_token_ids,
            self.total_len,
            draft_tokens,
            self.draft_tokens if draft_tokens is not None else None,
        )

    def snapshot(self):
        return [
            t.clone()
            for t in (
                self.num_computed,
                self.last_sampled,
                self.all_token_ids,
                self.total_len,
                self.draft_tokens,
            )
        ]


@pytest.mark.parametrize("k", [0, 3])
def test_prewarm_runs_both_variants_on_receive_layout_without_touching_state(cpu_streams, k):
    runner = FakeRunner(make_handler(0, 2, k, 8, FakeGroup(0)), k)
    before = runner.snapshot()
    assert prewarm_deferred_post_update(runner) == (2 if k else 1)
    after = runner.snapshot()
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    width = k + 1 if k else 1
    for call in runner.calls:
        assert (call["idx"] == -1).all() and call["idx"].dtype == torch.int64
        assert call["sampled"].shape[1] == width and call["sampled"].stride(0) == width
        n = call["sampled"].shape[0]
        assert call["nr"].data_ptr() - call["ns"].data_ptr() == 4 * counts_row_len(n)
        assert all(aligned(call[x]) for x in ("sampled", "ns", "nr"))
    assert [c["drafts"] is not None for c in runner.calls] == ([False, True] if k else [False])


def test_prewarm_is_a_no_op_on_the_last_rank(cpu_streams):
    runner = FakeRunner(make_handler(1, 2, 2, 8, FakeGroup(1)), 2)
    assert prewarm_deferred_post_update(runner) == 0 and runner.calls == []


def test_warmup_posts_no_broadcast_on_any_rank_then_prewarms(patch_broadcast):
    posts = []
    patch_broadcast(lambda t, src, group=None, async_op=False: posts.append(group.rank))
    k = 2
    runners = {r: FakeRunner(make_handler(r, 3, k, 8, FakeGroup(r)), k) for r in range(3)}
    batch = decode_batch(3, drafts=k)

    def fake_warmup_kernels(model_runner, execute, sample):
        # a warm-up step as the model runner runs it on this rank
        h = model_runner.pp_handler
        h.begin_step(k)
        if h.is_last_rank:
            h.broadcast(
                torch.zeros(3, k + 1, dtype=torch.int64),
                torch.ones(3, dtype=torch.int32),
                torch.zeros(3, dtype=torch.int32),
                batch,
            )
            h.broadcast_drafts(torch.zeros(3, k, dtype=torch.int64))
        else:
            assert h.receive(batch, recv_drafts=True) is False
        h.end_step()

    def fake_sizing(model_runner, execute, sample):
        fake_warmup_kernels(model_runner, execute, sample)
        return "sized"

    mod = SimpleNamespace(
        warmup_kernels=fake_warmup_kernels, run_kv_cache_sizing_warmup=fake_sizing
    )
    v1_worker_gpu_warmup._patch(mod)
    for r in (2, 0, 1):
        assert mod.run_kv_cache_sizing_warmup(runners[r], None, None) == "sized"
        mod.warmup_kernels(runners[r], None, None)
    assert posts == [], "a warm-up step posted a PP broadcast"
    assert [len(runners[r].calls) for r in range(3)] == [2, 2, 0]
    # serving afterwards: the exchange is on again
    h = runners[0].pp_handler
    h.begin_step(k)
    assert h.receive(batch, recv_drafts=True) is True
    assert posts == [0, 0, 0]
