"""CPU stand-ins for vLLM custom ops whose CPU kernels lack a feature the CUDA kernels have."""

from __future__ import annotations

import torch


def grouped_rms_norm(x: torch.Tensor, weights: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` [G, ...] with one weight row per group: ``weights`` [G, hidden].

    The CUDA ``_C.rms_norm`` picks the weight row by the outermost index of a 3-D+ input; the CPU
    kernel of vLLM 0.34.0 reads only the first ``hidden`` weights, i.e. row 0 for every group.
    This calls the same op once per group, so each group gets its own row and the per-group
    numerics stay those of vLLM's CPU kernel.
    """
    from vllm import _custom_ops as ops

    assert weights.dim() == 2 and weights.shape[0] == x.shape[0], (weights.shape, x.shape)
    out = torch.empty_like(x)
    for g in range(x.shape[0]):
        ops.rms_norm(out[g], x[g].contiguous(), weights[g].contiguous(), eps)
    return out
