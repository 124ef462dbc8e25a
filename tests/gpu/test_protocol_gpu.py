"""One GPU: after the patched warm-up's pre-warm, the non-last-rank deferred post-update path
(receive -> ring -> get_prev_sampled_outputs -> GPUModelRunner.postprocess_sampled, with and
without drafts, every batch size, some rows freed) compiles no new Triton kernel.

Self-contained: the real patched PPHandler and vLLM's real RequestState and postprocess_sampled
on CUDA; only the PP group and the broadcast are stand-ins (one process). A control shows the
counter works: vLLM 0.34.0's own layouts (a [2, N] counts buffer with N % 4 != 0, a width-1
sampled payload) compile new variants on the same process.

Run on the GPU machine:  python -m pytest -m gpu -s tests/gpu/test_protocol_gpu.py
"""

from __future__ import annotations

import os
from types import MethodType, SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

K = 3  # drafts per step
MAX_REQS = 32
BATCH_SIZES = [1, 2, 3, 5, 6, 7, 8, 13, 16, 31]
# "cpu" only for a dry run of the test logic under the Triton interpreter (no compiles there).
DEVICE = os.environ.get("DSPARK_PP_PROTOCOL_GPU_TEST_DEVICE", "cuda")


class CompileCounter:
    """Counts every Triton compilation in the process (post-compile hook)."""

    def __init__(self):
        import triton

        self.knobs = triton.knobs.runtime
        self.count = 0
        self.names: list[str] = []

    def __enter__(self):
        self.prev = self.knobs.jit_post_compile_hook

        def hook(*args, **kwargs):
            self.count += 1
            fn = kwargs.get("fn")
            self.names.append(getattr(fn, "name", str(fn)))
            if self.prev is not None:
                return self.prev(*args, **kwargs)
            return None

        self.knobs.jit_post_compile_hook = hook
        return self

    def __exit__(self, *exc):
        self.knobs.jit_post_compile_hook = self.prev
        return False


class FakePP:
    def __init__(self, rank, world):
        self.rank_in_group, self.world_size = rank, world
        self.is_last_rank = rank == world - 1
        self.last_rank = world - 1
        self.ranks = list(range(world))

    def make_sibling_device_group(self, group_desc=None):
        return object()


def fake_broadcast(tensor, src, group=None, async_op=False):
    # what the last rank would send: 1 sampled token, 0 rejected, small token ids
    tensor.fill_(1)


def batch_of(n, slots, drafts):
    idx_np = np.asarray(slots, dtype=np.intp)
    return SimpleNamespace(
        num_reqs=n,
        idx_mapping_np=idx_np,
        idx_mapping=torch.from_numpy(idx_np.astype(np.int64)).to(DEVICE),
        num_computed_tokens_np=np.full(n, 10, dtype=np.int32),
        num_scheduled_tokens=np.full(n, 1 + drafts, dtype=np.int32),
        prefill_len_np=np.full(n, 4, dtype=np.int32),
        max_seq_len_np=None,
        is_prefilling_np=np.zeros(n, dtype=bool),
        num_draft_tokens=n * drafts,
    )


@pytest.fixture(scope="module")
def setup():
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from vllm_dspark_pp.patches import v1_worker_gpu_pp_utils, v1_worker_gpu_warmup

    v1_worker_gpu_pp_utils.apply()
    v1_worker_gpu_warmup.apply()
    from vllm.v1.worker.gpu import pp_utils, warmup
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.states import RequestState

    from vllm_dspark_pp.patches._util import is_patched

    assert is_patched(warmup, "warmup_kernels") and pp_utils.PPHandler.__name__ == "DSparkPPHandler"
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if DEVICE == "cuda"
        else torch.device(DEVICE)
    )
    saved = pp_utils.get_pp_group
    pp_utils.get_pp_group = lambda: FakePP(0, 2)
    try:
        handler = pp_utils.PPHandler(MAX_REQS, K, device)
    finally:
        pp_utils.get_pp_group = saved
    runner = SimpleNamespace(
        pp_handler=handler,
        max_num_reqs=MAX_REQS,
        is_last_pp_rank=False,
        req_states=RequestState(
            max_num_reqs=MAX_REQS,
            max_model_len=256,
            max_num_batched_tokens=512,
            num_speculative_steps=K,
            vocab_size=1000,
            device=device,
        ),
        model_state=SimpleNamespace(postprocess_state=lambda *a, **k: None),
    )
    runner.postprocess_sampled = MethodType(GPUModelRunner.postprocess_sampled, runner)
    return runner


def test_no_triton_compile_in_the_deferred_post_update_after_prewarm(setup, monkeypatch):
    from vllm_dspark_pp.protocol.handler import prewarm_deferred_post_update

    runner = setup
    handler = runner.pp_handler
    monkeypatch.setattr(torch.distributed, "broadcast", fake_broadcast)
    with CompileCounter() as warm:
        variants = prewarm_deferred_post_update(runner)
    print(
        f"\n[protocol-gpu] pre-warm ran {variants} post-update variants, "
        f"{warm.count} Triton compiles: {warm.names}"
    )
    assert variants == 2

    applied = 0
    with CompileCounter() as serving:
        for drafts in (0, K):
            for n in BATCH_SIZES:
                slots = list(range(n))
                batch = batch_of(n, slots, drafts)
                handler.get_prev_sampled_outputs()
                handler.begin_step(K if drafts else 0)
                handler.receive(batch, recv_drafts=drafts > 0)
                handler.end_step()
                if n > 2:
                    handler.on_req_idx_freed(slots[1])  # one row freed: masked idx path
                handler.get_prev_sampled_outputs()  # ring depth 2: still in flight
                out = handler.get_prev_sampled_outputs()
                assert out is not None
                assert (out["draft_tokens"] is not None) == (drafts > 0)
                runner.postprocess_sampled(**out)
                applied += 1
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    print(
        f"[protocol-gpu] serving: {applied} deferred post-updates (N in {BATCH_SIZES}, "
        f"with and without drafts), {serving.count} new Triton compiles: {serving.names}"
    )
    assert serving.count == 0, f"new Triton compiles while serving: {serving.names}"


def test_control_vllm_0340_layouts_compile_new_variants(setup):
    """The counter can fail: a misaligned counts row and a width-1 payload are new variants."""
    runner = setup
    dev = runner.pp_handler.device
    n = 3
    combined = torch.ones(2, n, dtype=torch.int32, device=dev)  # 0.34.0: [2, N] counts
    num_sampled, num_rejected = combined.unbind(0)
    idx = torch.full((n,), -1, dtype=torch.int64, device=dev)
    with CompileCounter() as c:
        runner.postprocess_sampled(
            idx_mapping=idx,
            sampled_tokens=torch.ones(n, 1, dtype=torch.int64, device=dev),  # width 1
            num_sampled=num_sampled,
            num_rejected=num_rejected,
        )
        torch.cuda.synchronize()
    print(f"[protocol-gpu] control (0.34.0 layouts): {c.count} new compiles: {c.names}")
    assert c.count >= 1
