"""The CPU side of the DSV4 router test at 256/384 experts (issue 26, part 4;
tests/gpu/test_dsv4_router_256.py runs vLLM's Triton ``dsv4_topk`` on CUDA).

What can run on the CPU:
* vLLM's CPU router for DSV4 (``cpu_router._sqrtsoftplus_bias_topk``, the ``biased_topk_cpu``
  kernel of vLLM's CPU library) against the pure-torch reference at 256 and 384 experts;
* ``can_use_dsv4_topk`` on the GPU test's exact inputs with the platform reported as CUDA (the
  gate itself is CUDA-only), and the ``dsv4_topk`` wrapper's checks (a uint32 index dtype is
  refused with a padding mask: the -1 sentinel needs a signed dtype);
* a dry run of the GPU test's whole flow (``dsv4_topk`` and ``fused_topk_bias`` with the padding
  mask, the checks and the controls) with the Triton kernel, which does not exist without CUDA,
  replaced by a pure-torch stand-in: it catches shape, dtype and argument mistakes before the GPU.
What cannot: the Triton kernel itself and its CUDA-graph replay (``_dsv4_topk_kernel`` is only
defined when vLLM's platform is CUDA).
"""

from __future__ import annotations

import pytest
import torch
from support import dsv4_router_ref as ref


def _topk_mod():
    from vllm.model_executor.layers.fused_moe.router import dsv4_topk as topk_mod

    return topk_mod


class _FakeKernel:
    """Stands in for ``_dsv4_topk_kernel[(grid,)](...)`` on the CPU: checks the launch and writes
    the reference's rows (id -1 / weight 0 on padding rows)."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(logits, bias, is_padding, w_out, ids_out, scale, input_ids, bias_vl, lo, **kw):
            n, e = logits.shape
            assert grid == (n,), grid
            assert kw["NUM_EXPERTS"] == e and kw["BLOCK_N"] >= e
            assert kw["HAS_PADDING"] == (is_padding is not None) and not kw["HAS_VL"]
            assert logits.dtype == torch.float32 and logits.is_contiguous()
            assert bias.dtype == torch.float32 and tuple(bias.shape) == (e,)
            assert w_out.dtype == torch.float32 and tuple(w_out.shape) == (n, ref.TOPK)
            assert ids_out.dtype in (torch.int32, torch.int64)
            self.launches.append(kw)
            w, ids = ref.reference_topk(logits, bias, scale)
            w_out.copy_(w.float())
            ids_out.copy_(ids.to(ids_out.dtype))
            if is_padding is not None:
                w_out[is_padding] = 0.0
                ids_out[is_padding] = -1

        return launch


@pytest.fixture
def fake_cuda_topk(monkeypatch):
    topk_mod = _topk_mod()
    fake = _FakeKernel()
    monkeypatch.setattr(topk_mod, "_dsv4_topk_kernel", fake, raising=False)
    monkeypatch.setattr(topk_mod.current_platform, "is_cuda", lambda: True)
    return topk_mod, fake


@pytest.mark.parametrize("num_experts", [256, 384])
def test_reference_matches_vllm_cpu_router(num_experts):
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    if not hasattr(torch.ops._C, "biased_topk_cpu"):
        pytest.skip("vLLM's CPU kernel library (biased_topk_cpu) is not loaded here")
    for r, _ in ref.BATCHES:
        case = ref.make_case(num_experts, r, seed=100 * r + num_experts)
        w, ids = cpu_router._sqrtsoftplus_bias_topk(
            case.logits, ref.TOPK, True, case.bias, ref.SCALE, None, None
        )
        assert ids.dtype == torch.int32 and w.dtype == torch.float32
        assert ref.reference_problems(w, ids, case.logits, case.bias) == []
        # control: the reference without the bias disagrees with vLLM's router
        if r >= 5:
            assert ref.reference_problems(w, ids, case.logits, case.bias, use_bias=False)


@pytest.mark.parametrize("num_experts", [256, 384])
def test_gpu_inputs_shapes_margins_and_padding(num_experts):
    for r, p in ref.BATCHES:
        case = ref.make_case(num_experts, r, seed=100 * r + num_experts)
        assert case.logits.dtype == torch.float32 and case.logits.is_contiguous()
        assert tuple(case.logits.shape) == (r, num_experts)
        assert case.bias.dtype == torch.float32 and tuple(case.bias.shape) == (num_experts,)
        assert bool((ref.score_margin(case.logits, case.bias) >= ref.MIN_MARGIN).all())
        for kind in ref.GARBAGE:
            logits, mask = ref.padded(case, p, kind)
            assert logits.dtype == torch.float32 and logits.is_contiguous()
            assert tuple(logits.shape) == (p, num_experts) and mask.dtype == torch.bool
            assert torch.equal(logits[:r], case.logits) and int(mask.sum()) == p - r
            assert not bool(mask[:r].any())


def test_fast_path_gate_on_the_gpu_inputs(monkeypatch):
    topk_mod = _topk_mod()
    case = ref.make_case(256, 8, seed=256)
    assert not topk_mod.can_use_dsv4_topk(case.logits, case.bias, 6, True, torch.int32), (
        "off CUDA the fast path must be refused"
    )
    monkeypatch.setattr(topk_mod.current_platform, "is_cuda", lambda: True)
    for dt in (torch.int32, torch.int64):
        assert topk_mod.can_use_dsv4_topk(case.logits, case.bias, ref.TOPK, True, dt)
    assert not topk_mod.can_use_dsv4_topk(case.logits, case.bias, ref.TOPK, True, torch.uint32)
    assert not topk_mod.can_use_dsv4_topk(case.logits.bfloat16(), case.bias, 6, True, torch.int32)


def test_wrapper_refuses_unsigned_ids_with_padding(fake_cuda_topk):
    topk_mod, fake = fake_cuda_topk
    logits, mask = ref.padded(ref.make_case(256, 3, seed=3), 4, "nan")
    with pytest.raises(AssertionError, match="signed"):
        topk_mod.dsv4_topk(logits, logits.new_zeros(256), torch.uint32, 1.0, is_padding=mask)
    with pytest.raises(AssertionError):
        topk_mod.dsv4_topk(logits, logits.new_zeros(256), torch.int32, 1.0, is_padding=mask.int())
    assert fake.launches == []


def test_dry_run_of_the_gpu_flow(fake_cuda_topk, monkeypatch):
    """The GPU test's calls, checks and controls with the stand-in kernel (device cpu)."""
    import importlib.util
    import pathlib

    topk_mod, fake = fake_cuda_topk
    path = pathlib.Path(__file__).parents[2] / "gpu" / "test_dsv4_router_256.py"
    spec = importlib.util.spec_from_file_location("_dsv4_router_256_dry", path)
    gpu_test = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_test)
    from vllm.model_executor.layers.fused_moe.router import fused_topk_bias_router as router

    for num_experts in (256, 384):
        for id_dtype in ("int32", "int64"):
            for r, p in ref.BATCHES:
                case = ref.make_case(num_experts, r, seed=100 * r + num_experts)
                w_u, ids_u = gpu_test._run(topk_mod, case.logits, case.bias, id_dtype, None)
                assert ids_u.dtype == getattr(torch, id_dtype)
                assert ref.reference_problems(w_u, ids_u, case.logits, case.bias) == []
                for kind in ref.GARBAGE:
                    logits, mask = ref.padded(case, p, kind)
                    w_p, ids_p = gpu_test._run(topk_mod, logits, case.bias, id_dtype, mask)
                    assert ref.rows_differ(w_u, ids_u, w_p[:r], ids_p[:r]) == []
                    assert ref.padding_problems(w_p, ids_p, mask) == []
    assert fake.launches and all(kw["HAS_PADDING"] in (True, False) for kw in fake.launches)

    # the controls of the GPU test, with the same seeds
    r, p = 7, 8
    case = ref.make_case(256, r, seed=7)
    w_u, ids_u = gpu_test._run(topk_mod, case.logits, case.bias, "int32", None)
    pert = ref.Case(ref.perturb_row(case, 3), case.bias, 256, case.seed)
    logits, mask = ref.padded(pert, p, "nan")
    w_p, ids_p = gpu_test._run(topk_mod, logits, case.bias, "int32", mask)
    assert ref.rows_differ(w_u, ids_u, w_p[:r], ids_p[:r]) == [3]
    logits, mask = ref.padded(case, p, "random")
    w_n, ids_n = gpu_test._run(topk_mod, logits, case.bias, "int32", None)
    assert ref.padding_problems(w_n, ids_n, mask)
    assert ref.reference_problems(w_u, ids_u, case.logits, case.bias, use_bias=False)
    assert ref.reference_problems(w_u, ids_u, case.logits, case.bias, scoring="sigmoid")
    assert ref.reference_problems(w_u, ids_u, case.logits, case.bias, scale=1.0)

    # the router entry with the runner's mask reaches dsv4_topk
    import types

    from vllm.model_executor.layers.fused_moe.router import base_router

    case = ref.make_case(384, 5, seed=55 + 384)
    logits, mask = ref.padded(case, 8, "huge")
    ctx = types.SimpleNamespace(is_padding=ref.runner_padding_buffer(5))
    monkeypatch.setenv("VLLM_MOE_SKIP_PADDING", "1")
    monkeypatch.setattr(base_router, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(base_router, "get_forward_context", lambda: ctx)
    assert torch.equal(router.get_moe_padding_mask(8), mask)
    before = len(fake.launches)
    w, ids = ref.call_fused_topk_bias(
        router, torch.zeros(8, 64, dtype=torch.bfloat16), logits, case.bias
    )
    assert len(fake.launches) == before + 1 and fake.launches[-1]["HAS_PADDING"]
    assert ids.dtype == torch.int32 and ref.padding_problems(w, ids, mask) == []
