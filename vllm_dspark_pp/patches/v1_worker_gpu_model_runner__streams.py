"""Under PP, a worker's steps stay on one CUDA stream: the one the model runner is built on.

WHAT: ``GPUModelRunner.__init__`` (vllm/v1/worker/gpu/model_runner.py:207), when pipeline
parallel size > 1 on CUDA, first calls vLLM's ``current_stream()`` helper
(vllm/utils/torch_utils.py:798-833) so that its one-time move of the thread to a dedicated stream
happens before the runner, its ``PPHandler`` (pp_utils.py:73) and its cached ``main_stream``
(model_runner.py:623-626) look up the current stream. Logs one line naming the stream.

WHY: That helper moves the calling thread to a new stream the first time it runs there. When its
first call comes from inside a forward (Kimi-K3's shared-expert overlap reads it,
model_executor/layers/fused_moe/runner/shared_experts.py:156), the runner has already cached the
stream of construction: part of every step then runs on the new stream and part on the old one
(the async output copy restores the cached stream, async_utils.py:295-303), with nothing ordering
the two; the PP handler broadcast sampled tokens and drafts before they were written and rank 0
embedded stale memory as token ids (docs/k3-pp-race.md). Stock vLLM 0.34.0 fails the same.
Making the move first leaves one stream for everything, which is what PP=1 and the other families
get by the order their code happens to run in.

UPSTREAM: none filed yet (the helper's lazy switch, or the runner's cached stream).

RETIRE WHEN: vLLM fixes the thread's stream before building the model runner, or its runner
stops caching the stream of construction.

TESTED BY: tests/unit/protocol/test_pp_handler_streams.py (the helper runs before the runner's
own constructor, only at PP > 1 on CUDA); tests/gpu/test_dsv4_k3_pp.py (Kimi-K3 PP=2 DSpark
lossless with the stream patches, failing with them skipped: ``k3_pp2_streams_skipped``)
"""

from __future__ import annotations

from typing import Any

from vllm_dspark_pp.patches import when_imported
from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.v1.worker.gpu.model_runner"


def _pipeline_size(vllm_config: Any) -> int:
    return int(getattr(getattr(vllm_config, "parallel_config", None), "pipeline_parallel_size", 1))


def _is_cuda(device: Any) -> bool:
    return getattr(device, "type", str(device).split(":")[0]) == "cuda"


def pin_stream(vllm_config: Any, device: Any) -> Any:
    """Move this thread to vLLM's dedicated stream now (PP > 1 on CUDA); returns that stream or
    None when nothing was done."""
    if _pipeline_size(vllm_config) <= 1 or not _is_cuda(device):
        return None
    import torch
    from vllm.utils.torch_utils import current_stream

    before = torch.cuda.current_stream(device)
    stream = current_stream()
    from vllm.logger import init_logger

    init_logger("vllm.dspark_pp.streams").info(
        "PP: this worker's steps run on CUDA stream %#x (current before the model runner: %#x)",
        stream.cuda_stream,
        before.cuda_stream,
    )
    return stream


def _make_init(init):
    def __init__(self, vllm_config, device, *args, **kwargs):
        pin_stream(vllm_config, device)
        init(self, vllm_config, device, *args, **kwargs)

    return __init__


def _patch(module) -> None:
    wrap(module.GPUModelRunner, "__init__", _make_init)


def apply() -> None:
    when_imported(TARGET, _patch)
