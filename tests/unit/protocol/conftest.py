"""Fixtures of the PP token-exchange tests (CPU, no device)."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
sys.path.insert(0, os.path.dirname(__file__))

import protocol_sim  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def protocol_patches():
    protocol_sim.apply_protocol_patches()


@pytest.fixture
def cpu_streams():
    with protocol_sim.cpu_streams():
        yield


@pytest.fixture
def patch_broadcast(monkeypatch, cpu_streams):
    """Call with a function to stand in for torch.distributed.broadcast."""

    def install(fn):
        monkeypatch.setattr(torch.distributed, "broadcast", fn)

    return install
