"""PPHandler orders its side stream against the stream the runner is on at each call.

WHAT: Turns ``PPHandler.main_stream`` into a property of vLLM's ``PPHandler`` class (so also of
``DSparkPPHandler``, its subclass): it answers the calling thread's current CUDA stream instead
of the stream that was current when the handler was built (vllm/v1/worker/gpu/pp_utils.py:73).
Every ordering the handler makes then names the stream that produced or consumes the data: the
broadcast stream waits for the sampled tokens and drafts (pp_utils.py:170, :192, :253 and the
plugin's ``broadcast`` / ``broadcast_drafts`` / ``receive``), the consuming stream waits for the
receive event (``get_prev_sampled_outputs``, pp_utils.py:156) and the received buffers are
recorded on it (pp_utils.py:216-219). The handler's ``get_prev_sampled_outputs`` also records the
buffers it hands out on the stream that consumes them. On a device without CUDA streams (vLLM's
CPU platform, plain tensors in unit tests) the stored stream is answered as before. One log line
per process says when the two streams differ.

WHY: The handler captured ``torch.cuda.current_stream()`` once, in the model runner's
constructor, but the runner's steps do not have to run on that stream: vLLM switches a thread to
a dedicated stream the first time its ``current_stream()`` helper runs there
(vllm/utils/torch_utils.py:798-833), and any later ``set_stream`` moves it again. Measured on one
H100 with Kimi-K3 at PP=2 (docs/k3-pp-race.md, run 2): both ranks sampled, broadcast and
consumed on a stream other than the handler's. The broadcast stream then waited on an idle
stream, so the last rank sent sampled-token and draft buffers before the sampler and the draft
gather had written them (rank 0 received the padding but stale memory in the token columns), and
rank 0's post-update read its receive buffers without waiting for the receive. Rank 0 embedded
the stale memory as token ids: the "index out of bounds" at the first decode step, in stock vLLM
as in the plugin. ``CUDA_LAUNCH_BLOCKING=1`` on both ranks hid it (every kernel done before the
next launch); on one rank only it did not.

UPSTREAM: none filed yet; the same construction-time capture is in vLLM 0.34.0's stock
``PPHandler`` (stock vLLM fails the same way with Kimi-K3 at PP=2).

RETIRE WHEN: vLLM's PPHandler looks its main stream up at each use (or the runner guarantees
that its steps run on the stream current at construction).

TESTED BY: tests/unit/protocol/test_pp_handler_streams.py (the property follows a stream switch,
both sides order on the switched stream, and the orderings name the old stream with this patch
left out); tests/gpu/test_dsv4_k3_pp.py (Kimi-K3 PP=2 DSpark lossless with this patch, fails with
it skipped: ``k3_pp2_streams_skipped``)
"""

from __future__ import annotations

from typing import Any

from vllm_dspark_pp.patches import when_imported

TARGET = "vllm.v1.worker.gpu.pp_utils"

#: Set on a handler instance: the stream that was current when it was built.
BUILT_ON = "_dspark_built_on_stream"


def _uses_cuda_streams(device: Any) -> bool:
    return getattr(device, "type", str(device).split(":")[0]) == "cuda"


def _current_stream(device: Any):
    import torch

    return torch.cuda.current_stream(device)


def _get_main_stream(self):
    built_on = self.__dict__.get(BUILT_ON)
    device = self.__dict__.get("device")
    if not _uses_cuda_streams(device):
        return built_on
    current = _current_stream(device)
    if built_on is not None and current != built_on and not self.__dict__.get("_dspark_told"):
        self.__dict__["_dspark_told"] = True
        from vllm.logger import init_logger

        init_logger("vllm.dspark_pp.streams").info(
            "PP handler: this rank's steps run on CUDA stream %#x, not on the stream current "
            "when the handler was built (%#x); the PP exchange orders against the current one",
            current.cuda_stream,
            built_on.cuda_stream,
        )
    return current


def _set_main_stream(self, stream) -> None:
    self.__dict__[BUILT_ON] = stream


def _recording_get_prev(real):
    def get_prev_sampled_outputs(self, *args, **kwargs):
        outputs = real(self, *args, **kwargs)
        if outputs and _uses_cuda_streams(self.__dict__.get("device")):
            consumer = self.main_stream
            for value in outputs.values():
                if value is not None and getattr(value, "is_cuda", False):
                    value.record_stream(consumer)
        return outputs

    get_prev_sampled_outputs.__wrapped__ = real  # type: ignore[attr-defined]
    get_prev_sampled_outputs.__doc__ = real.__doc__
    return get_prev_sampled_outputs


def stock_handler_class(cls: type) -> type:
    """vLLM's own ``PPHandler`` in ``cls``'s MRO (the class pp_utils defines)."""
    return next(c for c in cls.__mro__ if c.__module__ == TARGET and c.__name__ == "PPHandler")


def _patch(module) -> None:
    base = stock_handler_class(module.PPHandler)
    if isinstance(base.__dict__.get("main_stream"), property):
        return
    base.main_stream = property(_get_main_stream, _set_main_stream)  # type: ignore[attr-defined]
    real = base.__dict__["get_prev_sampled_outputs"]
    base.get_prev_sampled_outputs = _recording_get_prev(real)  # type: ignore[attr-defined]


def apply() -> None:
    when_imported(TARGET, _patch)
