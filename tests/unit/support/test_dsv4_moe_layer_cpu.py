"""The CPU side of the DSV4 MoE layer test at 256 routed experts (issue 26, part 4;
tests/gpu/test_dsv4_router_gpu.py runs the layer on CUDA).

Why the fast path itself cannot run here: vLLM defines the Triton ``_dsv4_topk_kernel`` only when
its platform is CUDA, ``can_use_dsv4_topk`` requires ``current_platform.is_cuda()``, and on the CPU
platform vLLM's router factory gives every MoE layer its ``CPURouter`` (which never reads the
runner's padding mask) and the CPU experts (whose kernel takes no -1 ids). The router's pure-torch
reference and the ``dsv4_topk`` wrapper are checked on CPU in
tests/unit/support/test_dsv4_router_ref.py.

In CI (milliseconds, CPU tensors, no vLLM layer): the checks the GPU child applies
(tests/support/dsv4_moe_layer.py) on hand-made results, each shown to flag what it must (one
dsv4_topk call with the runner's mask; padding rows -1 / 0; ids exact, bitwise or tolerance rule
on the real rows, the flagged rows exactly the changed ones) and to pass the unchanged case;
and a dry run of the child's whole check sequence (``checks_on``: eager batches, one graph per
padded size replayed per batch and padding content, the controls) on a row-wise stand-in layer
with ``torch.cuda``'s streams and graphs faked: it passes the stand-in, and flags a stand-in whose
padding rows leak into the real rows or are routed (about 2 s after vLLM's import); the GPU
test's own assertions are run on that report (through JSON, as the child writes it), and each of
its controls, blanked, fails them.

Hand run (``DSPARK_DSV4_LAYER_CPU=1``, about 10 s on an idle machine, needs vLLM's CPU kernel
library): the GPU test's child on vLLM's CPU platform: vLLM's DeepseekV4MoE built at 256 experts,
padded batches of 1/3/7/33 real rows, the real rows bitwise equal to the unpadded batch, the
perturbed-row control flagged alone, and the facts that this route is ``CPURouter`` with no
``dsv4_topk`` call and that the wrong-mask control changes nothing on the CPU.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import pytest
import torch
from support import dsv4_moe_layer as L

R, P = 7, 8


def _run(rows: int, seed: int = 0, *, mask=None, routed_padding: bool = False) -> dict:
    """A hand-made layer result: bf16 outputs and one dsv4_topk call over ``rows`` rows."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(rows, 16, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(256, generator=g)[:6] for _ in range(rows)]).int()
    w = torch.rand(rows, 6, generator=g)
    if mask is not None and not routed_padding:
        ids[mask] = -1
        w[mask] = 0.0
    call = {"rows": rows, "experts": 256, "mask": mask, "ids": ids, "weights": w}
    return {"out": out, "calls": [call]}


def _padded_copy(ref: dict, rows: int, mask) -> dict:
    """``ref``'s real rows followed by padding rows, routed as -1 / 0."""
    got = _run(rows, seed=99, mask=mask)
    n = ref["out"].shape[0]
    got["out"][:n] = ref["out"]
    got["calls"][0]["ids"][:n] = ref["calls"][0]["ids"]
    got["calls"][0]["weights"][:n] = ref["calls"][0]["weights"]
    return got


def test_call_check_wants_one_fast_path_call_with_the_runner_mask():
    mask = L.padding_mask(R, P, "cpu")
    ok = _run(P, mask=mask)
    assert L.call_problems("ok", ok, P, mask) == []
    assert "0 dsv4_topk calls" in L.call_problems("x", {"calls": []}, P, mask)[0]
    assert "2 dsv4_topk calls" in L.call_problems("x", {"calls": ok["calls"] * 2}, P, mask)[0]
    assert L.call_problems("x", ok, R, mask), "a call over the wrong row count passed"
    assert L.call_problems("x", ok, P, L.padding_mask(R - 1, P, "cpu")), "another mask passed"
    assert L.call_problems("x", ok, P, None), "a call with a mask passed for an unmasked run"


def test_padding_row_check_flags_routed_padding_rows():
    mask = L.padding_mask(R, P, "cpu")
    assert L.padding_row_problems("ok", _run(P, mask=mask), mask) == []
    bad = L.padding_row_problems("x", _run(P, mask=mask, routed_padding=True), mask)
    assert bad and "[7]" in bad[0], bad


def test_compare_flags_exactly_the_changed_rows():
    mask = L.padding_mask(R, P, "cpu")
    ref = _run(R)
    same = _padded_copy(ref, P, mask)
    for bitwise in (True, False):
        c = L.compare("same", ref, same, R, bitwise=bitwise)
        assert (c.problems, c.flagged, c.not_bitwise) == ([], [], [])
    # one ulp on row 1's output: a difference under the bitwise rule, within the tolerance
    ulp = _padded_copy(ref, P, mask)
    ulp["out"][1] = (ulp["out"][1].view(torch.int16) + 1).view(torch.bfloat16)
    assert L.compare("ulp", ref, ulp, R, bitwise=True).flagged == [1]
    c = L.compare("ulp", ref, ulp, R, bitwise=False)
    assert (c.flagged, c.not_bitwise) == ([], [1])
    # the wrong-mask control on CUDA: real row 6 routed as padding (ids -1, weights 0, output
    # without its routed experts)
    wrong = _padded_copy(ref, P, mask)
    wrong["calls"][0]["ids"][6] = -1
    wrong["calls"][0]["weights"][6] = 0.0
    wrong["out"][6] = wrong["out"][6] * 0.3
    c = L.compare("wrong mask", ref, wrong, R, bitwise=False)
    assert c.flagged == [6] and c.problems, c
    # a perturbed row's output alone (no routing recorded, as on the CPU route)
    pert = {"out": same["out"].clone(), "calls": []}
    pert["out"][2] += 0.5
    assert L.compare("perturbed", ref, pert, R, bitwise=False).flagged == [2]
    # another expert id alone (weights and outputs equal): ids are compared exactly
    ids = _padded_copy(ref, P, mask)
    ids["calls"][0]["ids"][5, 3] = (ids["calls"][0]["ids"][5, 3] + 1) % 256
    c = L.compare("ids", ref, ids, R, bitwise=False)
    assert c.flagged == [5] and "ids differ" in c.problems[0], c
    # a weight off by more than the float32 tolerance
    w = _padded_copy(ref, P, mask)
    w["calls"][0]["weights"][4, 0] *= 1.001
    assert L.compare("weights", ref, w, R, bitwise=False).flagged == [4]


def test_padded_inputs_keep_the_real_rows():
    real = torch.randn(3, 8).bfloat16()
    for kind in L.KINDS:
        x = L.padded_hidden(real, 4, kind, seed=3)
        assert x.shape == (4, 8) and x.dtype == torch.bfloat16
        assert torch.equal(x[:3], real)
    assert L.padding_mask(3, 4, "cpu").tolist() == [False, False, False, True]
    with pytest.raises(ValueError):
        L.padded_hidden(real, 4, "nan")


class _FakeLayer:
    """A row-wise stand-in for the MoE layer with a dsv4_topk-like routing: top-6 of a second
    projection; rows the mask marks get id -1 / weight 0 and no routed part. ``leak``: every
    row's output also gets the batch mean of the inputs (padding rows leak into real rows);
    ``ignore_mask``: padding rows are routed like real ones."""

    def __init__(self, leak: bool = False, ignore_mask: bool = False, hsz: int = 32):
        g = torch.Generator().manual_seed(0)
        self.w = torch.randn(hsz, 16, generator=g) / hsz**0.5
        self.g = torch.randn(hsz, 256, generator=g) / hsz**0.5
        self.leak, self.ignore_mask = leak, ignore_mask
        self.spy = None

    def compute(self, hidden, mask):
        x = hidden.float()
        w, ids = torch.topk(torch.softmax(x @ self.g, -1), 6)
        ids = ids.int()
        routed = (x @ self.w) * w.sum(-1, keepdim=True)
        if mask is not None and not self.ignore_mask:
            ids[mask], w[mask], routed[mask] = -1, 0.0, 0.0
        out = routed + x[:, :16]
        if self.leak:
            out = out + x.mean(0)[:16]
        return out.bfloat16(), ids, w


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: the forwards run while capturing are re-run by
    replay() on the live buffers, writing into the tensors they first returned."""

    capturing = None

    def __init__(self):
        self.steps = []

    def replay(self):
        for step in self.steps:
            step()


@contextmanager
def _capture(graph):
    _FakeGraph.capturing = graph
    try:
        yield
    finally:
        _FakeGraph.capturing = None


def _fake_forward(layer, cfg, hidden, mask):
    out, ids, w = layer.compute(hidden, mask)
    call = {"rows": hidden.shape[0], "experts": 256, "ids": ids, "weights": w}
    layer.spy.calls.append(dict(call, mask=None if mask is None else mask.clone()))
    if _FakeGraph.capturing is not None:

        def step():
            o, i, ww = layer.compute(hidden, mask)
            out.copy_(o), ids.copy_(i), w.copy_(ww)

        _FakeGraph.capturing.steps.append(step)
    return out


def _dry_run(monkeypatch, layer) -> dict:
    """The GPU child's checks (eager, CUDA graphs, controls) on the stand-in layer, with
    torch.cuda's streams and graphs replaced by the fakes above."""
    # vLLM's router module (the spy's and the gate control's target) is imported first: its
    # imports read torch.cuda.Stream
    from vllm.model_executor.layers.fused_moe.router import fused_topk_bias_router  # noqa: F401

    monkeypatch.setattr(L, "forward", _fake_forward)
    stream = SimpleNamespace(wait_stream=lambda s: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", _capture)
    run = L._Runner(layer, None, torch.device("cpu"))
    layer.spy = run.spy
    real_all = torch.randn(33, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    return L.checks_on(run, real_all, graphs=True)


def test_dry_run_of_the_gpu_checks_passes_a_row_wise_layer(monkeypatch):
    rep = _dry_run(monkeypatch, _FakeLayer())
    assert rep["done"] and all(v == [] for v in rep["checks"].values()), rep["checks"]
    facts, c = rep["facts"], rep["controls"]
    assert facts["graph_sizes"] == [1, 2, 4, 8, 40]
    assert facts["graph_control_perturbed_rows"] == [2]
    assert c["wrong_mask_rows"] == [6] and c["wrong_mask_problems"], c
    assert c["no_mask_calls"] == 1 and c["no_mask_padding_problems"], c
    assert c["perturbed_rows"] == [2], c
    # the stand-in does not consult vLLM's fast-path gate (on CUDA this control shows 0 calls)
    assert c["gate_off_call_problems"] == [], c


def test_dry_run_flags_a_layer_whose_padding_leaks_or_is_routed(monkeypatch):
    leak = _dry_run(monkeypatch, _FakeLayer(leak=True))["checks"]
    for name in ("eager_vs_unpadded", "eager_padding_content", "graph"):
        assert leak[name], f"a layer leaking padding rows into real rows passed {name}"
    routed = _dry_run(monkeypatch, _FakeLayer(ignore_mask=True))["checks"]
    assert routed["eager_padding_content"] and routed["graph"], routed
    assert "were routed" in routed["eager_padding_content"][0]


def test_gpu_test_accepts_the_dry_run_report_and_its_controls_bite(monkeypatch):
    """The GPU test's assertions on a report of the child's shape (the dry run's, through JSON as
    the child writes it, with the CUDA-only facts filled in as a CUDA run gives them)."""
    import json

    from support.scripts import load_script

    gpu_test = load_script("tests/gpu/test_dsv4_router_gpu.py")
    rep = _dry_run(monkeypatch, _FakeLayer())
    rep["facts"]["router"] = "FusedTopKBiasRouter"
    rep["controls"]["gate_off_call_problems"] = ["control gate off: 0 dsv4_topk calls (...)"]
    rep = json.loads(json.dumps(rep))
    tests = [getattr(gpu_test, n) for n in dir(gpu_test) if n.startswith("test_")]
    assert len(tests) == 4
    for test in tests:
        test(rep)
    # each control, disabled, fails the control test
    for key, blank in (
        ("wrong_mask_rows", []),
        ("no_mask_padding_problems", []),
        ("perturbed_rows", []),
        ("gate_off_call_problems", []),
    ):
        bad = json.loads(json.dumps(rep))
        bad["controls"][key] = blank
        with pytest.raises(AssertionError):
            gpu_test.test_controls_the_comparisons_can_fail(bad)
    bad = json.loads(json.dumps(rep))
    bad["facts"]["graph_control_perturbed_rows"] = []
    with pytest.raises(AssertionError):
        gpu_test.test_padding_rows_leave_real_rows_unchanged_under_cuda_graphs(bad)


@pytest.mark.skipif(
    os.environ.get("DSPARK_DSV4_LAYER_CPU") != "1",
    reason="hand run (about 10 s, vLLM's CPU kernel library): DSPARK_DSV4_LAYER_CPU=1; "
    "the DSV4 MoE layer at 256 experts through vLLM's CPU MoE path",
)
def test_dsv4_moe_layer_on_the_cpu_platform(tmp_path):
    rep = L.run_child("cpu", tmp_path, 240)
    assert "error" not in rep and rep.get("done"), rep.get("error") or rep["log_tail"]
    checks, controls, facts = rep["checks"], rep["controls"], rep["facts"]
    # the CPU route: vLLM's CPURouter, never dsv4_topk (so the count check reports every call)
    assert facts["router"] == "CPURouter", facts
    assert all("0 dsv4_topk calls" in m for m in checks["fast_path"]), checks["fast_path"]
    assert len(checks["fast_path"]) == 4 + 3 * 4  # 4 unpadded + 4 padded sizes x 3 contents
    assert checks["eager_vs_unpadded"] == [] and checks["eager_padding_content"] == []
    assert facts["eager_rows_not_bitwise_vs_unpadded"] == []  # bitwise on the CPU
    assert checks["graph"] == [] and "graph_sizes" not in facts  # no CUDA graphs here
    assert controls["perturbed_rows"] == [2], controls
    # the CPU router ignores the runner's mask: the wrong mask changes nothing here
    assert controls["wrong_mask_rows"] == [] and controls["no_mask_calls"] == 0, controls
