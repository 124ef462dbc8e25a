"""Fixtures of the PP token-exchange tests (CPU, no device)."""

from __future__ import annotations

import protocol_sim  # this directory is on sys.path (pytest's rootdir-less conftest import)
import pytest
import torch


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
