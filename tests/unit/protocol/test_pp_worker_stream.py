"""Under PP a worker's steps stay on the stream its model runner was built on
(vllm_dspark_pp/patches/v1_worker_gpu_model_runner__streams.py): vLLM's stream helper runs before
the runner's constructor, only at PP > 1 on CUDA; and the fact that makes it necessary: vLLM
0.34.0's ``PPHandler`` orders its side stream against the stream current at its construction,
whatever stream the thread moved to since (Kimi-K3 at PP=2 embedded stale memory,
docs/k3-pp-race.md). Stand-in CUDA streams log what waits on what."""

from __future__ import annotations

import contextlib
import types
from collections import deque

import numpy as np
import pytest
import torch

LOG: list[tuple[str, str, str]] = []


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name, self.cuda_stream = name, 0x1000 + len(name)

    def wait_stream(self, other) -> None:
        LOG.append((self.name, "wait_stream", other.name))

    def wait_event(self, event) -> None:
        LOG.append((self.name, "wait_event", str(event)))

    def record_event(self):
        return f"event-of-{self.name}"

    def __eq__(self, other) -> bool:
        return isinstance(other, FakeStream) and other.name == self.name

    __hash__ = object.__hash__


def _vllm_handler() -> type:
    from vllm.v1.worker.gpu import pp_utils

    from vllm_dspark_pp.protocol.handler import vllm_pp_handler_class

    return vllm_pp_handler_class(pp_utils.PPHandler)


def _handler(cls: type, built: FakeStream):
    h = object.__new__(cls)
    h.device = torch.device("cuda", 0)  # a device object only: no CUDA is touched
    h.main_stream = built
    h.broadcast_stream = FakeStream("broadcast")
    h.is_last_rank, h.last_rank, h.broadcast_group = True, 1, None
    h.sampled_tokens_broadcast = True
    h.req_idx_gen_np = np.zeros(4, dtype=np.int32)
    return h


@pytest.fixture
def streams(monkeypatch):
    current = {"s": FakeStream("built")}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current["s"])
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.distributed, "broadcast", lambda t, src, group: None)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: LOG.append((s.name, "rec", "")))
    LOG.clear()
    return current


def _consume(cls: type, built: FakeStream, switched: FakeStream, current) -> list:
    from vllm.v1.worker.gpu.pp_utils import PendingRecv

    h = _handler(cls, built)
    h.is_last_rank = False
    idx = np.array([0, 1])
    h.queue = deque(
        [
            PendingRecv(
                "recv-event",
                torch.zeros(2, 3, dtype=torch.int64),
                torch.ones(2, dtype=torch.int32),
                torch.zeros(2, dtype=torch.int32),
                torch.tensor([0, 1]),
                idx,
                np.array([True, True]),
                h.req_idx_gen_np[idx].copy(),
            )
        ]
    )
    current["s"] = switched
    LOG.clear()
    assert h.get_prev_sampled_outputs() is not None
    return list(LOG)


def _send_drafts(cls: type, built: FakeStream, switched: FakeStream, current) -> list:
    h = _handler(cls, built)
    current["s"] = switched
    LOG.clear()
    h.broadcast_drafts(torch.zeros(2, 4, dtype=torch.int64))
    return [e for e in LOG if e[1] == "wait_stream"]


def test_vllms_handler_orders_against_the_stream_it_was_built_on(streams):
    """vLLM 0.34.0 as shipped: after the thread moved from the stream of construction to another
    one, the last rank's broadcast still waits for the old stream (not for the one that wrote the
    drafts) and the consuming rank's old stream waits for the receive: the split the patch
    prevents by moving the thread before the runner and its handler are built."""
    cls = _vllm_handler()
    built, runner = FakeStream("built"), FakeStream("runner")
    assert _send_drafts(cls, built, runner, streams) == [("broadcast", "wait_stream", "built")]
    got = _consume(cls, built, runner, streams)
    assert ("built", "wait_event", "recv-event") in got
    assert not [e for e in got if e[0] == "runner"]


def _runner_module(calls: list[str]):
    class GPUModelRunner:
        def __init__(self, vllm_config, device):
            calls.append("runner init")

    return types.SimpleNamespace(GPUModelRunner=GPUModelRunner)


@pytest.mark.parametrize(
    "pp, device, pinned",
    [(2, "cuda:0", True), (1, "cuda:0", False), (3, "cpu", False)],
)
def test_the_runner_moves_to_vllms_stream_before_it_is_built_only_under_pp_on_cuda(
    monkeypatch, pp, device, pinned
):
    """The model runner patch runs vLLM's stream helper (whose first call moves the thread to a
    dedicated stream) before the runner's own constructor caches any stream; nothing at PP=1 or
    on the CPU. Control: the unpatched class never calls the helper."""
    import vllm.utils.torch_utils as tu

    from vllm_dspark_pp.patches import v1_worker_gpu_model_runner__streams as R

    calls: list[str] = []
    monkeypatch.setattr(tu, "current_stream", lambda: calls.append("helper") or FakeStream("d"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: FakeStream("default"))
    cfg = types.SimpleNamespace(parallel_config=types.SimpleNamespace(pipeline_parallel_size=pp))
    control = _runner_module(calls)
    control.GPUModelRunner(cfg, torch.device(device))
    assert calls == ["runner init"]
    calls.clear()
    module = _runner_module(calls)
    R._patch(module)
    R._patch(module)  # idempotent
    module.GPUModelRunner(cfg, torch.device(device))
    assert calls == (["helper", "runner init"] if pinned else ["runner init"])
