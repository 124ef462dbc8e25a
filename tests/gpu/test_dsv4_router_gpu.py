"""vLLM's DeepSeek-V4 MoE *layer* at 256 routed experts on CUDA, with padded decode batches, eager
and under CUDA graphs (issue 26, part 4; group ``dsv4_router`` of tools/gpu/run_groups.sh).

tests/gpu/test_dsv4_router_256.py drives the router function (``dsv4_topk``) alone. Here the whole
layer runs: ``vllm.models.deepseek_v4.nvidia.model.DeepseekV4MoE`` built by vLLM's own model code
(tests/support/dsv4_moe_layer.py: the tiny DeepSeek-V4 GPU target's config, hidden 256, with 256
routed experts, top-6, ``sqrtsoftplus`` + ``noaux_tc`` bias, one shared expert, bf16, seeded
weights, the modular Triton experts), no engine: a full DeepSeek-V4 engine is not needed to build
one MoE layer, and without one the test controls the padding mask and the batch sizes exactly.
The layer is called as the model calls it, inside vLLM's forward context carrying the GPU model
runner's ``is_padding`` mask, so the route is vLLM's: ``FusedTopKBiasRouter`` ->
``fused_topk_bias`` -> ``get_moe_padding_mask`` -> the Triton ``dsv4_topk`` kernel -> the fused
experts. ``dsv4_topk`` is wrapped where ``fused_topk_bias`` looks it up, so every forward must
show exactly one call, on all its rows (256 experts), with the runner's mask.

Real decode batches of 1, 3, 7 and 33 tokens are padded to sizes of vLLM's default capture list
(1, 2, 4, 8, 16, 24, 32, 40, ...: config/vllm.py): 2, 4, 8 and 40 (1 also runs unpadded at size 1),
with stale, zero or huge padding rows (huge rows would win every expert):

* eager: the real rows' top-k ids equal the unpadded batch's exactly, weights within 1e-4 and the
  bf16 outputs within 2e-2 (bitwise is not promised across batch sizes: GEMM tiling may change
  with M; which rows were not bitwise is printed), padding rows come out as id -1 / weight 0, and
  at one padded size the real rows are **bitwise** the same whatever the padding rows hold;
* CUDA graphs: one ``torch.cuda.CUDAGraph`` of the layer per padded size over static hidden and
  mask buffers, replayed for each batch and padding content: the same rule against the unpadded
  eager batch, padding rows -1 / 0, and bitwise the same real rows whatever the padding holds;
  the rows not bitwise equal to the eager run at the same size are printed (recorded, not
  asserted: cuBLAS may pick another algorithm inside a capture).

Controls, run in the same child (the comparisons can fail): a wrong mask that also marks the last
real row as padding is flagged on that row and only it; without a mask the huge padding rows are
routed and the padding-row check flags them; a perturbed real row is flagged alone; with the
fast-path gate refused the call count shows 0 ``dsv4_topk`` calls; a perturbed real row in a
graph's input buffer is flagged alone after a replay.

The layer work runs in a child process (one distributed world per process, a hard deadline); a
child that crashes or overruns fails the test with its log. Without CUDA everything here is
skipped with the reason; tests/unit/support/test_dsv4_moe_layer_cpu.py checks the comparisons
and controls on CPU tensors, and its opt-in hand run drives the same layer through vLLM's CPU MoE
path.
"""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

CHILD_TIMEOUT_S = 240


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if not _cuda_available():
        pytest.skip("no CUDA device visible to torch: the DSV4 MoE layer test needs one")
    from support import dsv4_moe_layer

    rep = dsv4_moe_layer.run_child("cuda", tmp_path_factory.mktemp("dsv4-moe"), CHILD_TIMEOUT_S)
    if "error" in rep or not rep.get("done"):
        pytest.fail(f"the DSV4 MoE layer child failed:\n{rep.get('error')}\n{rep['log_tail']}")
    summary = {k: rep[k] for k in ("facts", "controls")}
    print("DSV4 ROUTER LAYER REPORT " + json.dumps(summary, default=str)[:6000])
    return rep


def _no_problems(rep, name):
    problems = rep["checks"][name]
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems[:30])


def test_layer_routes_through_dsv4_topk_with_the_runner_mask(report):
    assert report["facts"]["router"] == "FusedTopKBiasRouter", report["facts"]
    _no_problems(report, "fast_path")


def test_padding_rows_leave_real_rows_unchanged_eager(report):
    _no_problems(report, "eager_vs_unpadded")
    _no_problems(report, "eager_padding_content")


def test_padding_rows_leave_real_rows_unchanged_under_cuda_graphs(report):
    assert report["facts"]["graph_sizes"] == [1, 2, 4, 8, 40]
    _no_problems(report, "graph")
    # control: a perturbed real row in the graph's input buffer is flagged, alone
    assert report["facts"]["graph_control_perturbed_rows"] == [2], report["facts"]


def test_controls_the_comparisons_can_fail(report):
    c = report["controls"]
    assert c["wrong_mask_rows"] == [6] and c["wrong_mask_problems"], (
        f"control: a mask marking real row 6 as padding should be flagged on row 6 only: {c}"
    )
    assert c["no_mask_calls"] == 1 and c["no_mask_padding_problems"], (
        f"control: without a mask the huge padding rows should be routed and flagged: {c}"
    )
    assert c["perturbed_rows"] == [2], f"control: a perturbed row 2 should be flagged alone: {c}"
    assert any("0 dsv4_topk calls" in m for m in c["gate_off_call_problems"]), (
        f"control: with the fast-path gate refused the call count should show 0 calls: {c}"
    )
