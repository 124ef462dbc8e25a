"""Every Triton kernel the project owns (vllm_dspark_pp/kernels/), on CUDA, against its reference.

Contract for a kernel module ``vllm_dspark_pp/kernels/<name>.py`` (names starting with ``_`` are
helpers and skipped); see tools/gpu/README.md:

* ``make_inputs(seed: int, device: str) -> dict`` fresh random inputs, padding rows poisoned
  (e.g. NaN / huge values in rows the kernel must mask);
* ``run(**inputs)`` launches the Triton kernel; returns a tensor, or a tuple/list/dict of them;
* ``reference(**inputs)`` pure torch, float64 for floating point, same structure as ``run``;
* optional ``TOLERANCE = {"atol": ..., "rtol": ...}`` (default 1e-3 / 1e-3 for floating outputs;
  integer and boolean outputs must be equal) and ``SEEDS`` (default ``(0, 1, 2)``).

A module that defines a Triton kernel but not this contract FAILS (an untested kernel is a bug);
so does an ``@triton.jit`` anywhere else in the package. No kernel modules: skipped, saying so.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest
from gpu_common import require_cuda

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

PKG_DIR = Path(__file__).resolve().parents[2] / "vllm_dspark_pp"
JIT = re.compile(r"@\s*triton\.jit|@\s*tl\.jit|triton\.jit\(")


def kernel_modules() -> list[str]:
    kdir = PKG_DIR / "kernels"
    if not (kdir / "__init__.py").exists():
        return []
    return sorted(m.name for m in pkgutil.iter_modules([str(kdir)]) if not m.name.startswith("_"))


def test_no_triton_kernel_lives_outside_kernels_package():
    stray = [
        str(p.relative_to(PKG_DIR.parent))
        for p in PKG_DIR.rglob("*.py")
        if "kernels" not in p.relative_to(PKG_DIR).parts and JIT.search(p.read_text(errors="replace"))
    ]
    assert not stray, f"Triton kernels outside vllm_dspark_pp/kernels/ (no reference test reaches them): {stray}"


def _flatten(x, prefix="out"):
    import torch

    if isinstance(x, torch.Tensor):
        return {prefix: x}
    if isinstance(x, dict):
        out = {}
        for k in sorted(x):
            out.update(_flatten(x[k], f"{prefix}.{k}"))
        return out
    if isinstance(x, list | tuple):
        out = {}
        for i, v in enumerate(x):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out
    raise TypeError(f"{prefix}: expected tensors (or tuple/list/dict of them), got {type(x).__name__}")


def compare_outputs(got, want, atol: float, rtol: float) -> list[str]:
    import torch

    g, w = _flatten(got), _flatten(want)
    if set(g) != set(w):
        return [f"output structure differs: kernel {sorted(g)} vs reference {sorted(w)}"]
    problems = []
    for k in g:
        a, b = g[k].detach().cpu(), w[k].detach().cpu()
        if a.shape != b.shape:
            problems.append(f"{k}: shape {tuple(a.shape)} vs reference {tuple(b.shape)}")
        elif a.is_floating_point() or b.is_floating_point():
            a64, b64 = a.double(), b.double()
            if not torch.allclose(a64, b64, atol=atol, rtol=rtol, equal_nan=False):
                err = (a64 - b64).abs()
                err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
                i = int(err.flatten().argmax())
                problems.append(
                    f"{k}: max |err| {err.max().item():.3e} at flat index {i} "
                    f"(kernel {a64.flatten()[i].item()}, reference {b64.flatten()[i].item()}), atol {atol} rtol {rtol}"
                )
        elif not torch.equal(a, b):
            n = int((a != b).sum())
            problems.append(f"{k}: {n} integer/boolean elements differ")
    return problems


@pytest.mark.parametrize("name", kernel_modules() or ["<none>"])
def test_kernel_matches_its_reference_on_gpu(name):
    if name == "<none>":
        pytest.skip("no project Triton kernels at this commit (vllm_dspark_pp/kernels/ absent or empty)")
    require_cuda()
    mod = importlib.import_module(f"vllm_dspark_pp.kernels.{name}")
    missing = [f for f in ("make_inputs", "run", "reference") if not callable(getattr(mod, f, None))]
    assert not missing, (
        f"vllm_dspark_pp.kernels.{name} lacks {missing}: every kernel module needs make_inputs(seed, "
        "device), run(**inputs) and reference(**inputs) (see tests/gpu/test_gpu_20_project_kernels.py)"
    )
    tol = {"atol": 1e-3, "rtol": 1e-3, **getattr(mod, "TOLERANCE", {})}
    problems = []
    for seed in getattr(mod, "SEEDS", (0, 1, 2)):
        inputs = mod.make_inputs(seed, "cuda")
        # the reference sees the inputs as they were, even if the kernel writes in place
        ref_inputs = {k: v.clone() if hasattr(v, "clone") else v for k, v in inputs.items()}
        got = mod.run(**inputs)
        want = mod.reference(**ref_inputs)
        problems += [f"seed {seed}: {p}" for p in compare_outputs(got, want, **tol)]
    assert not problems, "\n".join(problems)
