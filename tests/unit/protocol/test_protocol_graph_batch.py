"""The fixed DSpark graph batch key: taken out of --speculative-config before vLLM validates it,
recorded for the workers, and the drafter dispatch pinned with the DP-sync token count rebuilt."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_dspark_pp.patches import (
    engine_arg_utils__protocol,
    v1_worker_gpu_spec_decode_dspark_speculator__protocol,
)
from vllm_dspark_pp.protocol import graph_batch as gb


def test_key_is_taken_out_of_the_spec_dict():
    spec = {"method": "dspark", "num_speculative_tokens": 3, gb.KEY: 8}
    rest, value = gb.take_from_spec_dict(spec)
    assert value == 8 and gb.KEY not in rest and rest["method"] == "dspark"
    rest, value = gb.take_from_spec_dict({"dspark-pp-fixed-graph-batch": 2})
    assert value == 2 and rest == {}
    assert gb.take_from_spec_dict({"method": "dspark"}) == ({"method": "dspark"}, None)
    for bad in (0, -1, "8", 2.5, True):
        with pytest.raises(gb.FixedGraphBatchError, match=gb.KEY):
            gb.take_from_spec_dict({gb.KEY: bad})


def test_vllm_really_rejects_the_key_so_taking_it_out_is_needed():
    from vllm.config.speculative import SpeculativeConfig

    with pytest.raises(Exception, match=gb.KEY):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, **{gb.KEY: 4})


def _fake_config(method="dspark", max_num_seqs=16):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(method=method, num_speculative_tokens=3),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        parallel_config=SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=2),
        additional_config={},
    )


class _StrictArgs:
    """Stands for EngineArgs: its create_engine_config fails on unknown speculative keys, like
    vLLM's SpeculativeConfig does."""

    def __init__(self, spec, method="dspark", max_num_seqs=16):
        self.speculative_config = spec
        self._method, self._max = method, max_num_seqs
        self.calls = 0

    def create_engine_config(self, usage_context=None, headless=False):
        self.calls += 1
        unknown = set(self.speculative_config) - {"method", "model", "num_speculative_tokens"}
        if unknown:
            raise ValueError(f"unknown speculative fields {unknown}")
        return _fake_config(self._method, self._max)


def _patched_args_class():
    mod = SimpleNamespace(EngineArgs=type("EA", (_StrictArgs,), {}))
    engine_arg_utils__protocol._patch(mod)
    return mod.EngineArgs


def test_engine_args_record_the_value_for_the_workers():
    EA = _patched_args_class()
    args = EA({"method": "dspark", "num_speculative_tokens": 3, gb.KEY: 4})
    cfg = args.create_engine_config()
    assert gb.fixed_graph_batch(cfg) == 4
    assert cfg.additional_config == {"vllm_dspark_pp": {"fixed_graph_batch": 4}}
    # a second config build (vLLM builds more than one at times) keeps the value
    assert gb.fixed_graph_batch(args.create_engine_config()) == 4
    assert gb.fixed_graph_batch(EA({"method": "dspark"}).create_engine_config()) is None


def test_engine_args_reject_the_key_for_other_methods_and_oversized_batches():
    EA = _patched_args_class()
    with pytest.raises(gb.FixedGraphBatchError, match="dspark"):
        EA({"method": "eagle", gb.KEY: 4}, method="eagle").create_engine_config()
    with pytest.raises(gb.FixedGraphBatchError, match="max-num-seqs"):
        EA({"method": "dspark", gb.KEY: 64}, max_num_seqs=16).create_engine_config()


def _dp_sync(num_reqs, num_tokens, dp_size=2):
    from vllm.v1.worker.gpu.dp_utils import DPSyncState

    return DPSyncState(
        num_tokens_across_dp=torch.full((dp_size,), num_tokens, dtype=torch.int32),
        uniform_token_count=3,
        max_query_len=3,
        eager=False,
        num_reqs=num_reqs,
    )


def test_pinned_dispatch_rebuilds_the_dp_sync_token_count():
    q, fixed = 3, 8
    tokens, sync = gb.pinned_dispatch(fixed, 2, 5 * q, q, _dp_sync(5, 5 * q))
    assert tokens == fixed * q
    assert sync.num_tokens_across_dp.tolist() == [fixed * q] * 2
    assert sync.uniform_token_count == q and sync.max_query_len == q
    # no DP: pinned shape, no sync
    assert gb.pinned_dispatch(fixed, 3, 3 * q, q, None) == (fixed * q, None)
    # more requests than the fixed batch (DP-wide): unchanged
    big = _dp_sync(9, 9 * q)
    assert gb.pinned_dispatch(fixed, 2, 9 * q, q, big) == (9 * q, big)
    # agreed eager: unchanged
    import dataclasses

    eager = dataclasses.replace(_dp_sync(2, 2 * q), eager=True)
    assert gb.pinned_dispatch(fixed, 2, 2 * q, q, eager)[1] is eager


class _FakeManager:
    def __init__(self):
        self.seen = []

    def dispatch(
        self,
        num_reqs,
        num_tokens,
        uniform_token_count,
        num_active_loras=0,
        max_query_len=None,
        num_ubatches=1,
    ):
        from vllm.config.compilation import CUDAGraphMode
        from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

        self.seen.append((num_reqs, num_tokens))
        return BatchExecutionDescriptor(
            cg_mode=CUDAGraphMode.FULL,
            num_tokens=num_tokens,
            num_reqs=num_tokens // uniform_token_count,
        )


def test_patched_dispatch_pins_the_tagged_manager_and_passes_vllms_dp_check():
    from vllm.v1.worker.gpu import dp_utils

    q, fixed = 3, 8
    mod = SimpleNamespace(dispatch_cg_and_sync_dp=dp_utils.dispatch_cg_and_sync_dp)
    v1_worker_gpu_spec_decode_dspark_speculator__protocol._patch_dflash(mod)
    manager = _FakeManager()
    setattr(manager, gb.MANAGER_ATTR, fixed)
    # What DFlashSpeculator.propose passes: the target's DP sync rebuilt for 5 * q tokens.
    desc, sync = mod.dispatch_cg_and_sync_dp(
        manager,
        5,
        5 * q,
        uniform_token_count=q,
        dp_size=2,
        dp_rank=1,
        need_eager=False,
        dp_sync_state=_dp_sync(5, 5 * q),
    )
    assert manager.seen == [(5, fixed * q)]
    assert desc.num_tokens == fixed * q and desc.num_reqs == fixed
    assert sync.num_tokens_across_dp.tolist() == [fixed * q, fixed * q]
    # Without the rebuild, vLLM's own check refuses the re-pinned shape:
    with pytest.raises(AssertionError, match="different batch"):
        dp_utils.dispatch_cg_and_sync_dp(
            manager,
            5,
            fixed * q,
            uniform_token_count=q,
            dp_size=2,
            dp_rank=1,
            dp_sync_state=_dp_sync(5, 5 * q),
        )
    # An untagged manager (DFlash, or no key) dispatches as before.
    plain = _FakeManager()
    mod.dispatch_cg_and_sync_dp(plain, 5, 5 * q, uniform_token_count=q, dp_size=1, dp_rank=0)
    assert plain.seen == [(5, 5 * q)]


def test_handshake_facts_carry_the_fixed_batch():
    from vllm_dspark_pp.protocol.handshake import facts_from_config

    cfg = _fake_config()
    gb.record(cfg, 6)
    facts = facts_from_config(cfg)
    assert facts.fixed_graph_batch == 6 and facts.num_speculative_tokens == 3
    assert facts.method == "dspark" and facts.pp_size == 2 and facts.tp_size == 2


def test_pinned_dispatches_are_counted_for_the_engine_log():
    """The one-GPU PP tier reads the pinned-dispatch count from the last stage's log; the count
    rises with each pinned dispatch and never for one that was not pinned."""
    from vllm.v1.worker.gpu import dp_utils

    patch = v1_worker_gpu_spec_decode_dspark_speculator__protocol
    q, fixed = 3, 8
    mod = SimpleNamespace(dispatch_cg_and_sync_dp=dp_utils.dispatch_cg_and_sync_dp)
    patch._patch_dflash(mod)
    manager = _FakeManager()
    setattr(manager, gb.MANAGER_ATTR, fixed)
    before = patch._pinned[0]
    for _ in range(3):
        mod.dispatch_cg_and_sync_dp(manager, 5, 5 * q, uniform_token_count=q, dp_size=1, dp_rank=0)
    assert patch._pinned[0] == before + 3
    # more requests than the fixed batch: dispatched as without the key, not counted
    mod.dispatch_cg_and_sync_dp(manager, 9, 9 * q, uniform_token_count=q, dp_size=1, dp_rank=0)
    assert patch._pinned[0] == before + 3
