"""vLLM's DeepSeek-V4 MoE router at a real expert count (256 and 384 routed experts) on CUDA, with
padded decode batches and CUDA graphs (issue 26, part 4).

The tiny DSV4 target has 4 experts, so vLLM's Triton ``dsv4_topk`` fast path never runs in the
engine tests. Here the router inputs are built the way vLLM's DSV4 MoE layer builds them (float32
logits from its ``GateLinear``, a float32 ``e_score_correction_bias``, top-6, renormalize,
``routed_scaling_factor`` 1.5, int32 ids by default, int64 for MegaMoE) and sent through:

* ``can_use_dsv4_topk``: the gate of the fast path holds for these inputs (and not for bf16 logits,
  255 experts, uint32 ids, top-8, no renormalize: controls of the gate);
* ``dsv4_topk`` on R real rows and on the same rows padded to a CUDA-graph size P > R with garbage
  rows (NaN, +-inf, +-1e30, zeros, random) and the padding mask: the first R rows' ids and weights
  are bitwise those of the unpadded run, padding rows come out as id -1 / weight 0, and the real
  rows match the pure-torch reference (tests/support/dsv4_router_ref.py);
* ``fused_topk_bias`` (the router entry of the DSV4 layer) with the padding mask the GPU model
  runner would publish: it must reach ``dsv4_topk`` and give the same rows;
* a captured ``torch.cuda.CUDAGraph`` of ``dsv4_topk`` over P rows, replayed with different real
  batch sizes and padding contents: bitwise the eager unpadded rows.

Controls (the comparisons can fail): a perturbed real row changes that row's routing and only that
row's; without the mask the padding rows are routed (ids not -1); references that drop the bias or
score with a sigmoid disagree with the kernel.

A missing vLLM function here is a FAILURE (the kit's vLLM 0.34.0 must have it), not a skip.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]

EXPERTS = (256, 384)
ID_DTYPES = ("int32", "int64")


def _cuda_or_skip():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch: the DSV4 router kernel test needs one")
    return torch


def _vllm_router():
    """vLLM's DSV4 top-k module and router entry; FAIL (not skip) when the kit lacks them."""
    try:
        from vllm.model_executor.layers.fused_moe.router import dsv4_topk as topk_mod
        from vllm.model_executor.layers.fused_moe.router import fused_topk_bias_router as router
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"vLLM's DSV4 router modules are not importable in this kit: {e!r}")
    for mod, names in (
        (topk_mod, ("can_use_dsv4_topk", "dsv4_topk", "_dsv4_topk_kernel")),
        (router, ("fused_topk_bias", "get_moe_padding_mask", "dsv4_topk")),
    ):
        missing = [n for n in names if not hasattr(mod, n)]
        if missing:
            from vllm.platforms import current_platform

            pytest.fail(
                f"{mod.__name__} lacks {missing}: not vLLM 0.34.0's DSV4 router, or vLLM's "
                f"platform is not CUDA here ({type(current_platform).__name__}; the Triton kernel "
                "is only defined on CUDA)"
            )
    return topk_mod, router


def _run(topk_mod, logits, bias, id_dtype, mask):
    """vLLM's dsv4_topk as fused_topk_bias calls it (routed_scaling_factor = SCALE)."""
    import torch
    from support.dsv4_router_ref import SCALE

    return topk_mod.dsv4_topk(logits, bias, getattr(torch, id_dtype), SCALE, is_padding=mask)


def _no_padding(num_rows: int):
    """The runner's mask for a batch with no padding rows."""
    import torch

    return torch.zeros(num_rows, dtype=torch.bool, device="cuda")


@pytest.mark.parametrize("num_experts", EXPERTS)
def test_fast_path_gate_holds_for_dsv4_inputs(num_experts):
    torch = _cuda_or_skip()
    from support import dsv4_router_ref as ref

    topk_mod, _ = _vllm_router()
    case = ref.make_case(num_experts, 8, seed=num_experts, device="cuda")
    can = topk_mod.can_use_dsv4_topk
    for dt in (torch.int32, torch.int64):
        assert can(case.logits, case.bias, ref.TOPK, True, dt), (
            f"dsv4_topk's gate refuses float32 [8, {num_experts}] logits with {dt} ids: the test "
            "would not exercise the fast path"
        )
    # controls: the gate is not always true
    refused = {
        "bf16 logits": can(case.logits.bfloat16(), case.bias, ref.TOPK, True, torch.int32),
        "255 experts": can(
            case.logits[:, :255].contiguous(), case.bias[:255].contiguous(), 6, True, torch.int32
        ),
        "uint32 ids": can(case.logits, case.bias, ref.TOPK, True, torch.uint32),
        "top-8": can(case.logits, case.bias, 8, True, torch.int32),
        "no renormalize": can(case.logits, case.bias, ref.TOPK, False, torch.int32),
        "no bias": can(case.logits, None, ref.TOPK, True, torch.int32),
    }
    wrong = [k for k, v in refused.items() if v]
    assert not wrong, f"can_use_dsv4_topk accepted {wrong}"


@pytest.mark.parametrize("id_dtype", ID_DTYPES)
@pytest.mark.parametrize("num_experts", EXPERTS)
def test_padded_rows_do_not_change_real_rows(num_experts, id_dtype):
    torch = _cuda_or_skip()
    from support import dsv4_router_ref as ref

    topk_mod, _ = _vllm_router()
    problems = []
    for r, p in ref.BATCHES:
        case = ref.make_case(num_experts, r, seed=100 * r + num_experts, device="cuda")
        # The unpadded batch as the runner routes it: an all-False mask (same kernel variant as
        # the padded run, so bitwise is the right bar) ...
        w_u, ids_u = _run(topk_mod, case.logits, case.bias, id_dtype, _no_padding(r))
        # ... and without any mask (VLLM_MOE_SKIP_PADDING=0): another compiled variant, compared
        # with ids exact and weights within 1e-6
        w_m, ids_m = _run(topk_mod, case.logits, case.bias, id_dtype, None)
        torch.cuda.synchronize()
        assert ids_u.dtype == getattr(torch, id_dtype) and w_u.dtype == torch.float32
        assert tuple(ids_u.shape) == (r, ref.TOPK), ids_u.shape
        tag = f"E={num_experts} {id_dtype} R={r} P={p}"
        problems += [
            f"{tag} unpadded: {m}"
            for m in ref.reference_problems(w_u, ids_u, case.logits, case.bias)
        ]
        if not torch.equal(ids_u.long(), ids_m.long()) or not torch.allclose(
            w_u, w_m, rtol=1e-6, atol=0
        ):
            problems.append(f"{tag}: no mask vs an all-False mask: ids or weights differ")
        for kind in ref.GARBAGE:
            logits, mask = ref.padded(case, p, kind)
            w_p, ids_p = _run(topk_mod, logits, case.bias, id_dtype, mask)
            torch.cuda.synchronize()
            bad = ref.rows_differ(w_u, ids_u, w_p[:r], ids_p[:r])
            if bad:
                problems.append(f"{tag} {kind} padding changed real rows {bad}")
            problems += [f"{tag} {kind}: {m}" for m in ref.padding_problems(w_p, ids_p, mask)]
    assert not problems, "\n".join(problems[:30])


def test_controls_the_comparisons_can_fail():
    torch = _cuda_or_skip()
    from support import dsv4_router_ref as ref

    topk_mod, _ = _vllm_router()
    r, p = 7, 8
    case = ref.make_case(256, r, seed=7, device="cuda")
    w_u, ids_u = _run(topk_mod, case.logits, case.bias, "int32", _no_padding(r))
    # 1. a perturbed real row (padded batch) changes that row's routing and only that row's
    pert = ref.Case(ref.perturb_row(case, 3), case.bias, 256, case.seed)
    logits, mask = ref.padded(pert, p, "nan")
    w_p, ids_p = _run(topk_mod, logits, case.bias, "int32", mask)
    torch.cuda.synchronize()
    assert ref.rows_differ(w_u, ids_u, w_p[:r], ids_p[:r]) == [3], (
        "control: perturbing real row 3 should change row 3 (and only it); got "
        f"{ref.rows_differ(w_u, ids_u, w_p[:r], ids_p[:r])}"
    )
    # 2. without the mask the garbage rows are routed: the padding check must flag them
    logits, mask = ref.padded(case, p, "random")
    w_n, ids_n = _run(topk_mod, logits, case.bias, "int32", None)
    torch.cuda.synchronize()
    assert ref.padding_problems(w_n, ids_n, mask), (
        "control: without is_padding the padding rows still came out as -1/0"
    )
    # 3. wrong references disagree with the kernel
    assert ref.reference_problems(w_u, ids_u, case.logits, case.bias, use_bias=False), (
        "control: a reference without the correction bias agreed with dsv4_topk"
    )
    assert ref.reference_problems(w_u, ids_u, case.logits, case.bias, scoring="sigmoid"), (
        "control: a sigmoid-scoring reference agreed with dsv4_topk"
    )
    assert ref.reference_problems(w_u, ids_u, case.logits, case.bias, scale=1.0), (
        "control: a reference without routed_scaling_factor agreed with dsv4_topk"
    )


@pytest.mark.parametrize("num_experts", EXPERTS)
def test_router_entry_takes_dsv4_topk_with_the_runner_mask(num_experts, monkeypatch):
    """``fused_topk_bias`` as the DSV4 layer calls it, inside a forward context that carries the
    runner's padding buffer (rows past num_tokens True): vLLM's own get_moe_padding_mask slices
    it, and the call must go through dsv4_topk with that mask."""
    import types

    torch = _cuda_or_skip()
    from support import dsv4_router_ref as ref

    topk_mod, router = _vllm_router()
    from vllm.model_executor.layers.fused_moe.router import base_router

    r, p = 5, 8
    case = ref.make_case(num_experts, r, seed=55 + num_experts, device="cuda")
    logits, mask = ref.padded(case, p, "huge")
    ctx = types.SimpleNamespace(is_padding=ref.runner_padding_buffer(r, device="cuda"))
    monkeypatch.setenv("VLLM_MOE_SKIP_PADDING", "1")
    monkeypatch.setattr(base_router, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(base_router, "get_forward_context", lambda: ctx)
    got = router.get_moe_padding_mask(p)
    assert got is not None and torch.equal(got, mask), f"get_moe_padding_mask gave {got}"
    calls = []
    real_topk = router.dsv4_topk

    def spy(*a, **kw):
        calls.append(kw.get("is_padding"))
        return real_topk(*a, **kw)

    monkeypatch.setattr(router, "dsv4_topk", spy)
    hidden = torch.zeros(p, 64, dtype=torch.bfloat16, device="cuda")
    w, ids = ref.call_fused_topk_bias(router, hidden, logits, case.bias)
    torch.cuda.synchronize()
    assert len(calls) == 1, f"fused_topk_bias did not take dsv4_topk ({len(calls)} calls)"
    assert calls[0] is not None and torch.equal(calls[0], mask), "the padding mask was not passed"
    assert ids.dtype == torch.int32, f"default DSV4 ids should be int32, got {ids.dtype}"
    w_u, ids_u = _run(topk_mod, case.logits, case.bias, "int32", _no_padding(r))
    torch.cuda.synchronize()
    assert ref.rows_differ(w_u, ids_u, w[:r], ids[:r]) == []
    assert ref.padding_problems(w, ids, mask) == []


@pytest.mark.parametrize("num_experts", EXPERTS)
def test_cuda_graph_replay_with_different_padding(num_experts):
    torch = _cuda_or_skip()
    from support import dsv4_router_ref as ref

    topk_mod, _ = _vllm_router()
    p = 16
    logits_buf = torch.zeros(p, num_experts, dtype=torch.float32, device="cuda")
    mask_buf = torch.ones(p, dtype=torch.bool, device="cuda")
    bias = ref.make_case(num_experts, 1, seed=num_experts).bias.to("cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (Triton compile) outside the capture
        for _ in range(2):
            _run(topk_mod, logits_buf, bias, "int32", mask_buf)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w_out, ids_out = _run(topk_mod, logits_buf, bias, "int32", mask_buf)
    problems = []
    for r in (1, 5, 9, 16):
        case = ref.make_case(num_experts, r, seed=900 + r)
        case = ref.Case(case.logits.cuda(), bias, num_experts, case.seed)
        w_u, ids_u = _run(topk_mod, case.logits, bias, "int32", _no_padding(r))
        for kind in ref.GARBAGE:
            logits, mask = ref.padded(case, p, kind)
            logits_buf.copy_(logits)
            mask_buf.copy_(mask)
            graph.replay()
            torch.cuda.synchronize()
            bad = ref.rows_differ(w_u, ids_u, w_out[:r], ids_out[:r])
            if bad:
                problems.append(f"E={num_experts} R={r} {kind}: graph replay changed rows {bad}")
            problems += [
                f"E={num_experts} R={r} {kind}: {m}"
                for m in ref.padding_problems(w_out, ids_out, mask)
            ]
    # control: the replay reads the live buffers (a perturbed row comes out changed)
    r = 5
    case = ref.make_case(num_experts, r, seed=905)
    case = ref.Case(case.logits.cuda(), bias, num_experts, case.seed)
    w_u, ids_u = _run(topk_mod, case.logits, bias, "int32", _no_padding(r))
    logits, mask = ref.padded(
        ref.Case(ref.perturb_row(case, 2), bias, num_experts, 905), p, "zeros"
    )
    logits_buf.copy_(logits)
    mask_buf.copy_(mask)
    graph.replay()
    torch.cuda.synchronize()
    changed = ref.rows_differ(w_u, ids_u, w_out[:5], ids_out[:5])
    assert changed == [2], f"control: graph replay with row 2 perturbed changed rows {changed}"
    assert not problems, "\n".join(problems[:30])
