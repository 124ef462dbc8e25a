"""Under PP, a worker's steps stay on one CUDA stream: the one the model runner is built on.

WHAT: ``GPUModelRunner.__init__`` (vllm/v1/worker/gpu/model_runner.py:207), when pipeline
parallel size > 1 on CUDA, first calls vLLM's ``current_stream()`` helper
(vllm/utils/torch_utils.py:798-833) so that its one-time move of the thread to a dedicated stream
happens before the runner, its ``PPHandler`` (pp_utils.py:73) and its cached ``main_stream``
(model_runner.py:623-626) look up the current stream. Logs one line naming the stream.

WHY: That helper moves the calling thread to a new stream the first time it runs there; the
runner's ``PPHandler`` and its cached ``main_stream`` keep the stream current at construction
(the legacy default stream, measured in every worker of a Kimi-K3 PP=2 deployment). When the
helper's first call comes during a step (something on Kimi-K3's path calls it; which call comes
first was not traced: with the shared-expert stream off it still failed), the thread runs its
steps on the new stream while the PP handler orders against the old one, and the async output
copy restores the old one (async_utils.py:295-303), with nothing ordering the two. Measured on
one H100 (docs/k3-pp-race.md, runs 2-5): the last rank broadcast sampled tokens and drafts before
they were written (rank 0 received the padding and stale memory in the token columns), rank 0
embedded that memory as token ids, and the request failed with an index-out-of-bounds assert, in
stock vLLM as with the plugin. Moving the thread first leaves one stream for everything, which is
what PP=1 and the other families get by the order their code happens to run in.

UPSTREAM: none filed yet (the helper's lazy switch, or the runner's cached stream).

RETIRE WHEN: vLLM fixes the thread's stream before building the model runner, or its runner
stops caching the stream of construction.

TESTED BY: tests/unit/protocol/test_pp_worker_stream.py (the helper runs before the runner's own
constructor, only at PP > 1 on CUDA; vLLM's handler orders against its stream of construction);
tests/gpu/test_dsv4_k3_pp.py (Kimi-K3 PP=2 DSpark lossless, CUDA graphs and eager; failing with
this patch skipped: the ``streams_skipped`` variant)
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
